// The files of a part's state in a checkpoint (train::save_state, load_state): every rank that
// holds a piece writes "<name>-rank<r>-of-<N>.safetensors" with each piece under
// "<tensor>/<first element>"; the first writes "<name>_manifest.json" (the files and the part's
// values). StateFiles reads any range of any tensor from the files that hold it.
#pragma once
#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "cohort/json.h"
#include "cohort/train/checkpoint.h"

namespace cohort::train::detail {

// "<stem>-rank<r>-of-<N><extension>": a file one rank of N writes into a checkpoint.
std::string rank_file(const char* stem, int rank, int world_size, const char* extension);

// The manifest of part `name`'s files in a checkpoint folder.
std::string state_manifest_file(const std::string& name);
// Writes part `name`'s manifest into `dir` (replaced): the part is in `shards` pieces, of which
// `dir` holds `files`; its `values`.
void write_state_manifest(const std::filesystem::path& dir, const std::string& name, int shards,
                          const std::vector<std::string>& files, const Json& values);
// This rank's piece of part `name` (save_state) with a manifest that names its file only: the
// state of one rank, which a rank holding the same piece takes whole (a live regroup's).
void save_own_piece(const std::filesystem::path& dir, const std::string& name,
                    const optim::StateDict& state);

// The files of one part's state in `dir`, checked against their manifest.
class StateFiles {
 public:
  // UsageError when `dir` has no manifest of `name`, or it names a file that is missing.
  StateFiles(std::filesystem::path dir, const std::string& name);

  // The part's values (e.g. an optimizer's algorithm, steps and lr).
  const Json& values() const { return values_; }
  // Whether the files hold any piece of a tensor whose name starts with `prefix`.
  bool holds_prefix(const std::string& prefix) const;
  // Elements [begin, begin + target.numel()) of tensor `tensor` into `target` (1-D), read from
  // the pieces that overlap them; UsageError naming the range when they do not cover it.
  void read(const std::string& tensor, int64_t begin, at::Tensor target) const;

 private:
  struct Piece {
    std::filesystem::path file;
    const safetensors::Header* header;
    std::string name;  // in the file
    int64_t begin, length;
    at::ScalarType dtype;
  };
  std::filesystem::path dir_;
  std::string what_;  // "its <name> state" in errors
  Json values_;
  std::vector<std::pair<std::filesystem::path, safetensors::Header>> headers_;
  std::map<std::string, std::vector<Piece>> pieces_;  // by tensor
};

}  // namespace cohort::train::detail

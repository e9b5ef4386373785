// A live regroup's own state kept as its tensors instead of files (live_recovery.h): a survivor
// that takes its own state back after the regroup reads it from the tensors its model and
// optimizer held, with no copy into file bytes, no file written and none read (each of them a
// copy into fresh memory: seconds per GB on a busy host).
#pragma once
#include <filesystem>
#include <map>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

#include "cohort/train/safetensors_header.h"

namespace torch::nn {
class Module;
}  // namespace torch::nn
namespace torch::optim {
class Optimizer;
}  // namespace torch::optim

namespace cohort::train {

// The safetensors file a save would have written: its tensors (the saver's own, not copied) and
// metadata.
struct KeptTensorFile {
  std::map<std::string, at::Tensor> tensors;
  std::map<std::string, std::string> metadata;
};
// By path relative to the folder they were saved under.
using KeptTensorFiles = std::map<std::string, KeptTensorFile>;

// While it lives, safetensors::write on this thread of a file under `root` (however deep) whose
// tensors are all on the CPU keeps them in `kept` instead of writing them (what write_streaming
// writes, and files of CUDA tensors, are written as ever).
class TensorKeeping {
 public:
  TensorKeeping(std::filesystem::path root, KeptTensorFiles& kept);
  ~TensorKeeping();
  TensorKeeping(const TensorKeeping&) = delete;
  TensorKeeping& operator=(const TensorKeeping&) = delete;
  // Keeps `tensors` and `metadata` as `file` where a TensorKeeping of this thread takes it and
  // they are all CPU tensors: whether it did.
  static bool keep(const std::filesystem::path& file,
                   const std::map<std::string, at::Tensor>& tensors,
                   const std::map<std::string, std::string>& metadata);

 private:
  std::filesystem::path root_;
  KeptTensorFiles& kept_;
  TensorKeeping* previous_;
};

// Files kept under a folder, read in place of the disk's (WorkerSession::kept_state): a live
// round's state folder holds the rest of the state.
struct KeptState {
  std::filesystem::path root;  // absolute
  std::shared_ptr<const KeptTensorFiles> files;
};

// A safetensors file's `bytes` (received from a peer) as its tensors, over those bytes (no copy);
// a UsageError naming `file` where they are no such file (safetensors::parse_header's checks).
KeptTensorFile kept_from_bytes(std::string bytes, const std::filesystem::path& file);

// The kept file at `file` in this thread's worker session's kept state; null where none is kept
// there (outside a session too).
const KeptTensorFile* kept_tensor_file(const std::filesystem::path& file);
// The header a file of `kept`'s tensors would have (data_start 0, the tensors in name order).
safetensors::Header header_of(const KeptTensorFile& kept);
// The header of the safetensors file at `file`: a kept one's (header_of), else read from the
// disk (safetensors::read_header).
safetensors::Header tensor_file_header(const std::filesystem::path& file);
// Elements [first, first + out.numel()) of tensor `name` of a kept file into `out` (a contiguous
// CPU tensor of its dtype): safetensors::read_elements' checks and errors.
void read_kept_elements(const KeptTensorFile& kept, const std::filesystem::path& file,
                        const std::string& name, int64_t first, at::Tensor& out);

// A rank's own state kept whole in this session for the checkpoint in `dir` (a live regroup's,
// DDP: its model file and its optimizer state as one shard), taken by `module` and `optimizer`
// as their memory instead of copied into theirs (optim::FlatOptimizer::adopt): the memory was
// their predecessors' in this process, and the load that follows copies nothing. Whether it
// did: not where `optimizer` is no flat optimizer or an engine (ZeRO, local SGD), nothing is
// kept for `dir`, or the kept tensors are not one flat optimizer's buffers (a peer's, received).
bool adopt_kept_state(const std::filesystem::path& dir, torch::nn::Module& module,
                      torch::optim::Optimizer& optimizer);

}  // namespace cohort::train

#include "train/state_files.h"

#include <algorithm>

#include "cohort/error.h"
#include "train/kept_tensors.h"
#include "train/manifest.h"
#include "train/run_files.h"

namespace cohort::train {
namespace detail {

std::string rank_file(const char* stem, int rank, int world_size, const char* extension) {
  return std::string(stem) + "-rank" + std::to_string(rank) + "-of-" + std::to_string(world_size) +
         extension;
}

std::string state_manifest_file(const std::string& name) { return name + "_manifest.json"; }

void write_state_manifest(const std::filesystem::path& dir, const std::string& name, int shards,
                          const std::vector<std::string>& files, const Json& values) {
  const Json manifest{
      {"format", kStateFormat}, {"shards", shards}, {"files", files}, {"values", values}};
  write_atomically(dir / state_manifest_file(name), manifest.dump(2) + "\n");
}

void save_own_piece(const std::filesystem::path& dir, const std::string& name,
                    const optim::StateDict& state) {
  save_state(dir, name, state);
  write_state_manifest(dir, name, state.shards,
                       {rank_file(name.c_str(), state.shard, state.shards, ".safetensors")},
                       state.values);
}

StateFiles::StateFiles(std::filesystem::path dir, const std::string& name)
    : dir_(std::move(dir)), what_("its " + name + " state") {
  const auto manifest_file = dir_ / state_manifest_file(name);
  if (!std::filesystem::exists(manifest_file)) {
    throw UsageError("checkpoint " + dir_.string() + " has no " +
                     manifest_file.filename().string() + ": it holds no " + name + " state");
  }
  const auto manifest =
      read_state_manifest(read_json(manifest_file), name,
                          "checkpoint " + dir_.string() + ": " + manifest_file.filename().string());
  values_ = manifest.values;
  for (const auto& name_of_file : manifest.files) {
    const auto file = dir_ / name_of_file;
    const auto* kept = kept_tensor_file(file);
    if (kept == nullptr && !std::filesystem::exists(file)) {
      throw UsageError("checkpoint " + dir_.string() + ": the shard file " + name_of_file +
                       " named by " + manifest_file.filename().string() + " is missing");
    }
    headers_.emplace_back(file,
                          kept != nullptr ? header_of(*kept) : safetensors::read_header(file));
  }
  for (const auto& [file, header] : headers_) {
    for (const auto& [piece, info] : header.tensors) {
      const auto parsed = parse_piece_name(piece);
      if (!parsed || info.shape.size() != 1) continue;
      pieces_[parsed->tensor].push_back(
          {file, &header, piece, parsed->offset, info.shape[0], info.dtype});
    }
  }
}

bool StateFiles::holds_prefix(const std::string& prefix) const {
  const auto found = pieces_.lower_bound(prefix);
  return found != pieces_.end() && found->first.rfind(prefix, 0) == 0;
}

void StateFiles::read(const std::string& tensor, int64_t begin, at::Tensor target) const {
  const int64_t length = target.numel();
  int64_t covered = 0;
  const auto found = pieces_.find(tensor);
  if (found != pieces_.end()) {
    const auto& pieces = found->second;
    std::vector<PieceRange> ranges;
    for (const auto& p : pieces) ranges.push_back({p.begin, p.length});
    // Each element from one piece: pieces that overlap (an altered file) are read once.
    for (const auto& read : plan_piece_reads(ranges, begin, length)) {
      const auto& p = pieces[read.piece];
      auto part = target.narrow(0, read.begin - begin, read.end - read.begin);
      auto buffer = part.is_contiguous() && part.is_cpu() && part.scalar_type() == p.dtype
                        ? part
                        : at::empty({read.end - read.begin}, at::TensorOptions(p.dtype));
      safetensors::read_elements(p.file, *p.header, p.name, read.begin - p.begin, buffer);
      if (!buffer.is_same(part)) part.copy_(buffer);
      covered += read.end - read.begin;
    }
  }
  if (covered != length) {
    throw UsageError("checkpoint " + dir_.string() + ": " + what_ + " covers " +
                     std::to_string(covered) + " of the " + std::to_string(length) + " elements [" +
                     std::to_string(begin) + ", " + std::to_string(begin + length) + ") of '" +
                     tensor + "': a shard file is missing or altered, or the model differs");
  }
}

}  // namespace detail

void save_state(const std::filesystem::path& dir, const std::string& name,
                const optim::StateDict& state) {
  if (state.shards < 1 || state.shard < 0 || state.shard >= state.shards) {
    throw UsageError("save_state: part '" + name + "' is shard " + std::to_string(state.shard) +
                     " of " + std::to_string(state.shards) + ": a shard is in [0, shards)");
  }
  torch::NoGradGuard no_grad;
  std::map<std::string, at::Tensor> tensors;
  std::map<std::string, const std::function<void()>*> releases;
  for (const auto& [tensor, piece] : state.tensors) {
    if (piece.values.dim() != 1 || piece.offset < 0 ||
        piece.offset + piece.values.numel() > piece.numel) {
      throw UsageError("save_state: tensor '" + tensor + "' of part '" + name + "' is a piece of " +
                       std::to_string(piece.values.numel()) + " elements at " +
                       std::to_string(piece.offset) + " of a tensor of " +
                       std::to_string(piece.numel) + ": a piece is 1-D and inside its tensor");
    }
    const auto file_name = detail::piece_name(tensor, piece.offset);
    tensors[file_name] = piece.values;
    if (piece.release) releases[file_name] = &piece.release;
  }
  std::filesystem::create_directories(dir);
  // A part of values only, held whole (a loss scaler's, a schedule's): its manifest alone.
  const bool values_only = state.shards == 1 && tensors.empty();
  if (!values_only) {
    const auto file = detail::rank_file(name.c_str(), state.shard, state.shards, ".safetensors");
    // Each piece's pages go back as soon as it is written (a state offloaded to disk streams).
    safetensors::write(dir / file, tensors, {{"format", detail::kStateFormat}},
                       [&](const std::string& written) {
                         if (const auto it = releases.find(written); it != releases.end())
                           (*it->second)();
                       });
  }
  if (state.shard != 0) return;
  std::vector<std::string> files;
  for (int r = 0; r < state.shards && !values_only; ++r)
    files.push_back(detail::rank_file(name.c_str(), r, state.shards, ".safetensors"));
  detail::write_state_manifest(dir, name, state.shards, files, state.values);
}

void load_state(const std::filesystem::path& dir, const std::string& name, optim::Stateful& part) {
  const detail::StateFiles files(dir, name);
  part.check_state(files.values());
  auto state = part.state_to_load(files.values());
  torch::NoGradGuard no_grad;
  for (auto& [tensor, piece] : state.tensors) {
    files.read(tensor, piece.offset, piece.values);
    if (piece.release) piece.release();
  }
  state.values = files.values();
  part.load_state_dict(state);
}

bool holds_state(const std::filesystem::path& dir, const std::string& name) {
  return std::filesystem::exists(dir / detail::state_manifest_file(name));
}

}  // namespace cohort::train

#include "train/kept_tensors.h"

#include <ATen/ops/from_blob.h>
#include <c10/core/ScalarType.h>

#include <memory>
#include <string_view>
#include <utility>

#include "cohort/error.h"
#include "cohort/optim/flat_optimizer.h"
#include "cohort/optim/state_dict.h"
#include "cohort/train/checkpoint.h"
#include "train/manifest.h"
#include "train/state_files.h"
#include "train/worker_session.h"
#include "train/zero_checkpoint.h"

namespace cohort::train {
namespace {

// The innermost TensorKeeping of this thread.
thread_local TensorKeeping* active_keeping = nullptr;

// `path` relative to `root`, or empty where it is not under it.
std::string relative_under(const std::filesystem::path& path, const std::filesystem::path& root) {
  const auto rel = path.lexically_normal().lexically_relative(root.lexically_normal());
  if (rel.empty() || *rel.begin() == "..") return {};
  return rel.string();
}

}  // namespace

TensorKeeping::TensorKeeping(std::filesystem::path root, KeptTensorFiles& kept)
    : root_(std::move(root)), kept_(kept), previous_(active_keeping) {
  active_keeping = this;
}

TensorKeeping::~TensorKeeping() { active_keeping = previous_; }

bool TensorKeeping::keep(const std::filesystem::path& file,
                         const std::map<std::string, at::Tensor>& tensors,
                         const std::map<std::string, std::string>& metadata) {
  if (active_keeping == nullptr) return false;
  const auto relative = relative_under(file, active_keeping->root_);
  if (relative.empty()) return false;
  for (const auto& [name, tensor] : tensors)
    if (!tensor.is_cpu()) return false;
  KeptTensorFile kept{.metadata = metadata};
  for (const auto& [name, tensor] : tensors) {
    (void)safetensors::dtype_name(tensor.scalar_type(), name);  // one the format holds
    kept.tensors[name] = tensor.detach().contiguous();
  }
  active_keeping->kept_[relative] = std::move(kept);
  return true;
}

KeptTensorFile kept_from_bytes(std::string bytes, const std::filesystem::path& file) {
  auto owned = std::make_shared<std::string>(std::move(bytes));
  const std::string_view all(*owned);
  const auto size = static_cast<int64_t>(all.size());
  const uint64_t length = safetensors::header_length(all.substr(0, 8), size, file.string());
  const auto header = safetensors::parse_header(all.substr(8, length), size, file.string());
  KeptTensorFile kept{.metadata = header.metadata};
  char* data = owned->data() + header.data_start;
  // One storage over the data: tensors that lie one after another there (a flat optimizer's
  // buffer, as a peer sends it) are then one buffer to whoever takes them (adopt_kept_state).
  const auto data_bytes = at::from_blob(
      data, {size - header.data_start}, [owned](void*) {}, at::TensorOptions(at::kByte));
  for (const auto& [name, info] : header.tensors) {
    const auto element = static_cast<int64_t>(c10::elementSize(info.dtype));
    if (info.begin % element == 0) {
      auto tensor = at::empty({0}, at::TensorOptions(info.dtype));
      tensor.set_(data_bytes.storage(), info.begin / element, info.shape,
                  c10::contiguous_strides(info.shape));
      kept.tensors[name] = std::move(tensor);
    } else {
      kept.tensors[name] = at::from_blob(
          data + info.begin, info.shape, [owned](void*) {}, at::TensorOptions(info.dtype));
    }
  }
  return kept;
}

const KeptTensorFile* kept_tensor_file(const std::filesystem::path& file) {
  const WorkerSession* session = current_session();
  if (session == nullptr || !session->kept_state.files) return nullptr;
  const auto relative = relative_under(std::filesystem::absolute(file), session->kept_state.root);
  if (relative.empty()) return nullptr;
  const auto found = session->kept_state.files->find(relative);
  return found == session->kept_state.files->end() ? nullptr : &found->second;
}

safetensors::Header header_of(const KeptTensorFile& kept) {
  safetensors::Header header{.metadata = kept.metadata};
  int64_t offset = 0;
  for (const auto& [name, tensor] : kept.tensors) {
    const int64_t bytes = tensor.numel() * static_cast<int64_t>(tensor.element_size());
    header.tensors[name] = {.dtype = tensor.scalar_type(),
                            .shape = tensor.sizes().vec(),
                            .begin = offset,
                            .end = offset + bytes};
    offset += bytes;
  }
  return header;
}

safetensors::Header tensor_file_header(const std::filesystem::path& file) {
  if (const auto* kept = kept_tensor_file(file)) return header_of(*kept);
  return safetensors::read_header(file);
}

void read_kept_elements(const KeptTensorFile& kept, const std::filesystem::path& file,
                        const std::string& name, int64_t first, at::Tensor& out) {
  const auto found = kept.tensors.find(name);
  if (found == kept.tensors.end())
    throw UsageError("safetensors file " + file.string() + " has no tensor '" + name + "'");
  const auto& tensor = found->second;
  if (out.scalar_type() != tensor.scalar_type() || !out.is_contiguous() || !out.is_cpu() ||
      first < 0 || first + out.numel() > tensor.numel()) {
    throw UsageError("safetensors file " + file.string() + ": elements [" + std::to_string(first) +
                     ", " + std::to_string(first + out.numel()) + ") of '" + name +
                     "' are outside the tensor or of another dtype");
  }
  if (out.numel() == 0) return;
  const auto source = tensor.view({-1}).narrow(0, first, out.numel());
  if (source.data_ptr() == out.data_ptr()) return;  // the kept memory itself (adopt_kept_state)
  out.view({-1}).copy_(source);
}

bool adopt_kept_state(const std::filesystem::path& dir, torch::nn::Module& module,
                      torch::optim::Optimizer& optimizer) {
  auto* flat = dynamic_cast<optim::FlatOptimizer*>(&optimizer);
  if (flat == nullptr || dynamic_cast<optim::ShardedState*>(&optimizer) != nullptr ||
      optimizer.param_groups().size() != 1)
    return false;
  const auto* model = kept_tensor_file(dir / "model.safetensors");
  const auto* state =
      kept_tensor_file(dir / detail::rank_file(optim::kOptimizerShardsPart, 0, 1, ".safetensors"));
  if (model == nullptr || state == nullptr) return false;
  // As the load that follows reads it: this algorithm's state, whole in one shard.
  const Json values = detail::StateFiles(dir, optim::kOptimizerShardsPart).values();
  const auto state_names =
      optim::state_names_of(flat->algorithm(), optimizer.param_groups()[0].options());
  try {
    optim::check_optimizer_state(values, flat->algorithm(), state_names);
  } catch (const UsageError&) {
    return false;  // the load that follows says why
  }
  const int64_t steps = values.value("steps", int64_t{0});
  const auto names = detail::parameter_names(optimizer, module, "adopt_kept_state");
  std::vector<at::Tensor> weights;
  std::vector<optim::FlatOptimizer::ParameterState> states;
  const auto kept = [](const KeptTensorFile& file, const std::string& name) {
    const auto found = file.tensors.find(name);
    return found == file.tensors.end() ? at::Tensor() : found->second;
  };
  for (const auto& name : names) {
    weights.push_back(kept(*model, name));
    optim::FlatOptimizer::ParameterState parameter{.steps = steps, .values = {}};
    for (const auto& s : state_names) {
      parameter.values.push_back(kept(*state, detail::piece_name(name + "/" + s, 0)));
      if (!parameter.values.back().defined()) return false;
    }
    states.push_back(std::move(parameter));
  }
  return flat->adopt(0, weights, states);
}

}  // namespace cohort::train

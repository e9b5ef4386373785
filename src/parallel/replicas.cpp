#include "replicas.h"

#include <torch/torch.h>

#include <functional>
#include <map>
#include <set>
#include <utility>

#include "cohort/error.h"

namespace cohort::parallel::detail {
namespace {

std::string format_shape(at::IntArrayRef dims) {
  std::string out = "[";
  for (size_t k = 0; k < dims.size(); ++k) {
    if (k) out += ',';
    out += std::to_string(dims[k]);
  }
  return out + "]";
}

}  // namespace

std::string describe(const at::Tensor& t) {
  return format_shape(t.sizes()) + " " + c10::toString(t.scalar_type());
}

void start_replicas(comm::ProcessGroup& group, const std::vector<std::string>& names,
                    const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& buffers,
                    const std::string& who) {
  if (group.world_size() < 2) return;
  verify_same_layout(group, names, params, who);
  take_rank0_state(group, params, buffers);
}

void take_rank0_state(comm::ProcessGroup& group, const std::vector<at::Tensor>& params,
                      const std::vector<at::Tensor>& buffers) {
  if (group.world_size() < 2) return;
  std::vector<at::Tensor> state;
  for (const auto& p : params) state.push_back(p.detach());
  state.insert(state.end(), buffers.begin(), buffers.end());
  broadcast_from_rank0(group, state);
}

NamedParameters trainable_parameters(const torch::nn::Module& module,
                                     const std::vector<at::Tensor>& optimizer_params,
                                     const std::string& who) {
  NamedParameters out;
  for (const auto& item : module.named_parameters()) {
    if (!item.value().requires_grad()) continue;
    out.names.push_back(item.key());
    out.params.push_back(item.value());
  }
  if (out.params.empty()) throw UsageError(who + ": the module has no trainable parameters");
  std::set<const void*> theirs;
  for (const auto& p : optimizer_params) theirs.insert(p.unsafeGetTensorImpl());
  const auto& first = out.params[0];
  for (size_t i = 0; i < out.params.size(); ++i) {
    const auto& p = out.params[i];
    if (!theirs.count(p.unsafeGetTensorImpl())) {
      throw UsageError(who + ": parameter '" + out.names[i] +
                       "' of the module is not in the optimizer: build the optimizer over "
                       "module->parameters()");
    }
    if (p.scalar_type() != first.scalar_type() || p.device() != first.device()) {
      throw UsageError(who + ": parameter '" + out.names[i] + "' is " + describe(p) + " on " +
                       p.device().str() + ", '" + out.names[0] + "' " + describe(first) + " on " +
                       first.device().str() + ": " + who +
                       " needs one dtype and device for all trainable parameters");
    }
  }
  if (theirs.size() != out.params.size()) {
    throw UsageError(who + ": the optimizer holds " + std::to_string(theirs.size()) +
                     " parameters, the module " + std::to_string(out.params.size()) +
                     " trainable ones: build the optimizer over module->parameters()");
  }
  return out;
}

void verify_same_layout(comm::ProcessGroup& group, const std::vector<std::string>& names,
                        const std::vector<at::Tensor>& params, const std::string& who) {
  std::vector<int64_t> local;
  for (const auto& p : params) {
    local.push_back(p.dim());
    for (int64_t d : p.sizes()) local.push_back(d);
    local.push_back(static_cast<int64_t>(p.scalar_type()));
  }
  auto layout = torch::tensor(local, torch::kLong);
  auto lengths = group.allgather(torch::tensor({layout.numel()}, torch::kLong));
  for (size_t r = 0; r < lengths.size(); ++r) {
    if (lengths[r].item<int64_t>() != layout.numel()) {
      throw UsageError(who + ": the model on rank " + std::to_string(group.rank()) + " has " +
                       std::to_string(params.size()) + " parameters laid out in " +
                       std::to_string(layout.numel()) + " numbers, rank " + std::to_string(r) +
                       "'s in " + std::to_string(lengths[r].item<int64_t>()) +
                       ": every rank must build the same architecture");
    }
  }
  auto layouts = group.allgather(layout);
  for (size_t r = 0; r < layouts.size(); ++r) {
    if (torch::equal(layouts[r], layout)) continue;
    const auto& theirs = layouts[r];
    int64_t offset = 0;
    for (size_t i = 0; i < params.size(); ++i) {
      const int64_t width = params[i].dim() + 2;
      if (!torch::equal(theirs.narrow(0, offset, width), layout.narrow(0, offset, width))) {
        const int64_t dims = std::min(theirs[offset].item<int64_t>(), theirs.numel() - offset - 1);
        auto shape = theirs.narrow(0, offset + 1, dims);
        throw UsageError(who + ": parameter '" + names[i] + "' is " + describe(params[i]) +
                         " on rank " + std::to_string(group.rank()) + " but " +
                         format_shape(at::IntArrayRef(shape.data_ptr<int64_t>(), dims)) +
                         " on rank " + std::to_string(r) +
                         ": every rank must build the same architecture");
      }
      offset += width;
    }
  }
}

namespace {

// Runs `collective` on one flat copy of `tensors` per dtype and device (all launched, then all
// waited for), and copies the results back.
void through_flat_copies(const std::vector<at::Tensor>& tensors,
                         const std::function<comm::Work(std::vector<at::Tensor>&)>& collective) {
  torch::NoGradGuard no_grad;
  std::map<std::pair<at::ScalarType, std::string>, std::vector<at::Tensor>> groups;
  for (const auto& t : tensors) groups[{t.scalar_type(), t.device().str()}].push_back(t);
  std::vector<std::pair<std::vector<at::Tensor>*, at::Tensor>> flats;
  std::vector<comm::Work> works;
  for (auto& [key, members] : groups) {
    std::vector<at::Tensor> pieces;
    for (auto& t : members) pieces.push_back(t.reshape(-1));
    std::vector<at::Tensor> flat{torch::cat(pieces)};
    works.push_back(collective(flat));
    flats.emplace_back(&members, flat[0]);
  }
  for (auto& w : works) w.wait();
  for (auto& [members, flat] : flats) {
    int64_t offset = 0;
    for (auto& t : *members) {
      auto target = t;
      target.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

}  // namespace

void broadcast_from_rank0(comm::ProcessGroup& group, const std::vector<at::Tensor>& tensors) {
  through_flat_copies(
      tensors, [&](std::vector<at::Tensor>& flat) { return group.broadcast_async(flat, 0); });
}

void average_across_ranks(comm::ProcessGroup& group, const std::vector<at::Tensor>& tensors) {
  through_flat_copies(tensors, [&](std::vector<at::Tensor>& flat) {
    return group.allreduce_async(flat, comm::ReduceOp::kAvg);
  });
}

std::vector<torch::optim::OptimizerParamGroup> param_groups_of(
    const torch::optim::Optimizer* optimizer, const std::string& who) {
  if (optimizer == nullptr) throw UsageError(who + ": the optimizer is null");
  return optimizer->param_groups();
}

std::unique_ptr<torch::optim::OptimizerOptions> defaults_of(
    const torch::optim::Optimizer* optimizer, const std::string& who) {
  if (optimizer == nullptr) throw UsageError(who + ": the optimizer is null");
  return optimizer->defaults().clone();
}

void load_wrapped(torch::optim::Optimizer& wrapper, torch::optim::Optimizer& inner,
                  torch::serialize::InputArchive& archive) {
  inner.load(archive);
  const auto& theirs = inner.param_groups();
  auto& ours = wrapper.param_groups();
  for (size_t i = 0; i < theirs.size() && i < ours.size(); ++i)
    ours[i].set_options(theirs[i].options().clone());
}

}  // namespace cohort::parallel::detail

#include "cohort/parallel/fully_shard.h"

#include <utility>

#include "cohort/error.h"
#include "cohort/parallel/activation_checkpointing.h"

namespace cohort::parallel {

FullyShardImpl::FullyShardImpl(Forward forward, std::shared_ptr<torch::nn::Module> module)
    : forward_(std::move(forward)), module_(std::move(module)) {
  if (!module_) throw UsageError("FullyShard: the module is null");
  // The module's own members, registered here under their own names: the wrapper adds no level
  // to the model's names.
  for (const auto& child : module_->named_children()) register_module(child.key(), child.value());
  for (const auto& p : module_->named_parameters(/*recurse=*/false))
    register_parameter(p.key(), p.value(), p.value().requires_grad());
  for (const auto& b : module_->named_buffers(/*recurse=*/false))
    register_buffer(b.key(), b.value());
}

torch::Tensor FullyShardImpl::forward(torch::Tensor x) {
  const auto run = [&] {
    if (!checkpointing_ || !at::GradMode::is_enabled()) return forward_(x);
    // The recomputation calls forward_ directly: at stage 3 it runs inside the backward's gather
    // of this unit (ZeroOptimizer's hook on the output), not through forward_unit again.
    return checkpoint(
        *module_, [this](const at::Tensor& input) { return forward_(input); }, x);
  };
  if (auto hooks = hooks_.lock()) return hooks->forward_unit(unit_, run);
  return run();
}

void FullyShardImpl::train(bool on) {
  torch::nn::Module::train(on);
  module_->train(on);
}

void FullyShardImpl::set_sharding(std::weak_ptr<ShardedUnitHooks> hooks, size_t unit) {
  hooks_ = std::move(hooks);
  unit_ = unit;
}

}  // namespace cohort::parallel

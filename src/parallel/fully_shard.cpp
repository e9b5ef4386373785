#include "cohort/parallel/fully_shard.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <mutex>
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

void FullyShardImpl::defer(std::function<std::shared_ptr<torch::nn::Module>()> remake,
                           at::Tensor generator_state) {
  if (!remake) throw UsageError("FullyShard::defer: no function to build the module again");
  remake_ = std::move(remake);
  generator_state_ = std::move(generator_state);
  torch::NoGradGuard no_grad;
  // One element, expanded to the shape: the parameter's size, dtype and device stay, its memory
  // goes.
  for (auto& p : module_->parameters()) p.set_data(at::zeros({1}, p.options()).expand(p.sizes()));
}

void FullyShardImpl::materialize() {
  if (!remake_) return;
  // torch's default generator is the process's: units materialised by several threads (ranks of
  // one process) take turns with it.
  static std::mutex generator_turn;
  std::lock_guard turn(generator_turn);
  const auto now = detail::cpu_generator_state();
  detail::set_cpu_generator_state(generator_state_);
  std::shared_ptr<torch::nn::Module> fresh;
  try {
    fresh = remake_();
  } catch (...) {
    detail::set_cpu_generator_state(now);
    throw;
  }
  detail::set_cpu_generator_state(now);
  auto mine = module_->named_parameters();
  const auto theirs = fresh->named_parameters();
  if (mine.size() != theirs.size()) {
    throw RuntimeError("FullyShard::materialize: the module built again has " +
                       std::to_string(theirs.size()) + " parameters, the deferred one " +
                       std::to_string(mine.size()) +
                       ": the function given to deferred_unit must build the same module");
  }
  torch::NoGradGuard no_grad;
  for (auto& p : mine) {
    const auto* fresh_p = theirs.find(p.key());
    if (fresh_p == nullptr || fresh_p->sizes() != p.value().sizes()) {
      throw RuntimeError("FullyShard::materialize: parameter '" + p.key() +
                         "' is not in the module built again, or of another shape");
    }
    p.value().set_data(fresh_p->detach().to(p.value().device()));
  }
  remake_ = nullptr;
  generator_state_ = at::Tensor();
}

namespace detail {

at::Tensor cpu_generator_state() {
  auto generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard lock(generator.mutex());
  return generator.get_state();
}

void set_cpu_generator_state(const at::Tensor& state) {
  auto generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard lock(generator.mutex());
  generator.set_state(state);
}

}  // namespace detail

void materialize(torch::nn::Module& module) {
  for (const auto& m : module.modules()) {
    if (auto unit = std::dynamic_pointer_cast<FullyShardImpl>(m)) unit->materialize();
  }
}

bool has_deferred_units(const torch::nn::Module& module) {
  for (const auto& m : module.modules()) {
    const auto unit = std::dynamic_pointer_cast<const FullyShardImpl>(m);
    if (unit && unit->deferred()) return true;
  }
  return false;
}

bool is_deferred(const at::Tensor& t) {
  return t.defined() && t.numel() > 1 &&
         static_cast<int64_t>(t.storage().nbytes()) < t.numel() * t.element_size();
}

void FullyShardImpl::set_sharding(std::weak_ptr<ShardedUnitHooks> hooks, size_t unit) {
  hooks_ = std::move(hooks);
  unit_ = unit;
}

}  // namespace cohort::parallel

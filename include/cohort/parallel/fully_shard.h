#pragma once
#include <cstddef>
#include <functional>
#include <memory>
#include <utility>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

namespace cohort::parallel {

/// What ZeRO stage 3 does around the forward of one of its units: set on each FullyShard of the
/// model by the ZeroOptimizer that shards it.
class ShardedUnitHooks {
 public:
  virtual ~ShardedUnitHooks() = default;
  /// Gathers unit `unit`'s parameters, runs `forward`, arranges for them to be gathered again
  /// before the unit's backward, and frees them.
  virtual torch::Tensor forward_unit(size_t unit,
                                     const std::function<torch::Tensor()>& forward) = 0;
};

/// One unit of ZeRO stage 3 (FSDP's fully_shard): the parameters of `module` are gathered from
/// every rank's shard just before its forward, freed after it, gathered again just before its
/// backward and freed once their gradients are reduced. A model marks its units by holding them
/// through a FullyShard, whose forward then calls the module's:
///
///   block1 = register_module("block1", parallel::FullyShard(Block(width)));
///   ...
///   x = block1(x);
///
/// The names of the module's parameters, buffers and submodules do not change ("block1.fc.weight"
/// as without the wrapper), so checkpoints load either way. Without a stage-3 ZeroOptimizer over
/// the model (DDP, ZeRO 1-2, one process) the forward is the module's, unchanged. Units do not
/// nest; parameters outside every unit stay whole on every rank. train(bool) reaches the module.
///
/// A unit is also what activation checkpointing recomputes
/// (parallel::apply_activation_checkpointing marks units by policy): a marked unit keeps only its
/// input in forward and runs its forward again in backward, inside the stage-3 gather of its
/// backward.
class FullyShardImpl : public torch::nn::Module {
 public:
  /// The unit's forward: one tensor in, one out.
  using Forward = std::function<torch::Tensor(torch::Tensor)>;
  /// `module` takes one tensor and returns one (module->forward(x), a Sequential's included).
  template <typename ModuleType>
  explicit FullyShardImpl(torch::nn::ModuleHolder<ModuleType> module)
      : FullyShardImpl([module](torch::Tensor x) mutable { return module->forward(std::move(x)); },
                       module.ptr()) {}
  /// A unit whose forward is `forward` over `module`'s parameters.
  FullyShardImpl(Forward forward, std::shared_ptr<torch::nn::Module> module);

  /// The module's forward, with the unit's parameters gathered around it at stage 3.
  torch::Tensor forward(torch::Tensor x);
  /// Sets training mode on the wrapped module too.
  void train(bool on = true) override;

  /// The wrapped module.
  const std::shared_ptr<torch::nn::Module>& module() const { return module_; }
  template <typename ModuleType>
  /// The wrapped module as `ModuleType` (null when it is another type).
  std::shared_ptr<ModuleType> module_as() const {
    return std::dynamic_pointer_cast<ModuleType>(module_);
  }

  /// Whether the forward keeps only its input and is recomputed in backward (parallel::checkpoint).
  void set_activation_checkpointing(bool on) { checkpointing_ = on; }
  /// See set_activation_checkpointing.
  bool activation_checkpointing() const { return checkpointing_; }

  /// Set by the ZeroOptimizer at stage 3 (unit `unit` of its own), cleared when it goes.
  void set_sharding(std::weak_ptr<ShardedUnitHooks> hooks, size_t unit);

  /// Deferred initialisation: the unit's parameters give their memory back (each keeps its shape,
  /// dtype and device, over one element's storage) until materialize(). `remake` builds the
  /// module again as it was built, from torch's CPU generator in the state it had then
  /// (`generator_state`, taken before the first build): materialize() runs it from that state and
  /// takes its parameters, which are then those of the first build, bit for bit. Build the unit
  /// with deferred_unit(), which does all this.
  void defer(std::function<std::shared_ptr<torch::nn::Module>()> remake,
             at::Tensor generator_state);
  /// Whether the parameters await materialize().
  bool deferred() const { return static_cast<bool>(remake_); }
  /// Allocates and initialises the parameters (see defer()); torch's CPU generator is left where
  /// it was. Nothing when not deferred. Threads of one process that materialise units take turns;
  /// one that draws from torch's generator meanwhile would change what is drawn.
  void materialize();

 private:
  Forward forward_;
  std::shared_ptr<torch::nn::Module> module_;
  std::weak_ptr<ShardedUnitHooks> hooks_;
  size_t unit_ = 0;
  bool checkpointing_ = false;
  std::function<std::shared_ptr<torch::nn::Module>()> remake_;
  at::Tensor generator_state_;
};
/// The module holder of FullyShardImpl (`parallel::FullyShard(block)`).
TORCH_MODULE(FullyShard);

namespace detail {
/// The state of torch's default CPU generator (a copy).
at::Tensor cpu_generator_state();
/// Sets torch's default CPU generator to `state`.
void set_cpu_generator_state(const at::Tensor& state);
}  // namespace detail

/// A unit of `make()` (a function returning a module holder, e.g. `[&] { return Block(width);
/// }`), built now, from torch's CPU generator as it is, so that every later draw is what it would
/// be; with `defer` its parameters then give their memory back until the unit is materialised
/// (FullyShardImpl::defer): by ZeRO stage 3 one unit at a time, keeping its shard only, or by
/// materialize() for every other plan. The peak while a model is built is one unit, not the model.
template <typename Make>
FullyShard deferred_unit(Make make, bool defer = true) {
  auto state = defer ? detail::cpu_generator_state() : at::Tensor();
  FullyShard unit(make());
  if (defer) unit->defer([make]() mutable { return make().ptr(); }, std::move(state));
  return unit;
}

/// Materialises every deferred unit of `module` (FullyShardImpl::materialize), in order.
void materialize(torch::nn::Module& module);
/// Whether `module` has deferred units.
bool has_deferred_units(const torch::nn::Module& module);
/// Whether `t` is a deferred parameter awaiting materialisation: a shape over less storage than
/// it needs (one element).
bool is_deferred(const at::Tensor& t);

}  // namespace cohort::parallel

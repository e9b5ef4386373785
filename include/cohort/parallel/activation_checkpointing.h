/// \file
/// Activation checkpointing (PyTorch's torch.utils.checkpoint, which libtorch lacks): a part of
/// the forward runs without keeping its activations, and backward runs it again to get them.
/// Memory for the activations inside the part is traded for one more forward of it.
///
///   // By hand, around any function of tensors and the module whose parameters it uses:
///   auto y = parallel::checkpoint(*block, [&](const at::Tensor& x) { return block->forward(x); },
///                                 x);
///   // Or by policy, over a model's units (its parallel::FullyShard layers):
///   parallel::apply_activation_checkpointing(*model, parallel::parse_activation_checkpointing(
///                                                        "every:2"));
#pragma once
#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include "cohort/parallel/activation_checkpointing_policy.h"

namespace cohort::parallel {

/// What parallel::checkpoint needs to know besides the function and its inputs.
struct CheckpointOptions {
  /// The parameters the function uses. In a backward that accumulates (loss.backward()), the
  /// recomputed backward adds each one's gradient to its .grad as soon as it is made, so that no
  /// more than one is live at a time, as without checkpointing; then each parameter's own
  /// gradient accumulator runs once, in the caller's backward, and its hooks (DDP's, ZeRO's) find
  /// .grad complete. From grad() or backward(inputs), and for a parameter with hooks of its own
  /// (register_hook), the gradients are returned through the accumulators instead, and a
  /// unit's are live together until its backward ends. While a backward recomputes the function,
  /// its parameters must not be used on another thread. A parameter that requires a gradient, is
  /// used by the function and is missing here is an error in backward naming its shape: its
  /// gradient would be lost.
  std::vector<at::Tensor> parameters;
  /// Buffers the function updates in training (BatchNorm's running statistics): put back after
  /// the recomputation, so that they are updated once per forward, as without checkpointing.
  std::vector<at::Tensor> buffers;
  /// The random number generators' states (the CPU's, and each CUDA device's that an input or
  /// parameter is on) saved before the forward and restored for the recomputation, so that
  /// dropout drops the same elements twice. Costs a copy of the CPU generator's state (about
  /// 5 kB) per call.
  bool preserve_rng_state = true;
};

/// A function of several tensors to several tensors.
using CheckpointedFunction =
    std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>& inputs)>;

/// fn(inputs), without keeping the activations inside fn: only the inputs are saved, and backward
/// runs fn again (under the autocast settings and random states of the forward) and
/// differentiates that. The results equal fn's, and so do the gradients of the inputs and of
/// `options.parameters`. Where gradients are off (evaluation, torch::NoGradGuard) it is fn(inputs).
/// fn is copied and kept until backward: what it refers to must live until then (a module's
/// forward, not a local of the caller). Inputs that fn modifies in place are not supported (their
/// saved version is checked, as autograd checks).
std::vector<at::Tensor> checkpoint(const CheckpointedFunction& fn,
                                   const std::vector<at::Tensor>& inputs,
                                   const CheckpointOptions& options = {});

/// The options for a function over `module`: its parameters that require gradients, and its
/// buffers.
CheckpointOptions checkpoint_options_of(const torch::nn::Module& module);

/// fn(input) over `module`'s parameters and buffers, checkpointed (see above).
at::Tensor checkpoint(const torch::nn::Module& module,
                      const std::function<at::Tensor(const at::Tensor&)>& fn,
                      const at::Tensor& input);

/// One unit a policy chose.
struct CheckpointedUnit {
  std::string name;  ///< its name in the model ("layers.3")
  std::string type;  ///< the type of the module it wraps ("BasicBlock")
};

/// The units of `module` that `policy` checkpoints, without changing anything. The units are
/// counted in the model's order (named_modules()), which the model's forward is expected to
/// follow. A UsageError of one line when a name matches no unit (listing the model's units), when
/// the model has no units at all, when every:K chooses no unit, or when the policy is invalid.
std::vector<CheckpointedUnit> checkpointed_units(const torch::nn::Module& module,
                                                 const ActivationCheckpointing& policy,
                                                 const UnitChoiceOptions& options = {});

/// Marks the units of `module` that `policy` chooses to checkpoint their forward (and every other
/// unit not to), and returns them. The same errors as checkpointed_units(). Works under every
/// plan: ZeRO-3 gathers a unit's parameters again before its recomputation, a pipeline's stages
/// share the model's units, and tensor-parallel units recompute their collectives alike on every
/// rank of their group.
std::vector<CheckpointedUnit> apply_activation_checkpointing(torch::nn::Module& module,
                                                             const ActivationCheckpointing& policy,
                                                             const UnitChoiceOptions& options = {});

}  // namespace cohort::parallel

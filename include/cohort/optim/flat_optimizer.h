#pragma once
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>

#include "cohort/optim/optimizer_options.h"

namespace cohort::optim {

/// An optimizer over flat buffers: the parameters of each param group (per dtype and device) are
/// views into one contiguous buffer, their gradients are gathered into another, and the optimizer
/// state lives in buffers of the same layout, so a step is a handful of vectorised operations
/// instead of a handful per parameter (libtorch's torch::optim loops over parameters). On
/// libtorch 2.4 and later the step is one fused kernel per buffer (has_fused_kernels()).
///
/// A drop-in torch::optim::Optimizer: FlatSGD, FlatAdam and FlatAdamW take torch::optim's own
/// options, give the same results as torch::optim (the same arithmetic, elementwise), serve
/// zero_grad(), param_groups() (an lr set there applies at the next step), the LR schedules,
/// train::save_checkpoint / load_checkpoint and linear_lr_scaling.
///
/// Parameters stored in bfloat16 or float16 are stepped through float32 master copies held here
/// (as are their gradients and state), and written back after each step.
///
/// The parameters are re-pointed into the flat buffer at construction; a module moved afterwards
/// (module->to(device)) is picked up at the next step, its state moved along. A parameter without
/// a gradient in a step is left alone (as torch::optim does), the others still stepped.
class FlatOptimizer : public torch::optim::Optimizer {
 public:
  ~FlatOptimizer() override;

  /// One step over the flat buffers (the gradients gathered first); `closure` as torch::optim's.
  torch::Tensor step(LossClosure closure = nullptr) override;
  /// Writes the state in torch::optim's archive layout.
  void save(torch::serialize::OutputArchive& archive) const override;
  /// Reads save()'s archive (or torch::optim's of the same algorithm and parameters).
  void load(torch::serialize::InputArchive& archive) override;

  /// Scales every gradient so that their global L2 norm is at most max_norm, in two vectorised
  /// operations and without a host synchronisation; returns the norm before clipping (a 0-dim
  /// float32 tensor on the parameters' device). UsageError when max_norm <= 0.
  virtual torch::Tensor clip_grad_norm(double max_norm);

  /// The gradients, gathered into the flat float32 buffers (one per param group, dtype and
  /// device) that the next step() reads: for a loss scaler or for clipping. Valid until step().
  std::vector<torch::Tensor> flat_gradients();
  /// Ends a step without stepping (a loss scaler's overflow): the gathered gradients are dropped,
  /// as step() drops them, so the next step gathers the next backward's.
  virtual void skip_step();

  /// For train::CapturedStep, whose CUDA graph runs this optimizer's host side once (at the
  /// capture) and its device side at every replay. before_replay(): one more step counted, and a
  /// learning rate changed since (an LR schedule) written to the device, before each replay.
  /// replays_exactly(): whether the last step ran on CUDA on the fused kernels, whose step count
  /// and learning rate live on the device (elsewhere a replay would repeat the captured ones).
  /// host_step_counts() / restore_host_step_counts(): undo a capture that failed.
  void before_replay();
  /// See before_replay().
  bool replays_exactly() const;
  /// See before_replay().
  std::vector<int64_t> host_step_counts() const;
  /// See before_replay().
  void restore_host_step_counts(const std::vector<int64_t>& counts);

  /// Moves the optimizer state into files under `dir` (ZeRO-Infinity's offload to NVMe;
  /// DeepSpeed's offload_optimizer {device: nvme}): each buffer a file, unlinked as soon as it is
  /// made (nothing stays behind, a crash included), its space reserved at once, mapped into
  /// memory. A step then reads the state a chunk (1 MiB of each buffer) at a time, the next chunk
  /// read ahead, each updated chunk written back behind it and dropped from this process's
  /// memory: the state the process holds is about a chunk's, the rest in the kernel's page
  /// cache, which it writes to the disk and reclaims under memory pressure. So a model whose
  /// state exceeds the machine's memory steps, at the disk's speed. Results are bit for bit those
  /// of the state in memory. Checkpoints read and write it as usual. CPU state only; UsageError
  /// naming the folder when it is not a writable folder, RuntimeError when its disk cannot hold
  /// the state. A relayout (module->to()) keeps it offloaded.
  void offload_state(const std::filesystem::path& dir);
  /// Whether offload_state() put the state on disk.
  bool state_offloaded() const;
  /// Keeps the float32 master weights, the optimizer state and a copy of the gradients in host
  /// memory where the parameters are on a GPU (DeepSpeed's ZeRO-Offload, offload_optimizer
  /// {device: cpu}): a step copies the gradients to the host (pinned memory), updates the
  /// masters and the state there with the CPU kernels, and copies the updated weights back into
  /// the parameters. The GPU then holds the parameters and their gradients only. The gradients are
  /// copied when step() begins, not while backward runs. Nothing changes for parameters on the
  /// CPU, whose state is there already. Combined with offload_state() (after this call) the state
  /// lives in files. A step that updates on the host is not captured in a CUDA graph
  /// (replays_exactly() is false). A relayout (module->to()) keeps it on the host. Call it before
  /// the first step: the layout is made again, and low-precision parameters' float32 masters start
  /// again from the parameters.
  void offload_to_host();
  /// Whether offload_to_host() was called.
  bool offloaded_to_host() const;

  /// "sgd", "adam" or "adamw".
  const std::string& algorithm() const { return algorithm_; }
  /// Whether float32 buffers on CPU or CUDA step with libtorch's fused kernels (libtorch 2.4 and
  /// later: one pass over the buffers); otherwise with the vectorised operations.
  static bool has_fused_kernels();
  /// Bytes held for master weights (low-precision parameters, or offload_to_host()), gradients
  /// and optimizer state.
  int64_t state_bytes() const;

  /// The state of parameter `index` of param group `group`: the steps it took and its state
  /// buffers (state_names_of's order), flattened copies; and the reverse. For moving state between
  /// optimizers (e.g. a ZeRO checkpoint into DDP's).
  struct ParameterState {
    int64_t steps = 0;                  ///< steps the parameter took
    std::vector<torch::Tensor> values;  ///< its state buffers, flattened
  };
  /// See ParameterState.
  ParameterState parameter_state(size_t group, size_t index);
  /// parameter_state's buffers as views of the optimizer's own flat buffers, not copies: what a
  /// checkpoint writes from, and a load reads into in place (set_parameter_state then copies
  /// nothing). They follow the optimizer's steps.
  ParameterState parameter_state_views(size_t group, size_t index);
  /// Disk offload (offload_state()): the pages of parameter_state_views(group, index)'s buffer
  /// `state` leave this process's memory (the file keeps them; the next access reads them
  /// again); nothing where the state is in memory. For a checkpoint's StateTensor::release.
  void release_parameter_state(size_t group, size_t index, size_t state) const;
  /// See ParameterState. A buffer that already is the optimizer's own (parameter_state_views') is
  /// not copied.
  void set_parameter_state(size_t group, size_t index, const ParameterState& state);
  /// Takes `weights` as the values of param group `group`'s parameters and `states` as their
  /// state (one each, in the group's order), without a copy or fresh memory: the parameters are
  /// pointed at the weights and the state buffers are the given ones. Only where the weights of
  /// the parameters that share a flat buffer, and each of their state buffers, lie one after
  /// another in one storage in this layout's order, with the parameters' shapes, dtype and
  /// device: the buffers of another flat optimizer over the same parameters (a live regroup keeps
  /// them). False, and nothing changed, where they do not or the state is offloaded to disk.
  bool adopt(size_t group, const std::vector<torch::Tensor>& weights,
             const std::vector<ParameterState>& states);

 protected:
  /// The optimizer of `groups` with `defaults`, stepping `algorithm`.
  FlatOptimizer(std::vector<torch::optim::OptimizerParamGroup> groups,
                std::unique_ptr<torch::optim::OptimizerOptions> defaults, std::string algorithm);

  /// For subclasses that own the layout (ZeRO's shards: one parameter per group): the names of the
  /// state buffers (e.g. exp_avg, exp_avg_sq), group g's buffers in that order (its first
  /// partition's), and the steps its first parameter took.
  std::vector<std::string> state_buffer_names() const;
  /// See state_buffer_names().
  std::vector<torch::Tensor> state_buffers(size_t group) const;
  /// Disk offload (offload_state()): starts writing elements [start, start + length) of group
  /// `group`'s state buffer `state` (state_buffer_names()' order) back to its file and drops them
  /// from this process's memory (the next access reads them again), as a step does a chunk at a
  /// time; nothing where the state is in memory. For a checkpoint's StateTensor::release.
  void release_state_pages(size_t group, size_t state, int64_t start, int64_t length) const;
  /// See state_buffer_names().
  int64_t steps_taken(size_t group) const;
  /// Sets the steps group `group`'s parameters took (a loaded checkpoint's).
  void set_steps_taken(size_t group, int64_t steps);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string algorithm_;
};

/// SGD with momentum, dampening, Nesterov momentum and weight decay, as torch::optim::SGD.
class FlatSGD : public FlatOptimizer {
 public:
  /// SGD over `params` with `options`.
  FlatSGD(std::vector<torch::Tensor> params, torch::optim::SGDOptions options);
  /// SGD over param groups (a group's own options override `options`).
  FlatSGD(std::vector<torch::optim::OptimizerParamGroup> groups, torch::optim::SGDOptions options);
};

/// Adam (with amsgrad, and L2 weight decay added to the gradient), as torch::optim::Adam.
class FlatAdam : public FlatOptimizer {
 public:
  /// Adam over `params` with `options`.
  FlatAdam(std::vector<torch::Tensor> params, torch::optim::AdamOptions options = {});
  /// Adam over param groups (a group's own options override `options`).
  FlatAdam(std::vector<torch::optim::OptimizerParamGroup> groups,
           torch::optim::AdamOptions options = {});
};

/// AdamW (decoupled weight decay), as torch::optim::AdamW.
class FlatAdamW : public FlatOptimizer {
 public:
  /// AdamW over `params` with `options`.
  FlatAdamW(std::vector<torch::Tensor> params, torch::optim::AdamWOptions options = {});
  /// AdamW over param groups (a group's own options override `options`).
  FlatAdamW(std::vector<torch::optim::OptimizerParamGroup> groups,
            torch::optim::AdamWOptions options = {});
};

/// Checks an optimizer's hyperparameters (learning rate >= 0, momentum and dampening in [0, 1],
/// betas in [0, 1), eps > 0, weight decay >= 0, Nesterov with momentum and no dampening); throws
/// UsageError naming the value. The flat optimizers check theirs at construction.
void validate(const torch::optim::SGDOptions& options);
/// See validate(const torch::optim::SGDOptions&).
void validate(const torch::optim::AdamOptions& options);
/// See validate(const torch::optim::SGDOptions&).
void validate(const torch::optim::AdamWOptions& options);

/// The optimizer `options` describe over `params`: FlatSGD, FlatAdam or FlatAdamW, or with
/// options.flat false libtorch's SGD, Adam or AdamW. UsageError naming a bad hyperparameter
/// (OptimizerOptions::check, validate).
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const OptimizerOptions& options,
                                                        std::vector<torch::Tensor> params);

/// The algorithm of a torch::optim or flat optimizer: "sgd", "adam" or "adamw". For another
/// optimizer a UsageError starting with `who` and ending with `why` (what supports only those).
std::string algorithm_of(const torch::optim::Optimizer& optimizer, const std::string& who,
                         const std::string& why);
/// The state an algorithm ("sgd", "adam" or "adamw") keeps per element with `options` of its type,
/// by name: SGD with momentum {momentum_buffer}, without {}; Adam and AdamW {exp_avg, exp_avg_sq},
/// with amsgrad also max_exp_avg_sq. torch::optim's param states hold the same, by these names.
std::vector<std::string> state_names_of(const std::string& algorithm,
                                        const torch::optim::OptimizerOptions& options);
/// A flat optimizer of `algorithm` ("sgd", "adam" or "adamw") with `options` of that algorithm's
/// type (e.g. another optimizer's param-group options), over `groups`.
std::unique_ptr<FlatOptimizer> make_flat_optimizer(
    std::vector<torch::optim::OptimizerParamGroup> groups, const std::string& algorithm,
    const torch::optim::OptimizerOptions& options);

/// Clips the gradients of any parameters to a global L2 norm of max_norm without a host
/// synchronisation (torch::nn::utils::clip_grad_norm_ returns a double, which syncs); returns the
/// norm before clipping. For a FlatOptimizer, its clip_grad_norm is faster.
torch::Tensor clip_grad_norm(const std::vector<torch::Tensor>& parameters, double max_norm);

}  // namespace cohort::optim

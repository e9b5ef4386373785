/// \file
/// Pipeline parallelism: a model cut into stages, each on its own rank, trained by running a
/// compiled schedule (schedule.h): activations go forward and gradients back by send/recv.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/optimizer.h>

#include "cohort/comm/process_group.h"
#include "cohort/parallel/distributed_data_parallel.h"
#include "cohort/parallel/pipeline/schedule.h"
#include "cohort/parallel/sync_mode.h"
#include "cohort/parallel/zero_optimizer.h"

namespace cohort::parallel::pipeline {

/// One stage: a module and how to call it on one tensor. Any module holder with
/// `Tensor forward(Tensor)` converts, torch::nn::Sequential included.
class Stage {
 public:
  template <typename Impl>
  /// A stage of `module` (its forward(Tensor)).
  Stage(torch::nn::ModuleHolder<Impl> module)  // NOLINT: implicit on purpose
      : module_(module.ptr()),
        forward_([module](const at::Tensor& x) mutable { return module->forward(x); }) {}
  /// Runs the stage on `input`.
  at::Tensor forward(const at::Tensor& input) const { return forward_(input); }
  /// The stage's module.
  torch::nn::Module& module() const { return *module_; }
  /// The stage's module, shared.
  std::shared_ptr<torch::nn::Module> ptr() const { return module_; }

 private:
  std::shared_ptr<torch::nn::Module> module_;
  std::function<at::Tensor(const at::Tensor&)> forward_;
};

/// Cuts a Sequential into consecutive stages of `layers_per_stage[i]` layers (they must add up to
/// its size, each >= 1). The stages share the layers (no copy) and keep their names ("3.weight"
/// stays "3.weight"), so a stage's state dict is a slice of the whole model's.
std::vector<torch::nn::Sequential> split_sequential(const torch::nn::Sequential& model,
                                                    const std::vector<int>& layers_per_stage);
/// Layer counts for `stages` stages as even as possible (earlier stages get the extra layers).
/// More stages than layers is a UsageError.
std::vector<int> even_split(int layers, int stages);
/// Layer counts that balance the measured time: forward and backward of every layer on `sample`
/// (`repeats` times, the fastest kept: interference from other work only ever adds time), then the
/// cut that minimises the slowest stage.
std::vector<int> balanced_split(torch::nn::Sequential model, int stages, const at::Tensor& sample,
                                int repeats = 3);

/// A parameter that stages on several pipeline ranks share, as a GPT's token embedding, which its
/// output head reads again (Megatron-LM's and DeepSpeed's tied embeddings). Each rank that holds
/// it steps its own copy; the copies start equal (the same model on every rank) and stay equal:
/// the pipeline sums their gradients over the ranks that hold them before the optimizer steps
/// (PipelineOptions::tied_parameters).
struct TiedParameter {
  std::string name;        ///< its name in the first stage that holds it, for messages
  at::Tensor parameter;    ///< this rank's copy
  std::vector<int> ranks;  ///< the pipeline ranks that hold a copy, ascending, this one among them
};
/// The trainable parameters that `stages` (all of the pipeline's, in order, as split_sequential
/// cuts a model that every rank builds alike) share across the ranks of `layout`, as rank `rank`
/// holds them: the same ones in the same order on every rank that holds them. One tensor in two
/// stages of one rank is a UsageError naming it: that rank's optimizer would step it twice.
std::vector<TiedParameter> find_tied_parameters(const std::vector<torch::nn::Sequential>& stages,
                                                const PipelineLayout& layout, int rank);

/// The loss of one micro-batch, the mean over its rows (as torch's losses by default): the
/// pipeline weights each micro-batch by its rows so that the gradients are those of the mean over
/// the whole batch.
using LossFunction = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;

/// How a Pipeline runs: its schedule, micro-batches, virtual stages and data parallelism.
struct PipelineOptions {
  ScheduleKind schedule =
      ScheduleKind::kOneFOneB;  ///< the schedule (GPipe, 1F1B, interleaved, zero-bubble)
  /// Micro-batches per step; each batch is split along dim 0 (its rows must be >= this).
  int micro_batches = 4;
  /// Stages per rank (the interleaved schedule): rank r holds stages r, r + p, r + 2p, ...
  int virtual_stages = 1;
  /// Data parallelism over pipelines (a mesh's dp group: the ranks that hold the same stages):
  /// each stage is wrapped in the DDP engine over this group, which takes rank 0's parameters at
  /// construction and averages the gradients in the stage's last backward of each step (the
  /// earlier ones accumulate under no_sync). Empty or of size 1: none.
  comm::ProcessGroup data_parallel_group;
  DdpOptions data_parallel;  ///< the DDP options over data_parallel_group
  /// ZeRO instead of DDP over the data-parallel group (any size, 1 included): one ZeroOptimizer
  /// over all of this rank's stages, made by Pipeline::prepare_optimizer(), shards the optimizer
  /// state (stage 1), the averaged gradients (2) and the parameters of the stages' FullyShard
  /// units (3) over the group. A step's micro-batches accumulate their gradients locally and the
  /// rank's last backward of the step reduce-scatters them once, so the full gradients exist
  /// during the step's backward as with DDP, and stages 2 and 3 free them at its end. Stage 3
  /// gathers a unit for each micro-batch's forward and again for its backward: 2 m all-gathers
  /// of each unit a step for m micro-batches, where a whole model's step takes 2 (prefetching
  /// hides them behind the units before). Stage 0: DDP.
  ZeroOptions zero;
  /// Local SGD or DiLoCo instead of DDP over the data-parallel group: a step averages nothing;
  /// Pipeline::prepare_optimizer() wraps the optimizer in a LocalSgdOptimizer over module() and
  /// the group, which averages this rank's stages with their replicas every H steps (DiLoCo: an
  /// outer step). Not with ZeRO; the parameter server is refused (it serves whole models).
  SyncMode sync;
  /// The parameters this rank shares with other pipeline ranks (find_tied_parameters()): at the
  /// optimizer-step action, after data parallelism averaged them, each one's gradient becomes the
  /// sum of its copies' gradients, added in rank order on every rank that holds it, so that every
  /// copy takes the same step. With DDP, local SGD and DiLoCo, and ZeRO: each engine gives a tied
  /// parameter a bucket of its own, so that a dp rank's shard of every copy is the same elements,
  /// and the shards' reduced gradients are summed (at stage 3 a tied parameter must lie outside
  /// the FullyShard units).
  std::vector<TiedParameter> tied_parameters;
  /// Run at the schedule's optimizer-step action, when this rank's gradients are complete (e.g.
  /// step the optimizer). None: step() only leaves the gradients.
  std::function<void()> optimizer_step;
  /// Keep when each action of the last step started and ended (Pipeline::timeline()).
  bool record_timeline = false;
};

/// One action of a step as it ran: seconds on the steady clock, which every process of a host
/// shares, so that the ranks' timelines line up.
struct TimedAction {
  Action action;       ///< which action
  double start = 0.0;  ///< its start, seconds on the steady clock
  double end = 0.0;    ///< its end
  /// heap_bytes_in_use() when the action ended: with a baseline taken before the step, the
  /// activations and gradients this rank holds.
  int64_t heap_bytes = -1;
};
/// Bytes this process's heap holds now (glibc's mallinfo2: in use plus mmapped blocks; CPU tensors
/// live there), or -1 where the C library cannot tell.
int64_t heap_bytes_in_use();
/// 1 - (time spent computing, summed over ranks) / (ranks x the span from the first start to the
/// last end): the bubble of a step as measured, the simulator's bubble_fraction's counterpart.
double measured_bubble(const std::vector<std::vector<TimedAction>>& timelines);

/// Runs a schedule on this rank's stages. Every rank of `group` (its pipeline ranks, in stage
/// order) constructs one with the same options and calls step() with the same batch.
///
/// Activations keep the batch in dim 0 and the stage's outputs are one tensor. At the first step
/// the stages check that each stage's output fits the next stage's input (a no-grad forward of
/// one micro-batch, stage by stage); a mismatch is a UsageError on every rank naming both stages
/// and the shape. Every send and receive has the group's deadline; while one waits, the group's
/// activity (timeout errors, the stall inspector) names the stage, micro-batch and action.
class Pipeline {
 public:
  /// Compiles the schedule and checks the stage count. With a data-parallel group, every rank of
  /// that group constructs at the same point too: the DDP engines check and broadcast there.
  Pipeline(std::vector<Stage> stages, comm::ProcessGroup group, LossFunction loss,
           PipelineOptions options = {});
  ~Pipeline();
  /// Movable, not copyable.
  Pipeline(Pipeline&&) noexcept;
  /// Moves the pipeline in.
  Pipeline& operator=(Pipeline&&) noexcept;

  /// One training step: forward and backward of every micro-batch as the schedule says. The
  /// gradients of the batch's mean loss are added to the parameters' .grad (zero them between
  /// steps, as usual). Returns the mean loss on the last stage's rank, an undefined tensor on the
  /// others. `inputs` matter on the first stage's rank and `targets` on the last's.
  at::Tensor step(const at::Tensor& inputs, const at::Tensor& targets);

  /// The actions of the last step with their times (PipelineOptions::record_timeline), else
  /// empty.
  const std::vector<TimedAction>& timeline() const;

  /// With PipelineOptions::zero (stage 1, 2 or 3): a ZeroOptimizer over module() that shards
  /// `optimizer` (built over parameters(), e.g. torch::optim::AdamW; its algorithm and options are
  /// taken over) over the data-parallel group, and is the pipeline's data-parallel engine from
  /// then on. With PipelineOptions::sync local SGD or DiLoCo: a LocalSgdOptimizer over module()
  /// and the group that steps `optimizer` as its inner one. Every rank of the group calls it at
  /// the same point, once, before the first step; the returned optimizer must outlive the steps.
  /// Otherwise: `optimizer` itself.
  std::unique_ptr<torch::optim::Optimizer> prepare_optimizer(
      std::unique_ptr<torch::optim::Optimizer> optimizer);

  /// The parameters of this rank's stages.
  std::vector<at::Tensor> parameters() const;
  /// The parameters this rank shares with other pipeline ranks (PipelineOptions::tied_parameters).
  const std::vector<TiedParameter>& tied_parameters() const;
  /// This rank's stages as one module: the stage's own with one stage per rank; else the stages'
  /// layers under their own names ("3.weight" as in the whole model) when no two stages share a
  /// name, else each stage as "stage<global index>". What the ZeRO engine shards and names.
  std::shared_ptr<torch::nn::Module> module() const;
  /// This rank's stages.
  const std::vector<Stage>& stages() const;
  /// This rank's global stage indices.
  std::vector<int> stage_indices() const;
  /// The compiled schedule every rank runs.
  const Program& program() const;
  /// Whether this rank holds the first stage.
  bool is_first() const;
  /// Whether this rank holds the last stage.
  bool is_last() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace cohort::parallel::pipeline

/// \file
/// One prepared object for every plan: train::parallelize(model, optimizer, loss, plan) makes this
/// rank's part of the model parallel as the plan says (DDP, ZeRO 1-3, local SGD, DiLoCo, the
/// parameter server; a pipeline's stages over a dp x pp x tp mesh) and owns it with its engine, its
/// optimizer and its learning-rate schedule. One step() serves every plan:
///
///   auto plan = train::Plan{.pp = 2, .zero = {.stage = 1}, .gradient_accumulation_steps = 4};
///   auto model = train::parallelize({.module = net, .forward = forward, .layers = net->layers},
///                                   [](auto params) { return make_adamw(params); },
///                                   torch::nn::functional::cross_entropy, plan);
///   if (auto checkpoint = train::get_checkpoint()) model.load(*checkpoint);
///   for (auto& batch : train::get_dataset_shard("train").iter_batches({.batch_size = rows}))
///     model.step(batch["image"], batch["label"]);
///   train::report(metrics, model);   // with its checkpoint
#pragma once
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/optimizer.h>

#include "cohort/data/tensor_dataset.h"
#include "cohort/json.h"
#include "cohort/optim/lr_scheduler.h"
#include "cohort/train/checkpoint.h"
#include "cohort/train/plan.h"
#include "cohort/train/prepare.h"
#include "cohort/train/report.h"

namespace cohort::train {

/// The model as parallelize takes it.
struct ModelSpec {
  /// The whole model (every rank builds it alike: the same seed), what checkpoints hold.
  std::shared_ptr<torch::nn::Module> module;
  /// Its forward pass (a torch::nn::Module has no virtual one).
  std::function<at::Tensor(const at::Tensor&)> forward;
  /// With a pipeline (plan.pp > 1): its layers in order, sharing the module's parameters, which
  /// the pipeline cuts into stages.
  torch::nn::Sequential layers{nullptr};
  /// With tensor parallelism (plan.tp > 1): the module is cut over the mesh's tp group; the dense
  /// model of the same parameters in the same order is what checkpoints hold, and these copy the
  /// slices to it (a collective over tp) and back.
  std::shared_ptr<torch::nn::Module> dense;
  std::function<void()>
      copy_to_dense;  ///< copies the sliced module's parameters into `dense` (a collective over tp)
  std::function<void()> load_from_dense;  ///< copies `dense`'s parameters into the sliced module
};

/// The optimizer over a rank's parameters (its stages' with a pipeline), before the engine wraps
/// it: e.g. [](auto params) { return std::make_unique<optim::FlatAdamW>(params, options); }.
using OptimizerFactory =
    std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor> parameters)>;
/// The loss of a step's output and targets (a mean over the rows).
using LossFunction = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;

/// What ParallelModel::step did.
struct StepResult {
  /// The step's mean loss over this rank's rows; undefined where this rank computes none (a
  /// pipeline's ranks other than the last stage's) or when the step was skipped.
  at::Tensor loss;
  /// False when the batch had fewer rows than the step's micro-batches: nothing was done (every
  /// rank of a pipeline has the same rows, every dp rank as many: all skip it alike).
  bool stepped = true;
};

/// What ParallelModel::evaluate measured over every rank's rows.
struct Evaluation {
  /// The loss function's mean over the rows.
  double loss = 0;
  /// Where the targets are class indices (integers) and the output has a logit per class for each
  /// of them: the share of targets whose largest logit is theirs (a classifier's rows, a language
  /// model's tokens: next-token accuracy); unset otherwise.
  std::optional<double> accuracy;
  /// The rows scored, over the ranks (each row once).
  int64_t rows = 0;
};

/// This rank's model parts, engine, optimizer, loss scaler and learning-rate schedule for one
/// train::Plan, made by train::parallelize: one step() for every plan, whole_model() to evaluate,
/// save() and load() for checkpoints of any plan the arithmetic allows.
class ParallelModel {
 public:
  /// Movable, not copyable: it owns the engine.
  ParallelModel(ParallelModel&&) noexcept;
  /// Moves the engine in.
  ParallelModel& operator=(ParallelModel&&) noexcept;
  ~ParallelModel();

  /// One optimizer step over this rank's rows: split into the plan's micro-batches (accumulated
  /// without communication but after the last, each loss weighted by its rows), forward under the
  /// run's precision, backward through the loss scaler, clipping, the optimizer through the scaler
  /// (an fp16 overflow skips it on every rank), the learning-rate schedule. With --cuda-graph the
  /// whole step is one replayed graph.
  StepResult step(const at::Tensor& inputs, const at::Tensor& targets);
  /// The replicas agree now: local SGD, DiLoCo and the parameter server average (or pull) at
  /// once; synchronous plans always agree. Collective; call it where every rank does (an epoch's
  /// end), before evaluating or saving.
  void sync();
  /// Whether the ranks may ask a collective question after every step (train::should_stop()):
  /// synchronous plans; local SGD, DiLoCo and the parameter server must not wait for each other.
  bool synchronous() const;
  /// Every rank's whole model for evaluation, checksums or saving: a pipeline's stages copied to
  /// its other ranks; with ZeRO-3 the parameters gathered while the guard lives. Collective.
  GatheredParameters whole_model();
  /// Scores `data` with the plan's loss function, without gradients, under the worker's precision
  /// and in eval mode: the whole model gathered once (whole_model()), each rank its share of the
  /// rows (a tensor-parallel group's ranks the same share) in batches of `batch_size`, summed over
  /// the ranks. Collective: every rank calls it alike, e.g. after sync() at an epoch's end.
  Evaluation evaluate(const data::TensorDataset& data, int64_t batch_size = 500);
  /// How far the replicas are apart: the largest difference, over the ranks that should hold the
  /// same parameters (every rank; with tensor parallelism, the ranks of one slice), between the
  /// sums of their whole model's parameters. 0 when they agree, as synchronous plans always do
  /// and the others after sync(). Collective, as whole_model().
  double replica_spread();
  /// The whole model's forward pass (after whole_model() where the model is cut).
  at::Tensor forward(const at::Tensor& inputs) const;
  /// The model this rank trains (its stages' with a pipeline; its slices with tensor parallelism).
  torch::nn::Module& module() const;
  /// The optimizer (the engine's where one wraps it: ZeRO, local SGD, DiLoCo, parameter server).
  torch::optim::Optimizer& optimizer() const;
  /// The plan it was made for.
  const Plan& plan() const;
  /// Optimizer steps done, counting those of the checkpoint it resumed.
  int64_t steps() const;
  /// The learning rate of the optimizer's first param group.
  double lr() const;
  /// One line for the log: "DDP", "ZeRO stage 2, activation checkpointing every:1 (9 units)",
  /// "mesh dp 1 x pp 2 x tp 1: 3 layers in 2 stages, 1f1b over 4 micro-batches, DDP over dp".
  std::string describe() const;

  /// Writes this rank's part of a checkpoint into `dir` (the model from the first rank; optimizer
  /// state from the ranks that hold some; a mesh's layout; the learning-rate schedule from the
  /// first rank and every rank's random generators, optim::RandomState). Collective with a
  /// pipeline (its stages are shared first, as whole_model() does): every rank calls it, as
  /// train::report(metrics, model) does.
  void save(const std::filesystem::path& dir) const;
  /// Loads a checkpoint written by any plan whose arithmetic allows it (another world size,
  /// ZeRO stage, mesh cut or sync mode; see checkpoint.h) and goes on with its learning-rate
  /// schedule (from its "steps" metric where it holds none of its own) and, at the same world
  /// size, with each rank's random generators where the checkpoint's run left them (rank 0 says
  /// when they cannot be). UsageError naming the checkpoint, the layouts and the fix otherwise.
  void load(const Checkpoint& checkpoint);

 private:
  friend ParallelModel parallelize(ModelSpec, const OptimizerFactory&, LossFunction, Plan,
                                   const optim::LrScheduleOptions&);
  struct State;
  explicit ParallelModel(std::unique_ptr<State> state);
  // step() without live recovery around it, nor the step's count and schedule.
  StepResult step_here(const at::Tensor& inputs, const at::Tensor& targets);
  std::unique_ptr<State> state_;
};

/// Makes `model` parallel over this worker's group per `plan` (checked first; its degrees must be
/// ScalingConfig::mesh's), moves it to the worker's device, and builds the optimizer through
/// `make_optimizer` and the engine. Every rank calls it alike. `schedule` sets the learning rate
/// step by step (none by default). Under DDP the ranks take rank 0's weights at the first step(),
/// evaluate() or whole_model(), not here: a load() before gives every rank the same ones anyway
/// (a resumed run, a live regroup), and then nothing is broadcast.
ParallelModel parallelize(ModelSpec model, const OptimizerFactory& make_optimizer,
                          LossFunction loss, Plan plan,
                          const optim::LrScheduleOptions& schedule = {});

/// Where a run stands, as its reports say it: "epoch", the epochs begun (an epoch ended reports
/// its number from 1), and "epoch_step", the steps of that epoch done when the run stopped inside
/// it (a Ctrl-C, a stop of the loop's own). Resumed, the loop starts at `epoch` (from 0) and
/// counts its steps on from `epoch_steps_done`: the streams of get_dataset_shard and
/// prepare_data_loader start after the rows the checkpoint's run had taken of that epoch (their
/// positions are part of every checkpoint), at any world size.
inline constexpr const char* kEpochStepMetric = "epoch_step";
/// Where a resumed loop starts: the epoch and the steps of it already done.
struct ResumePoint {
  int epoch = 0;                 ///< the epoch to start at, from 0
  int64_t epoch_steps_done = 0;  ///< the steps of that epoch the checkpoint's run had done
};
/// The resume point of a checkpoint's metrics, said on rank 0 ("resuming epoch 2 after step 5
/// from ...").
ResumePoint resume_point(const Checkpoint& checkpoint);

/// train::report with a checkpoint of `model`: every rank writes its part into a staging folder of
/// its own, reports it, and removes the folder once the driver took it. With `options.async` its
/// files are copied into memory instead, and written and committed behind the loop (see
/// SaveOptions).
void report(const Json& metrics, const ParallelModel& model, const SaveOptions& options = {});

/// Keeps an in-memory snapshot of `model` (`metrics` kept with it as a checkpoint's, e.g.
/// {"epoch", 2}, {"epoch_step", 40}, {"steps", 640}; no report, no row): the step waits only
/// while this rank's files are copied into memory, as an asynchronous save's (SaveOptions::async,
/// with which it shares the one save in flight). Behind the loop each rank writes them onto its
/// node's memory-backed storage (RunConfig::snapshot_path) and sends a copy to a buddy rank, on
/// another node when the job spans nodes; each node's snapshot is whole once its ranks' files and
/// copies are in, and the newest two are kept. After a failure the restarted group resumes from
/// the newest snapshot that is newer than the latest checkpoint when its nodes hold every rank's
/// files, own or copies (train::get_checkpoint() returns it), else from disk, and says which and
/// why. Every rank calls it at the same points; the kept metrics gain "snapshot_stall_s" and
/// "snapshot_wait_s" (the wait for the save in flight).
void snapshot(const Json& metrics, const ParallelModel& model);

}  // namespace cohort::train

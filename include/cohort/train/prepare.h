#pragma once
#include <memory>
#include <string>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "cohort/data/data_iterator.h"
#include "cohort/data/data_loader.h"
#include "cohort/optim/loss_scaler.h"
#include "cohort/optim/precision.h"
#include "cohort/parallel/distributed_data_parallel.h"
#include "cohort/parallel/local_sgd.h"
#include "cohort/parallel/zero_optimizer.h"
#include "cohort/trace.h"

namespace cohort::train {

/// How prepare_model() prepares a model: DDP's options, ZeRO, or another sync mode.
struct PrepareModelOptions {
  bool move_to_device = true;  ///< moves the model to the worker's device first
  /// Stage 0: DDP, with these options.
  parallel::DdpOptions ddp;
  /// Stage 1, 2 or 3: ZeRO, its engine made by prepare_optimizer(). Stage 3 shards the
  /// parameters of the model's parallel::FullyShard units.
  parallel::ZeroOptions zero;
  /// How the replicas agree: synchronous DDP (or ZeRO), or parallel::LocalSgd / parallel::DiLoCo,
  /// whose engine is the LocalSgdOptimizer that prepare_optimizer() makes, or
  /// parallel::AsyncParameterServer, whose engine is a ParameterServerOptimizer:
  ///   train::prepare_model(model, {.sync = parallel::DiLoCo{.inner_steps = 32}});
  parallel::SyncMode sync;
};

/// Moves the model to this worker's device and makes it data-parallel: rank 0's weights on every
/// rank, gradients averaged after every backward (Ray Train's prepare_model). Returns the same
/// model; the training loop stays unchanged. With ZeRO (options.zero.stage 1, 2 or 3), local SGD,
/// DiLoCo or the parameter server (options.sync), pass the optimizer through prepare_optimizer()
/// too: a backward before that is a UsageError saying so. The parameter server's count of
/// servers, when its mode leaves it at 0, is ScalingConfig::num_parameter_servers; that count set
/// with another sync mode is a UsageError.
void prepare_module(const std::shared_ptr<torch::nn::Module>& module,
                    const PrepareModelOptions& options = {});

template <typename M>
/// Prepares `model` for this worker (Ray Train's prepare_model): moved to its device, rank 0's
/// weights broadcast, gradients synchronised by DDP, ZeRO or the sync mode. Returns the same model.
std::shared_ptr<M> prepare_model(std::shared_ptr<M> model,
                                 const PrepareModelOptions& options = {}) {
  prepare_module(model, options);
  return model;
}

template <typename M>
/// prepare_model() for a module holder (e.g. torch::nn::Linear).
torch::nn::ModuleHolder<M> prepare_model(torch::nn::ModuleHolder<M> model,
                                         const PrepareModelOptions& options = {}) {
  prepare_module(model.ptr(), options);
  return model;
}

/// The data-parallel engine attached to a prepared model. Throws when it was not prepared.
parallel::DistributedDataParallel& get_ddp(const std::shared_ptr<torch::nn::Module>& module);

/// For a model prepared with ZeRO: a ZeroOptimizer that shards `optimizer` (built over the
/// model's parameters, e.g. torch::optim::AdamW; its algorithm and options are taken over) and is
/// the model's data-parallel engine. With local SGD or DiLoCo: a LocalSgdOptimizer that steps
/// `optimizer` and synchronises the replicas every H steps. With the parameter server: a
/// ParameterServerOptimizer whose servers step `optimizer`'s algorithm on the pushed gradients.
/// For a model prepared with DDP: `optimizer` itself.
///
///   train::prepare_model(model, {.zero = {.stage = 2}});
///   auto optimizer = train::prepare_optimizer(
///       model, std::make_unique<torch::optim::AdamW>(model->parameters(), options));
std::unique_ptr<torch::optim::Optimizer> prepare_optimizer(
    const std::shared_ptr<torch::nn::Module>& module,
    std::unique_ptr<torch::optim::Optimizer> optimizer);

template <typename M>
/// prepare_optimizer() for a module holder.
std::unique_ptr<torch::optim::Optimizer> prepare_optimizer(
    const torch::nn::ModuleHolder<M>& module, std::unique_ptr<torch::optim::Optimizer> optimizer) {
  return prepare_optimizer(module.ptr(), std::move(optimizer));
}

/// While it lives, backward passes of the model accumulate gradients locally, without
/// communication; the first backward after it synchronises the sum.
class NoSyncGuard {
 public:
  /// Nothing to hold: local SGD and DiLoCo never communicate in backward.
  NoSyncGuard() = default;
  /// Holds DDP's guard.
  explicit NoSyncGuard(std::unique_ptr<parallel::DistributedDataParallel::NoSyncGuard> ddp)
      : ddp_(std::move(ddp)) {}
  /// Holds ZeRO's guard.
  explicit NoSyncGuard(std::unique_ptr<parallel::ZeroOptimizer::NoSyncGuard> zero)
      : zero_(std::move(zero)) {}

 private:
  std::unique_ptr<parallel::DistributedDataParallel::NoSyncGuard> ddp_;
  std::unique_ptr<parallel::ZeroOptimizer::NoSyncGuard> zero_;
};

/// Gradient accumulation: no communication while the guard lives (DDP or ZeRO alike).
NoSyncGuard no_sync(const std::shared_ptr<torch::nn::Module>& module);
template <typename M>
/// no_sync() for a module holder.
NoSyncGuard no_sync(const torch::nn::ModuleHolder<M>& module) {
  return no_sync(module.ptr());
}

/// ZeRO stage 3: the model's parameters whole on every rank while the guard lives (a collective:
/// every rank makes one), to read or write them outside a training step: evaluation without a
/// gather per unit, checksums, copies. With write_back, what every rank wrote into them becomes
/// its shards. Other engines: nothing to do.
class GatheredParameters {
 public:
  GatheredParameters() = default;
  /// Holds ZeRO's gathered parameters.
  explicit GatheredParameters(std::unique_ptr<parallel::ZeroOptimizer::GatheredParameters> zero)
      : zero_(std::move(zero)) {}

 private:
  std::unique_ptr<parallel::ZeroOptimizer::GatheredParameters> zero_;
};
/// The parameters of `module` whole on every rank while the guard lives (see GatheredParameters).
GatheredParameters gathered_parameters(const std::shared_ptr<torch::nn::Module>& module,
                                       bool write_back = false);
template <typename M>
/// gathered_parameters() for a module holder.
GatheredParameters gathered_parameters(const torch::nn::ModuleHolder<M>& module,
                                       bool write_back = false) {
  return gathered_parameters(module.ptr(), write_back);
}

// Mixed precision per ScalingConfig::precision, in an unchanged loop (Ray Train's
// accelerate(amp=True) with backward() and prepare_optimizer()):
//
//   at::Tensor loss;
//   {
//     auto autocast = train::autocast();   // bf16 / fp16 forward; nothing for fp32
//     loss = loss_fn(model->forward(x), y);
//   }
//   train::backward(loss);                 // fp16: the loss scaled first
//   train::step_optimizer(*optimizer);     // fp16: unscaled, skipped on every rank on overflow
//
// Clip gradients after get_loss_scaler().unscale(optimizer), before step_optimizer().

/// The forward pass of a step: autocast on this worker's device at the run's precision, timed as
/// the forward phase (cohort/trace.h), while it lives.
class ForwardScope {
 public:
  /// Starts autocast at `precision` on `device` and the forward span.
  ForwardScope(optim::Precision precision, const c10::Device& device);

 private:
  trace::Span span_;
  optim::AutocastGuard autocast_;
};
/// The forward pass's scope at the run's precision on this worker's device (see ForwardScope).
ForwardScope autocast();
/// loss.backward(), the loss scaled by the run's loss scaler (fp16 only); timed as the backward
/// phase.
void backward(const at::Tensor& loss);
/// Steps the optimizer through the run's loss scaler and updates the scale: with fp16, gradients
/// are unscaled first and a step whose gradients overflowed on any rank is skipped by every rank
/// (counted in every report as "skipped_steps", beside "loss_scale"). Returns whether it stepped.
/// Timed as the optimizer phase; it ends the step (trace::end_step) that reports and profiles
/// count.
bool step_optimizer(torch::optim::Optimizer& optimizer);
/// The run's loss scaler (disabled unless the precision is fp16); its state goes into
/// save_checkpoint and comes back with load_checkpoint.
optim::LossScaler& get_loss_scaler();

/// A loader over this rank's shard of `dataset`, batches on this worker's device
/// (Ray Train's prepare_data_loader). Call set_epoch(e) before each epoch. With a mesh the data is
/// sharded over dp, as get_dataset_shard's: a pipeline's and a tensor-parallel group's ranks read
/// the same rows.
data::DataLoader prepare_data_loader(data::TensorDataset dataset,
                                     data::DataLoaderOptions options = {});

/// This rank's stream of the Dataset given to the Trainer under `name` (Ray Train's
/// get_dataset_shard): a strided shard of equal length (after the dataset's random_shuffle, redrawn
/// each epoch: call set_epoch(e)), whose preprocessing runs per the dataset's map_batches options.
/// Every rank gets the same number of batches per epoch, also when filters or skipped files leave
/// the shards with different numbers of rows: the ranks agree batch by batch, and all stop when one
/// runs out. Throws UsageError listing the names when `name` is unknown.
data::DataIterator get_dataset_shard(const std::string& name);

/// The shard of `dataset` that rank `rank` of `world_size` streams (what get_dataset_shard uses).
data::Dataset dataset_shard(const data::Dataset& dataset, int rank, int world_size);

}  // namespace cohort::train

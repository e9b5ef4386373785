#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "cohort/comm/process_group.h"
#include "cohort/optim/flat_optimizer.h"
#include "cohort/optim/state_dict.h"
#include "cohort/parallel/fully_shard.h"
#include "cohort/parallel/zero_options.h"

namespace cohort::parallel {

/// What a ZeroOptimizer holds and moves, for benchmarks and the curious.
struct ZeroStats {
  int64_t synchronized_steps = 0;  ///< steps whose gradients were reduced
  int64_t buckets = 0;             ///< gradient buckets
  /// Elements of the flat parameter buffer (padded so that every bucket splits evenly over the
  /// ranks), and of this rank's shard.
  int64_t padded_numel = 0;
  int64_t shard_numel = 0;  ///< elements of this rank's shard
  /// Bytes held on this rank: full parameters, gradients (stage 1: the full gradient buffer and
  /// the reduced shard; stage 2: the reduced shard, plus bucket_bytes_peak while reducing: at
  /// most two buckets, and on Gloo a receive buffer of each's size), and the optimizer state of
  /// the shard (master weights included for 16-bit parameters).
  int64_t parameter_bytes = 0;
  int64_t gradient_bytes = 0;         ///< see parameter_bytes
  int64_t optimizer_state_bytes = 0;  ///< see parameter_bytes
  int64_t bucket_bytes_peak = 0;      ///< see parameter_bytes
  /// Bytes this rank sent in the last synchronised step (reduce-scatter and all-gather, and at
  /// stage 3 the units' all-gathers since the step before; with sharding groups the all-reduce
  /// across them, counted as a ring's).
  int64_t bytes_sent_last_step = 0;
  double wait_seconds = 0;  ///< time waiting for communication
  /// Stage 3: the units whose parameters are sharded, the bytes of gathered units held at most at
  /// once (beside parameter_bytes, which counts the shards and the persistent parameters), and
  /// the units' all-gathers so far: for a forward or backward that needed it, or ahead (prefetch).
  int64_t units = 0;
  int64_t gathered_bytes_peak = 0;  ///< see units
  int64_t gathers = 0;              ///< see units
  int64_t prefetches = 0;           ///< see units
  /// Steps whose units ran in another order than the step before (prefetching then waits for the
  /// new order: recorded again, nothing hangs).
  int64_t order_changes = 0;
};

/// A data-parallel engine and optimizer in one: ZeRO stage 1, 2 or 3 for any torch::nn::Module.
///
/// The module's trainable parameters are laid out in one flat buffer, in buckets (reverse order
/// of registration, the order backward produces gradients), each padded to a multiple of the
/// world size. Rank r owns the r-th piece of every bucket, so each bucket is one reduce-scatter:
/// launched from the backward hooks as the bucket fills (overlap_comm), like DDP's all-reduce.
/// The optimizer steps only this rank's shard (its state exists only for the shard), then every
/// bucket's parameters are all-gathered, so every rank again holds the whole model.
///
/// Stage 3 shards the parameters too: each FullyShard unit of the module (fully_shard.h) is a
/// bucket of its own whose whole parameters exist only from just before its forward to its end,
/// and again from just before its backward until its gradients are ready (then reduce-scattered
/// as at stage 2). The order the units ran in is recorded each step and the next units are
/// all-gathered ahead of use along it; a step that runs them in another order (the same on
/// every rank) waits for each gather instead. Ranks that run different units issue different
/// all-gathers: each is named by its unit ("ZeRO-3 all-gather of unit 'blocks.3' (backward)"),
/// and so is its timeout. Outside forward and backward the units' parameters hold no memory:
/// read or write them inside a GatheredParameters scope (checkpoints, evaluation, checks).
///
/// It is a torch::optim::Optimizer (a FlatOptimizer over the shard): zero_grad(), step(),
/// param_groups() (one group per bucket, every one with the optimizer's options: an lr set on
/// them all, as the LR schedules and linear_lr_scaling do, applies at the next step),
/// clip_grad_norm() (the global norm over every rank's shard), a LossScaler and save/load
/// (this rank's shard, at the same world size) work unchanged; train::save_checkpoint and
/// load_checkpoint write and read sharded checkpoints that reload at any world size. The
/// parameters' .grad are consumed by the synchronising backward: the averaged gradients live
/// sharded here.
///
/// Stage 3 keeps the units' parameters empty once it is destroyed.
///
/// At construction every rank checks that all ranks built the same parameters, then takes rank
/// 0's parameters and buffers. All trainable parameters must share one dtype and device, and
/// `optimizer` (torch::optim's or cohort's flat SGD, Adam or AdamW) must have one param group
/// holding exactly them: its algorithm and options are taken over, its state is not.
class ZeroOptimizer : public optim::FlatOptimizer, public optim::ShardedState {
 public:
  struct Engine;  ///< defined in src/parallel/zero_optimizer.cpp

  /// `own_buckets`: parameters of the module that each make a bucket of their own, so that a
  /// rank's shard of each is the same elements in every engine that holds a copy of it (a
  /// pipeline's tied parameters, whose copies' shard gradients are summed: shard_gradient()).
  ZeroOptimizer(std::shared_ptr<torch::nn::Module> module, const torch::optim::Optimizer& optimizer,
                comm::ProcessGroup group, ZeroOptions options,
                const std::vector<torch::Tensor>& own_buckets = {});
  ~ZeroOptimizer() override;

  /// Steps this rank's shard, then all-gathers the parameters. Before it, the backward that
  /// synchronised (the first outside no_sync()) must have run.
  torch::Tensor step(LossClosure closure = nullptr) override;
  /// The global L2 norm over all ranks' shards, and the shard scaled to at most max_norm.
  torch::Tensor clip_grad_norm(double max_norm) override;
  void skip_step() override;

  /// While the guard lives, backward passes accumulate gradients locally without communication
  /// (gradient accumulation); the first backward after it ends reduces the sum.
  class NoSyncGuard {
   public:
    /// Stops reducing `zero`'s backward passes until the guard ends.
    explicit NoSyncGuard(ZeroOptimizer& zero);
    ~NoSyncGuard();
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    ZeroOptimizer& zero_;
    bool previous_;
  };
  /// A guard under which backward passes accumulate without communication.
  NoSyncGuard no_sync() { return NoSyncGuard(*this); }

  /// Stage 3: the order the units ran in, which prefetching follows ahead in the next step, is
  /// the whole step's while the scope is open rather than one backward's. A pipeline's step runs
  /// several micro-batches' forwards and backwards interleaved, so that per backward the order
  /// would change with the schedule's phase (warm-up, steady, cool-down), and each change is a
  /// forward that waits for its gather. Each backward still reshards the units; close() (a
  /// collective over the group: every rank closes) checks that every rank ran the same units in
  /// the same order and keeps the order for the next step. A scope that ends without close() (an
  /// error stopped the step) drops what it recorded. Stages 1 and 2: nothing to do. One scope at
  /// a time: UsageError for a second.
  class StepOrderScope {
   public:
    /// Opens the scope over `zero`'s next forwards and backwards.
    explicit StepOrderScope(ZeroOptimizer& zero);
    ~StepOrderScope();
    StepOrderScope(const StepOrderScope&) = delete;
    StepOrderScope& operator=(const StepOrderScope&) = delete;
    /// Ends the scope: see the class comment.
    void close();

   private:
    std::shared_ptr<Engine> engine_;
  };

  /// Stage 3: every unit's parameters whole on every rank while it lives (collective: every rank
  /// makes one), e.g. to save or load a model, evaluate it without a gather per unit, or compare
  /// replicas. With write_back, this rank's shards are cut anew from the parameters when it ends
  /// (after a load: every rank loaded the same values). Stages 1 and 2: nothing to do.
  /// Stage 3 also gathers one unit at a time (`unit` indexes unit_names()), to hold no more than
  /// the largest unit while every parameter is read or written (checkpoints do).
  class GatheredParameters : public optim::ParameterGather {
   public:
    /// Every unit gathered (see the class comment).
    explicit GatheredParameters(const ZeroOptimizer& zero, bool write_back = false);
    /// Unit `unit` alone gathered.
    GatheredParameters(const ZeroOptimizer& zero, size_t unit, bool write_back = false);
    ~GatheredParameters() override;
    GatheredParameters(const GatheredParameters&) = delete;
    GatheredParameters& operator=(const GatheredParameters&) = delete;

   private:
    std::shared_ptr<Engine> engine_;
    bool write_back_;
    int64_t unit_ = -1;  ///< every unit
  };
  /// This rank's piece of the reduced gradient of `parameter`, one of the constructor's
  /// own_buckets (a view the step reads: after the synchronised backward, before step()). Its
  /// elements are the parameter's flattened [rank x piece, (rank + 1) x piece), padded with
  /// zeros past its end. A UsageError for a parameter not given as an own bucket.
  torch::Tensor shard_gradient(const torch::Tensor& parameter) const;
  /// Stage 3: the FullyShard units whose parameters are sharded, by their names in the module
  /// (their parameters' names start with `"<name>."`); empty at stages 1 and 2.
  std::vector<std::string> unit_names() const;

  /// The ZeRO stage: 1, 2 or 3.
  int stage() const;
  /// The group the state is sharded over: the data-parallel group, or with
  /// ZeroOptions::shard_group_size this rank's sharding group.
  const comm::ProcessGroup& process_group() const;
  /// With ZeroOptions::shard_group_size, which replica of the state this rank's sharding group
  /// holds (its index among the groups; 0 for the first); 0 without. Only replica 0 writes
  /// checkpoints: the others hold the same shards.
  int replica() const;
  /// The counters (see ZeroStats).
  ZeroStats stats() const;

  /// What this rank's shard holds, for checkpoints that reload at any world size: each piece is
  /// the flattened elements [begin, begin + length) of one parameter, at `offset` in the state
  /// buffers of param group `group`.
  struct ShardPiece {
    std::string parameter;       ///< the parameter's name in the module
    std::vector<int64_t> shape;  ///< the parameter's
    int64_t begin = 0;           ///< its first flattened element in this shard
    int64_t length = 0;          ///< elements of it in this shard
    size_t group = 0;            ///< the param group whose buffers hold it
    int64_t offset = 0;          ///< where in that group's buffers
  };
  /// See ShardPiece.
  std::vector<ShardPiece> shard_pieces() const;
  /// The optimizer state per element, by name (e.g. exp_avg, exp_avg_sq), and group g's buffers.
  std::vector<std::string> state_names() const { return state_buffer_names(); }
  /// See state_names().
  std::vector<torch::Tensor> shard_state(size_t group) const { return state_buffers(group); }
  /// Optimizer steps taken (the same for every piece), e.g. Adam's bias correction.
  int64_t steps() const { return steps_taken(0); }
  /// Sets the steps taken (a loaded checkpoint's).
  void set_steps(int64_t steps);

  /// This rank's shard of the optimizer state as a checkpoint's part (see optim::Stateful): each
  /// piece of shard_pieces() as "<parameter>/<state>" at its first element, views of the shard
  /// (loading fills them in place), shard = this rank of process_group()'s world size; the values
  /// are optim::optimizer_state_values and the stage. A whole optimizer's OptimizerState has the
  /// same names, so either loads into the other, at any stage and world size.
  optim::StateDict state_dict() const override;
  /// See optim::Stateful and optim::check_optimizer_state.
  void check_state(const Json& values) const override;
  /// See optim::Stateful: the shard's pieces, the steps and the learning rate of every group.
  void load_state_dict(const optim::StateDict& state) override;

  /// See optim::ShardedState: this rank's in process_group().
  int checkpoint_rank() const override;
  /// See optim::ShardedState: the first sharding group's ranks (replica() 0).
  bool writes_state() const override;
  /// See optim::ShardedState: with more than one rank in process_group() and replica() 0.
  bool every_rank_saves() const override;
  /// See optim::ShardedState: unit_names().
  std::vector<std::string> sharded_units() const override;
  /// See optim::ShardedState: at stage 3, this rank's piece of each unit's parameters (views of
  /// the shards).
  std::map<std::string, optim::StateTensor> parameter_shards() const override;
  /// See optim::ShardedState: a GatheredParameters.
  std::unique_ptr<optim::ParameterGather> gather_parameters(int64_t unit,
                                                            bool write_back) const override;
  /// See optim::ShardedState: whether the last step() stepped this rank's shard and a peer's
  /// failure then cut the all-gather of the parameters short.
  bool stepped_before_failure() const override;
  /// See optim::ShardedState: stages 1 and 2 all-gather every rank's piece of the parameters
  /// (the one it steps) into every rank's; stage 3 gathers at each use already.
  void gather_parameters_from_shards() override;

 private:
  explicit ZeroOptimizer(std::shared_ptr<Engine> engine);
  std::shared_ptr<Engine> engine_;
};

}  // namespace cohort::parallel

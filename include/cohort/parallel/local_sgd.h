#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "cohort/comm/process_group.h"
#include "cohort/optim/state_dict.h"
#include "cohort/parallel/sync_mode.h"

namespace cohort::parallel {

/// Counters for reports and benchmarks.
struct LocalSgdStats {
  int64_t inner_steps = 0;  ///< optimizer steps taken on this rank
  int64_t outer_steps = 0;  ///< synchronisations
  double sync_seconds = 0;  ///< time spent in them (communication included)
};

/// The optimizer of a model trained with local SGD or DiLoCo: it steps the wrapped (inner)
/// optimizer, and after every H-th step synchronises the replicas. The inner optimizer may be any
/// torch::optim or cohort optimizer; its state stays this rank's own. Its param groups are this
/// optimizer's (options and lr changes made here, e.g. by an LrScheduler, reach the inner one at
/// its next step); save() and load() are the inner optimizer's state.
///
/// The global parameters (those of the last synchronisation) and DiLoCo's outer momentum are kept
/// in flat buffers (2 or 3 copies of the parameters in all); a synchronisation all-reduces one
/// flat pseudo-gradient, so the bytes sent per step are DDP's divided by H.
class LocalSgdOptimizer : public torch::optim::Optimizer, public optim::ShardedState {
 public:
  /// `mode` LocalSgd or DiLoCo; the module's trainable parameters, all of one dtype and device,
  /// must be the inner optimizer's (UsageError naming a parameter otherwise).
  LocalSgdOptimizer(std::shared_ptr<torch::nn::Module> module,
                    std::unique_ptr<torch::optim::Optimizer> inner, comm::ProcessGroup group,
                    const SyncMode& mode);
  ~LocalSgdOptimizer() override;

  /// One inner step; after the H-th since the last synchronisation, synchronises.
  torch::Tensor step(LossClosure closure = nullptr) override;
  /// Synchronises now when any inner step was taken since the last synchronisation (e.g. at the
  /// end of an epoch, before evaluating); every rank must call it at the same point. A peer's
  /// failure during it (PeerFailureError) leaves this rank's state as it was.
  void sync();

  /// Writes the inner optimizer's state.
  void save(torch::serialize::OutputArchive& archive) const override;
  /// Reads the inner optimizer's state.
  void load(torch::serialize::InputArchive& archive) override;

  /// The wrapped optimizer.
  torch::optim::Optimizer& inner() { return *inner_; }
  /// Local SGD or DiLoCo, with its period.
  const SyncMode& mode() const { return mode_; }
  /// H: inner steps between synchronisations.
  int64_t period() const;
  /// Inner steps since the last synchronisation.
  int64_t steps_since_sync() const { return steps_since_sync_; }
  /// The group the replicas are averaged over.
  const comm::ProcessGroup& process_group() const { return group_; }
  /// The counters (see LocalSgdStats).
  LocalSgdStats stats() const { return stats_; }

  /// For checkpoints, by the module's names: the global parameters (views of the flat buffer) and
  /// the module's buffers; DiLoCo's outer momentum (empty without momentum).
  std::map<std::string, at::Tensor> global_state() const;
  /// See global_state(): DiLoCo's outer momentum, by parameter name.
  std::map<std::string, at::Tensor> outer_momentum() const;

  /// This rank's replica as a checkpoint's part (see optim::ShardedState; shard = the rank of
  /// process_group()): its parameters and buffers ("replica/<name>") and its inner optimizer's
  /// state ("inner/<parameter>/<state>", optim::OptimizerState's: SGD, Adam or AdamW), each the
  /// rank's piece of a tensor over the ranks; the first rank also DiLoCo's outer momentum
  /// ("momentum/<parameter>"). See optim::kReplicasPart. The values are the inner optimizer's
  /// (optim::optimizer_state_values) with the world size, the sync mode, the steps since the last
  /// synchronisation and the counters. UsageError for another inner optimizer.
  optim::StateDict state_dict() const override;
  /// Its own part's values, or a whole optimizer's (DDP's, ZeRO's shards, a pipeline's parts):
  /// see optim::check_optimizer_state.
  void check_state(const Json& values) const override;
  /// As many ranks as wrote it: this rank's replica and inner state (or those of the rank its
  /// values name as "replica_from": live recovery's); another number: the inner state of rank
  /// (rank mod writers). A whole optimizer's state: that state, by name.
  optim::StateDict state_to_load(const Json& values) const override;
  /// After the module's parameters were loaded (the model file: the global parameters), they
  /// become the global parameters; the inner optimizer takes its state, steps and learning rate.
  /// With this rank's replica the module continues from it, the period where it was; else a new
  /// period starts from the global parameters.
  void load_state_dict(const optim::StateDict& state) override;
  /// See optim::ShardedState: optim::kReplicasPart.
  const char* part_name() const override { return optim::kReplicasPart; }
  /// See optim::ShardedState: true.
  bool holds_replicas() const override { return true; }
  /// See optim::ShardedState: global_state().
  std::map<std::string, at::Tensor> model_state() const override { return global_state(); }
  /// See optim::ShardedState: sync().
  void synchronize() override { sync(); }
  /// See optim::ShardedState: the rank in process_group().
  int checkpoint_rank() const override { return group_.rank(); }
  /// See optim::ShardedState: every rank writes its replica.
  bool writes_state() const override { return true; }
  /// See optim::ShardedState: true.
  bool every_rank_saves() const override { return true; }
  /// See optim::ShardedState: state_dict() as rank `rank` of `world_size`, with DiLoCo's outer
  /// momentum whatever the rank. UsageError for a rank outside [0, world_size).
  optim::StateDict replica_state_as(int rank, int world_size) const override;
  /// See optim::ShardedState: the synchronisations so far (stats().outer_steps).
  int64_t synchronizations() const override { return stats_.outer_steps; }
  /// See optim::ShardedState: the last step's inner step was taken and its synchronisation
  /// failed; the replica is as the inner step left it, and the next step synchronises.
  bool stepped_before_failure() const override { return stepped_before_failure_; }

 private:
  struct Flat;
  void copy_options_to_inner();
  // This rank's part as rank `rank` of `world`; DiLoCo's outer momentum `with_momentum`.
  optim::StateDict state_as(int rank, int world, bool with_momentum) const;
  // The inner optimizer's state under the module's parameter names.
  optim::OptimizerState inner_state() const;

  std::shared_ptr<torch::nn::Module> module_;
  std::unique_ptr<torch::optim::Optimizer> inner_;
  comm::ProcessGroup group_;
  SyncMode mode_;
  std::unique_ptr<Flat> flat_;
  int64_t steps_since_sync_ = 0;
  bool stepped_before_failure_ = false;
  LocalSgdStats stats_;
};

}  // namespace cohort::parallel

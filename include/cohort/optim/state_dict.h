#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include "cohort/json.h"

namespace cohort::optim {

/// One tensor of a part's state, flattened, or this rank's piece of it: elements
/// [offset, offset + values.numel()) of a tensor of `numel` elements whose other pieces other
/// ranks hold (PyTorch DCP's sharded tensor, in one dimension).
struct StateTensor {
  torch::Tensor values;  ///< this rank's elements, 1-D
  int64_t offset = 0;    ///< where they begin in the whole tensor
  int64_t numel = 0;     ///< elements of the whole tensor
  /// What the checkpointer calls once it has written `values` to a file or filled them from one:
  /// gives their pages back where they are a window onto a file (optimizer state offloaded to
  /// disk, FlatOptimizer::offload_state), so that a checkpoint streams such a state through
  /// memory rather than holding it all; empty where they are ordinary memory. Valid while the
  /// part that gave it lives.
  std::function<void()> release;
};

/// What a part with state (an optimizer, a ZeRO shard, a loss scaler, ...) gives a checkpoint:
/// named tensors, each whole or this rank's piece, and JSON for the rest. The names are the
/// part's own; an optimizer's are "<parameter>/<state>" (e.g. "0.weight/exp_avg"), so that
/// a ZeRO shard's pieces and a whole optimizer's tensors are the same state cut otherwise.
struct StateDict {
  std::map<std::string, StateTensor> tensors;  ///< by name
  Json values = Json::object();                ///< what is not a tensor (steps, lr, ...)
  /// This rank's index among the ranks whose pieces together are the state, and their number:
  /// 0 and 1 when this rank holds it whole (a replicated part, which one rank writes).
  int shard = 0;
  /// See shard.
  int shards = 1;
};

/// A part with state that a checkpoint keeps (PyTorch DCP's Stateful protocol). Saving writes
/// state_dict(). Loading asks state_dict() which tensors and ranges this part holds now, checks
/// the checkpoint's values with check_state(), fills the tensors from whichever ranks wrote them
/// (reading only the overlapping ranges, so a state written by N ranks loads on M), and hands the
/// result to load_state_dict(). train::save_state and train::load_state are the checkpointer.
class Stateful {
 public:
  virtual ~Stateful() = default;
  /// The state now. Its tensors may be views of the part's own, which loading fills in place.
  virtual StateDict state_dict() const = 0;
  /// Throws UsageError when a checkpoint's `values` cannot load into this part (another
  /// algorithm, another model), before any tensor is read. Accepts any by default.
  virtual void check_state(const Json& values) const { (void)values; }
  /// The tensors and ranges to fill from a checkpoint whose values are `values` (checked by
  /// check_state): state_dict()'s by default. A part whose layout depends on the writer's says so
  /// here (local SGD's replicas take another rank's state where the world size changed).
  virtual StateDict state_to_load(const Json& values) const {
    (void)values;
    return state_dict();
  }
  /// Takes `state`: state_to_load()'s tensors, filled, and the checkpoint's values.
  virtual void load_state_dict(const StateDict& state) = 0;
};

/// What ShardedState::gather_parameters returns: while it lives, the parameters it gathered are
/// whole on every rank of the group.
class ParameterGather {
 public:
  virtual ~ParameterGather() = default;
};

/// The part of a checkpoint that holds optimizer state in shards by OptimizerState's names
/// ("<parameter>/<state>"): ZeRO's and the parameter server's.
inline constexpr const char* kOptimizerShardsPart = "zero";
/// The part of a checkpoint that holds replicas (local SGD's and DiLoCo's, ShardedState::
/// holds_replicas): every rank's parameters and buffers under kReplicaTensors, its inner
/// optimizer's state under kInnerTensors (OptimizerState's names), each rank's piece of a tensor
/// over the ranks, and DiLoCo's outer momentum under kMomentumTensors.
inline constexpr const char* kReplicasPart = "local_sgd";
/// See kReplicasPart.
inline constexpr const char* kReplicaTensors = "replica/";
/// See kReplicasPart.
inline constexpr const char* kInnerTensors = "inner/";
/// See kReplicasPart.
inline constexpr const char* kMomentumTensors = "momentum/";

/// An optimizer whose state lies in pieces over a group of ranks: ZeRO's and the parameter
/// server's shards (part kOptimizerShardsPart, with OptimizerState's names, so that any of them
/// loads into any other and into a whole optimizer), local SGD's replicas. train's checkpointer
/// asks it, not its type, which rank writes what.
class ShardedState : public Stateful {
 public:
  /// The name of its part in a checkpoint (train::save_state's files).
  virtual const char* part_name() const { return kOptimizerShardsPart; }
  /// Whether each rank's parameters differ from the others' between synchronisations (local
  /// SGD's and DiLoCo's replicas): a checkpoint keeps every rank's, and the model file holds
  /// model_state(). False by default.
  virtual bool holds_replicas() const { return false; }
  /// The tensors a checkpoint's model file holds instead of the module's, by name (local SGD:
  /// the global parameters of the last synchronisation and the buffers); empty by default (the
  /// module's).
  virtual std::map<std::string, at::Tensor> model_state() const { return {}; }
  /// Brings every rank to one model, e.g. at the end of an epoch (local SGD's and the parameter
  /// server's sync()): a collective that every rank calls. Nothing by default.
  virtual void synchronize() {}
  /// This rank's index in the group whose first rank writes the model and the state's manifest.
  virtual int checkpoint_rank() const = 0;
  /// Whether this rank writes its piece of the state: false where another rank holds the same
  /// (ZeRO's sharding groups after the first) or none (the parameter server's ranks that run no
  /// server).
  virtual bool writes_state() const = 0;
  /// Whether every rank of the group must save and load checkpoints (a collective, or its own
  /// files), rather than one.
  virtual bool every_rank_saves() const = 0;
  /// Brings the group to one state before a checkpoint is taken: a collective that every rank
  /// calls (the parameter server applies every push, and every rank takes the servers'
  /// parameters). Nothing by default.
  virtual void prepare_checkpoint() const {}
  /// The units whose parameters lie in shards between steps (ZeRO-3's), by their names in the
  /// module (their parameters' names start with "<name>."); empty by default (none).
  virtual std::vector<std::string> sharded_units() const { return {}; }
  /// This rank's pieces of the parameters that lie in shards between steps (ZeRO-3's units'), by
  /// their names in the module: elements [offset, offset + values.numel()) of the flattened
  /// parameter, `values` a view of this rank's shard that loading fills in place (empty where the
  /// rank holds none of it). So a model file loads into the shards reading only this rank's
  /// ranges, with no collective. Empty by default (every parameter whole).
  virtual std::map<std::string, StateTensor> parameter_shards() const { return {}; }
  /// Unit `unit` (an index of sharded_units()), or every unit when `unit` is negative, whole on
  /// every rank while the result lives; with `write_back` this rank's shards are cut anew from
  /// the parameters when it ends (after a load). A collective: every rank of the group calls it.
  /// Nothing to gather by default (an empty guard).
  virtual std::unique_ptr<ParameterGather> gather_parameters(int64_t unit, bool write_back) const {
    (void)unit;
    (void)write_back;
    return std::make_unique<ParameterGather>();
  }

  /// Live recovery (train::FailureConfig::Recovery::kLive) of a holder of replicas: this rank's
  /// replica as rank `rank` of a group of `world_size` (the regrouped ranks are numbered anew),
  /// with the state every rank holds alike (DiLoCo's outer momentum) whatever `rank`. Throws
  /// std::logic_error by default (no replicas).
  virtual StateDict replica_state_as(int rank, int world_size) const;
  /// How many times the ranks brought their replicas together so far (local SGD's
  /// synchronisations): with the optimizer steps, how far a rank got. 0 by default.
  virtual int64_t synchronizations() const { return 0; }
  /// Whether the last step() changed this rank's state before a peer's failure ended it with an
  /// error (local SGD: the inner step was taken and the synchronisation after it failed, leaving
  /// the rest as it was): the step's batch is trained on. False by default.
  virtual bool stepped_before_failure() const { return false; }
  /// Every rank's parameters rebuilt from the ranks' pieces of them (ZeRO 1-2: each rank's
  /// piece of the parameters is the one it steps). After a live recovery's load only that
  /// piece of a rank's model file is sure to be current: a peer's failure may have cut the
  /// all-gather after the last step short. A collective: every rank of the group calls it.
  /// Nothing by default.
  virtual void gather_parameters_from_shards() {}
};

/// The values every optimizer's state dict holds: its algorithm ("sgd", "adam", "adamw"), the
/// names of the state it keeps per element (state_names_of), the steps taken and the learning
/// rate.
Json optimizer_state_values(const std::string& algorithm, const std::vector<std::string>& names,
                            int64_t steps, double lr);
/// Throws UsageError when `values` (optimizer_state_values of a checkpoint) are another
/// algorithm's or another state's than `algorithm` with `names`, naming both.
void check_optimizer_state(const Json& values, const std::string& algorithm,
                           const std::vector<std::string>& names);

/// A whole optimizer's state as a Stateful part: every parameter's state (state_names_of)
/// flattened under "<parameter name>/<state>", and optimizer_state_values. The optimizer has one
/// param group and is SGD, Adam or AdamW, torch::optim's or a flat one; its parameters are named
/// by the caller, in the group's order. The state of a parameter never stepped is zeros.
class OptimizerState : public Stateful {
 public:
  /// Over `optimizer`, whose parameters are named `names`; UsageError for an optimizer of another
  /// algorithm or more than one param group, or names that do not match its parameters.
  OptimizerState(torch::optim::Optimizer& optimizer, std::vector<std::string> names);
  /// See Stateful. Replicated: every tensor whole, shards 1. A FlatOptimizer's tensors are views
  /// of its own buffers (a load through state_to_load fills them in place; one that fails part
  /// way leaves them partly filled); a torch optimizer's are its state tensors in float32.
  StateDict state_dict() const override;
  /// See Stateful and check_optimizer_state.
  void check_state(const Json& values) const override;
  /// See Stateful: the state, steps and learning rate set on every parameter.
  void load_state_dict(const StateDict& state) override;

 private:
  torch::optim::Optimizer& optimizer_;
  std::vector<std::string> names_;
  std::string algorithm_;
  std::vector<std::string> state_names_;
};

/// A torch::optim optimizer (SGD, Adam or AdamW, by `algorithm`) over `params` with `options` of
/// that algorithm's type: e.g. a stand-in to read another program's archive of the same kind.
std::unique_ptr<torch::optim::Optimizer> make_torch_optimizer(
    const std::string& algorithm, std::vector<torch::Tensor> params,
    const torch::optim::OptimizerOptions& options);

}  // namespace cohort::optim

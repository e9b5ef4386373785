#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "cohort/comm/process_group.h"
#include "cohort/optim/state_dict.h"
#include "cohort/parallel/sync_mode.h"

namespace cohort::parallel {

/// Counters of one worker, for reports and benchmarks.
struct ParameterServerStats {
  int64_t pushes = 0;         ///< optimizer steps: gradients pushed (to every server)
  int64_t staleness_sum = 0;  ///< over the pushes: updates the servers applied between this
  int64_t staleness_max = 0;  ///< worker's pull and its push (0: nobody else stepped in between)
  double wait_seconds = 0;    ///< in push-pull round trips (the staleness bound's waits included)
  int64_t bytes_sent = 0;     ///< gradients and requests sent to the servers
  /// Mean staleness over the pushes (0 without any).
  double staleness_mean() const {
    return pushes > 0 ? static_cast<double>(staleness_sum) / static_cast<double>(pushes) : 0.0;
  }
};

/// The optimizer of a model trained with an asynchronous parameter server. The first S ranks of
/// the group each run a server (a thread of the worker process) that holds one contiguous shard
/// of the parameters and that shard's optimizer state (the wrapped optimizer's algorithm and
/// options: SGD, Adam or AdamW, one param group). step() pushes this rank's gradients to every
/// server, which applies them at once with its optimizer, and pulls the updated shard back: the
/// workers never wait for each other, except that a worker more than max_staleness pushes ahead
/// of the slowest waits for it (bounded staleness; every server keeps each worker's count).
/// The learning rate of this optimizer's param group (set by an LrScheduler) travels with each
/// push. Gradients and parameters travel as float32 over TCP on the group's interface address.
///
/// Each push is one update with the learning rate as given (TensorFlow's ParameterServerStrategy
/// does the same): with W workers the servers take W updates per round of steps.
class ParameterServerOptimizer : public torch::optim::Optimizer, public optim::ShardedState {
 public:
  /// `mode.servers` >= 1 and at most the group's size (UsageError otherwise); the module's
  /// trainable parameters must be `optimizer`'s (one param group), float32.
  ParameterServerOptimizer(std::shared_ptr<torch::nn::Module> module,
                           std::unique_ptr<torch::optim::Optimizer> optimizer,
                           comm::ProcessGroup group, const AsyncParameterServer& mode);
  /// Says goodbye to every server; a server rank then serves the others until they have said
  /// theirs (within the group's timeout), so that no worker loses its server mid-run.
  ~ParameterServerOptimizer() override;

  /// Pushes the gradients, pulls the parameters (after the staleness bound's wait, if any).
  torch::Tensor step(LossClosure closure = nullptr) override;
  /// Every rank at the same point (e.g. the end of an epoch): waits until every worker's pushes
  /// are applied, then every rank takes the servers' parameters, so that all hold one model; the
  /// servers' state at that point is what state_dict() holds. A collective of the group.
  void sync();

  /// The wrapped optimizer's param groups and options (its state is on the servers).
  void save(torch::serialize::OutputArchive& archive) const override;
  /// Reads save()'s param groups and options.
  void load(torch::serialize::InputArchive& archive) override;

  /// The mode: staleness bound and servers.
  const AsyncParameterServer& mode() const { return mode_; }
  /// The number of servers.
  int servers() const { return mode_.servers; }
  /// Whether this rank runs a server, and its index (the rank).
  bool serves() const;
  /// The group of workers and servers.
  const comm::ProcessGroup& process_group() const { return group_; }
  /// The counters (see ParameterServerStats).
  ParameterServerStats stats() const { return stats_; }
  /// The flat parameters' size and the [begin, end) of every server's shard.
  int64_t numel() const;
  /// See numel().
  std::vector<std::pair<int64_t, int64_t>> shard_ranges() const;
  /// The address this rank's server listens on ("host:port"; empty where it serves none).
  std::string server_address() const;
  /// This rank's server's optimizer state at the last sync() as a checkpoint's part (see
  /// optim::ShardedState): ZeRO's names and cut, "<parameter>/<state>" pieces of the parameters
  /// in the server's range; shard = the server's index of servers() (nothing where it serves
  /// none). The values are optim::optimizer_state_values, the servers' version and the pushes
  /// they took from each worker.
  optim::StateDict state_dict() const override;
  /// See optim::Stateful and optim::check_optimizer_state.
  void check_state(const Json& values) const override;
  /// Collective: after the module's parameters were loaded (the same on every rank), each server
  /// takes them and its range of `state`'s pieces (written by any number of servers, by ZeRO at
  /// any stage, or by a whole optimizer), and every worker the version and pushes of the values
  /// (a state without them, e.g. ZeRO's, starts the counts at 0). Then sync().
  void load_state_dict(const optim::StateDict& state) override;
  /// See optim::ShardedState: the rank in process_group().
  int checkpoint_rank() const override;
  /// See optim::ShardedState: whether this rank serves.
  bool writes_state() const override;
  /// See optim::ShardedState: true (saving synchronises the group).
  bool every_rank_saves() const override { return true; }
  /// See optim::ShardedState: sync(). The servers' state does not change; every rank is brought
  /// to it.
  void prepare_checkpoint() const override;
  /// See optim::ShardedState: sync().
  void synchronize() override { sync(); }

 private:
  struct Server;
  struct Client;
  std::shared_ptr<torch::nn::Module> module_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  comm::ProcessGroup group_;
  AsyncParameterServer mode_;
  std::string algorithm_;                 ///< "sgd", "adam" or "adamw"
  std::vector<std::string> state_names_;  ///< the state it keeps per element
  std::unique_ptr<Server> server_;
  std::unique_ptr<Client> client_;
  ParameterServerStats stats_;
};

}  // namespace cohort::parallel

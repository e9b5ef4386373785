// Live recovery under cohort launch: the host of the coordinator (runtime::CoordinatorServer),
// cohort launch's job host, hosts the decisions too (LiveRegroups, as the local driver does), fed
// by the coordinator's hooks; it publishes each decision in the store for the survivors
// (live_decision_key) and asks the launchers for the replacements (runtime/node_launcher.h's
// keys), which join the new group as the local driver's do. A rank that hangs is killed by its
// launcher at the host's word, then lost like any other, rank 0 included. The job host's own loss
// ends the round: the launchers restart the job (--max-restarts) from its snapshots or
// checkpoints.
#pragma once
#include <chrono>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "cohort/comm/store.h"
#include "cohort/json.h"
#include "cohort/runtime/coordinator.h"
#include "train/live_regroups.h"

namespace cohort::train {

struct LaunchedRegroupsOptions {
  comm::Store store;  // a connection of its own: it is used on the coordinator's thread
  int world_size = 1;
  int launch_round = 0;  // the launcher's round (COHORT_RESTART_ROUND)
  std::string token;     // the run's, which the survivors' regroup_after waits under
  int min_workers = 1;
  bool replace_lost = true;  // FailureConfig::replace_lost
  std::chrono::milliseconds deadline{60'000};
  std::function<int64_t()> next_checkpoint;  // the run recorder's next checkpoint index
  // A line for the host's console (called on the coordinator's thread).
  std::function<void(const std::string& line)> say;
  int verbose = 1;
};

class LaunchedRegroups {
 public:
  explicit LaunchedRegroups(LaunchedRegroupsOptions options);
  // The coordinator's live hooks, which call this object (it must outlive the server). Locks:
  // the server's, then this object's; the callers of failures() may hold theirs before it, and
  // the hooks take no lock of theirs.
  runtime::CoordinatorServerOptions::LiveHooks hooks();
  // Every rank's message, from the server's on_message (under its lock), by the rank's index.
  void on_message(int index, const Json& message);
  // The ranks of the group now (after the last decision).
  int world_size();
  // The rank of the worker at `index` in the group now; -1 once it is no longer in it.
  int rank_of(int index);
  // The server the hooks serve, for its regrouped() after each decision.
  void attach(runtime::CoordinatorServer* server);
  // The failures the group went on after, for the result (as the local driver records them:
  // "rank", "cause", "detected_at_s", "live": true, "recovery_s" once rank 0 trained again).
  std::vector<Json> failures();

 private:
  bool go_on_without(int index, const std::string& how);
  bool end_hung(int index, const std::string& reason);
  void tick();
  double seconds_since_start() const;

  LaunchedRegroupsOptions options_;
  std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
  std::mutex mutex_;
  LiveRegroups regroups_;
  std::map<int, int> losses_;  // by index: its processes lost so far (the launcher counts alike)
  std::map<int, std::string> hung_;  // by index: why rank 0 asked its launcher to kill it
  runtime::CoordinatorServer* server_ = nullptr;
  bool awaiting_recovery_ = false;  // regrouped: the new rank 0's next step ends the recovery
  bool gave_up_ = false;            // the group cannot go on: said once, and never decided again
  std::vector<Json> failures_;
};

}  // namespace cohort::train

#include "train/launched_regroups.h"

#include <optional>

#include "cohort/runtime/node_launcher.h"
#include "train/live_recovery.h"

namespace cohort::train {

LaunchedRegroups::LaunchedRegroups(LaunchedRegroupsOptions options)
    : options_(std::move(options)),
      regroups_({.world_size = options_.world_size,
                 .min_workers = options_.min_workers,
                 .deadline = options_.deadline,
                 .replaceable = [replace = options_.replace_lost](int) { return replace; }}) {}

runtime::CoordinatorServerOptions::LiveHooks LaunchedRegroups::hooks() {
  return {
      .go_on_without = [this](int index,
                              const std::string& how) { return go_on_without(index, how); },
      .end_hung = [this](int index, const std::string& reason) { return end_hung(index, reason); },
      .on_tick = [this] { tick(); }};
}

void LaunchedRegroups::attach(runtime::CoordinatorServer* server) {
  std::lock_guard lock(mutex_);
  server_ = server;
}

int LaunchedRegroups::world_size() {
  std::lock_guard lock(mutex_);
  int ranks = 0;
  for (int i = 0; i < options_.world_size; ++i) ranks += regroups_.rank_of(i) >= 0;
  return ranks;
}

int LaunchedRegroups::rank_of(int index) {
  std::lock_guard lock(mutex_);
  return regroups_.rank_of(index);
}

std::vector<Json> LaunchedRegroups::failures() {
  std::lock_guard lock(mutex_);
  return failures_;
}

double LaunchedRegroups::seconds_since_start() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count();
}

void LaunchedRegroups::on_message(int index, const Json& message) {
  if (!message.is_object()) return;
  const auto type = message.value("type", std::string{});
  std::lock_guard lock(mutex_);
  if (awaiting_recovery_ && regroups_.rank_of(index) == 0 &&
      (type == "step" || type == "progress")) {
    // Rank 0 of the new group trains again.
    awaiting_recovery_ = false;
    auto& failure = failures_.back();
    failure["recovery_s"] = seconds_since_start() - failure["detected_at_s"].get<double>();
    if (options_.verbose >= 1) {
      options_.say("cohort: live recovery: training again " +
                   std::to_string(failure["recovery_s"].get<double>()) +
                   " s after the failure was detected");
    }
  }
  if (type == "regroup_ready") {
    regroups_.on_ready(index, json_field<int64_t>(message, "steps", 0),
                       json_field<int64_t>(message, "syncs", 0));
  } else if (type == "live_model") {
    regroups_.on_training(index);
  }
}

bool LaunchedRegroups::end_hung(int index, const std::string& reason) {
  std::lock_guard lock(mutex_);
  // As the local driver: only a rank that trains, where a replacement or enough workers remain.
  if (!regroups_.training(index) ||
      (!regroups_.replaceable(index) &&
       static_cast<int>(regroups_.survivors().size()) <= options_.min_workers)) {
    return false;
  }
  try {
    options_.store.set(runtime::launch_kill_key(options_.launch_round, index, losses_[index] + 1),
                       reason);
    options_.store.add(runtime::launch_kills_key(options_.launch_round), 1);
  } catch (const std::exception&) {
    return false;  // the store is gone: the verdict stands
  }
  hung_[index] = reason;
  if (options_.verbose >= 1)
    options_.say("cohort: " + reason +
                 ": its launcher kills it, and the others go on (live recovery)");
  return true;
}

bool LaunchedRegroups::go_on_without(int index, const std::string& how) {
  std::lock_guard lock(mutex_);
  const int rank = regroups_.rank_of(index);
  const auto hung = hung_.find(index);
  const std::string cause =
      hung != hung_.end() ? hung->second : "rank " + std::to_string(rank) + " " + how;
  if (hung != hung_.end()) hung_.erase(hung);
  regroups_.on_exited(index);
  const auto loss = regroups_.lose(index, cause);
  if (!loss.refusal.empty()) options_.say("cohort: " + loss.refusal);
  if (!loss.goes_on) return false;
  ++losses_[index];
  failures_.push_back(Json{{"rank", rank},
                           {"cause", cause},
                           {"detected_at_s", seconds_since_start()},
                           {"restarted", false},
                           {"live", true},
                           {"recovery_s", nullptr}});
  if (options_.verbose >= 1) {
    options_.say("cohort: " + cause + ": the " + std::to_string(loss.left) +
                 " survivor(s) regroup without restarting (live recovery)");
  }
  return true;
}

void LaunchedRegroups::tick() {
  // What the lock guards, taken under it: the rest runs on this thread alone (the coordinator's).
  std::optional<LiveRegroups::Decision> decision;
  std::map<int, std::pair<int, int>> replacements;  // by index: its new rank, and which loss
  std::string stop;
  std::string said;  // the decision, in a line
  int stop_round = 0;
  runtime::CoordinatorServer* server = nullptr;
  {
    std::lock_guard lock(mutex_);
    if (gave_up_) return;  // the survivors fail, and the launchers restart the job
    try {
      auto poll = regroups_.poll([&](int index) {
        return options_.store.check(
            {runtime::launch_place_free_key(options_.launch_round, index, losses_[index])});
      });
      stop = std::move(poll.stop);
      decision = std::move(poll.decision);
    } catch (const std::exception& e) {
      // The store is gone with the launcher of node 0: the round ends, and the launchers say why.
      options_.say(std::string("cohort: live recovery: ") + e.what());
      return;
    }
    stop_round = regroups_.rounds() + 1;
    gave_up_ = !stop.empty();
    server = server_;
    if (decision) {
      awaiting_recovery_ = true;
      said = "cohort: " + regroups_.describe(*decision, " by their launchers");
      for (int i : decision->replacements) replacements[i] = {regroups_.rank_of(i), losses_[i]};
    }
  }
  // Published without this object's lock: the run's next checkpoint index is under the host's.
  try {
    if (!stop.empty()) {
      // Every survivor reads that the group cannot go on, and fails: the launchers restart.
      options_.say("cohort: " + stop);
      options_.store.set(live_decision_key(options_.token, stop_round),
                         Json{{"members", Json::array()}, {"stop", stop}}.dump());
      return;
    }
    if (!decision) return;
    const auto& d = *decision;
    Json record = d.record;
    record["next_checkpoint"] = options_.next_checkpoint();
    options_.store.set(live_decision_key(options_.token, d.round), record.dump());
    const int world = static_cast<int>(d.group.size());
    for (int i : d.replacements) {
      const auto [rank, loss] = replacements.at(i);
      options_.store.set(runtime::launch_replacement_key(options_.launch_round, i, loss),
                         Json{{"rank", rank},
                              {"world_size", world},
                              {"live_round", d.round},
                              {"source", record["source"]},
                              {"next_checkpoint", record["next_checkpoint"]}}
                             .dump());
    }
    if (options_.verbose >= 1) options_.say(said);
  } catch (const std::exception& e) {
    options_.say(std::string("cohort: live recovery: ") + e.what());
    return;
  }
  if (server != nullptr) server->regrouped(decision->replacements);
}

}  // namespace cohort::train

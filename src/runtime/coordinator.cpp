// The coordinator's judgement (Coordinator, HeartbeatMonitor, the stall inspector): messages and
// a clock in, a verdict out, no sockets (those are coordinator_server.cpp's), so that it is
// tested, and fuzzed (tests/fuzz/coordinator_messages.cpp), alone.
#include "cohort/runtime/coordinator.h"

#include <algorithm>
#include <limits>
#include <map>
#include <string>

#include "cohort/error.h"

namespace cohort::runtime {

using std::chrono::milliseconds;

ClockSource steady_clock_source() {
  return [] { return std::chrono::steady_clock::now(); };
}

void HeartbeatOptions::validate() const {
  if (interval.count() <= 0) {
    throw UsageError("heartbeat interval " + std::to_string(interval.count()) +
                     " ms: it must be > 0");
  }
  if (timeout.count() <= 0) {
    throw UsageError("heartbeat timeout " + std::to_string(timeout.count()) +
                     " ms: it must be > 0 (FailureConfig.heartbeat_timeout, --heartbeat-timeout)");
  }
  if (startup_grace.count() < 0) {
    throw UsageError("heartbeat start-up grace " + std::to_string(startup_grace.count()) +
                     " ms: it must be >= 0");
  }
}

milliseconds heartbeat_interval_for(milliseconds timeout) {
  return std::clamp(timeout / 5, milliseconds(10), milliseconds(1'000));
}

// ---------------------------------------------------------------------------------------------
// HeartbeatMonitor

HeartbeatMonitor::HeartbeatMonitor(int members, HeartbeatOptions options, ClockSource clock)
    : options_(options), clock_(std::move(clock)) {
  options_.validate();
  latest_arrival_ = clock_();
  last_.assign(static_cast<size_t>(members), latest_arrival_);
  heard_.assign(static_cast<size_t>(members), false);
  finished_.assign(static_cast<size_t>(members), false);
}

void HeartbeatMonitor::heard(int member) {
  const SteadyTime now = clock_();
  last_.at(static_cast<size_t>(member)) = now;
  if (!heard_[static_cast<size_t>(member)]) latest_arrival_ = std::max(latest_arrival_, now);
  heard_[static_cast<size_t>(member)] = true;
}

void HeartbeatMonitor::finished(int member) { finished_.at(static_cast<size_t>(member)) = true; }

void HeartbeatMonitor::restarted(int member) {
  finished_.at(static_cast<size_t>(member)) = false;
  heard_[static_cast<size_t>(member)] = false;
  last_[static_cast<size_t>(member)] = clock_();
}

std::optional<HeartbeatMonitor::Silence> HeartbeatMonitor::find_silent() const {
  const auto now = clock_();
  for (size_t m = 0; m < last_.size(); ++m) {
    if (finished_[m]) continue;
    const milliseconds allowed =
        heard_[m] ? options_.timeout : options_.startup_grace + options_.timeout;
    // One still starting is given its grace from its own start or, when later, from the latest
    // peer's arrival, whose rendezvous deadline then runs out first and names it better.
    const SteadyTime since = heard_[m] ? last_[m] : std::max(last_[m], latest_arrival_);
    if (now - since >= allowed) {
      return Silence{.member = static_cast<int>(m), .allowed = allowed, .started = heard_[m]};
    }
  }
  return std::nullopt;
}

bool HeartbeatMonitor::all_finished() const {
  return std::all_of(finished_.begin(), finished_.end(), [](bool f) { return f; });
}

std::string HeartbeatMonitor::Silence::describe(const std::string& who) const {
  const auto ms = allowed.count();
  const std::string span =
      ms % 1000 == 0 ? std::to_string(ms / 1000) + " s" : std::to_string(ms) + " ms";
  return started ? who + " sent no heartbeat for " + span + ": it hangs or was stopped"
                 : who + " sent no heartbeat within " + span +
                       " of its start: it hangs in start-up or was stopped";
}

// ---------------------------------------------------------------------------------------------
// Stall inspector

namespace {

// One group of a rank's activity status (activity_status()'s shape).
struct GroupActivity {
  std::string name;
  std::vector<int> ranks;
  int64_t entered = 0;
  std::string last, activity;
};

// The groups of a rank's activity status (null: none known), every field type-checked: a
// UsageError names the field of a malformed one, which a peer's heartbeat may carry.
std::vector<GroupActivity> groups_of(const Json& status) {
  std::vector<GroupActivity> groups;
  if (status.is_null()) return groups;
  const Json list = json_field<Json>(status, "groups", Json::array());
  if (!list.is_array()) {
    throw UsageError(std::string("field 'groups' is ") + list.type_name() + ", not an array");
  }
  for (const Json& g : list) {
    GroupActivity group{.name = json_field<std::string>(g, "name", ""),
                        .entered = json_field<int64_t>(g, "entered", 0),
                        .last = json_field<std::string>(g, "last", "none"),
                        .activity = json_field<std::string>(g, "activity", "")};
    const Json ranks = json_field<Json>(g, "ranks", Json::array());
    if (!ranks.is_array()) {
      throw UsageError(std::string("field 'ranks' is ") + ranks.type_name() + ", not an array");
    }
    for (const Json& r : ranks) {
      if (!r.is_number_integer() || r.get<int64_t>() < 0 ||
          r.get<int64_t>() > std::numeric_limits<int>::max()) {
        throw UsageError("field 'ranks' holds " + r.dump().substr(0, 40) + ", not a rank");
      }
      group.ranks.push_back(r.get<int>());
    }
    groups.push_back(std::move(group));
  }
  return groups;
}

}  // namespace

std::string stall_report(const std::vector<Json>& status_by_rank) {
  // Per group (by name, in order of first appearance): each member's count, last collective and
  // activity.
  struct Entry {
    int64_t entered = 0;
    std::string last, activity;
  };
  struct Seen {
    std::vector<int> ranks;
    std::map<int, Entry> by_rank;
  };
  std::vector<std::string> order;
  std::map<std::string, Seen> groups;
  for (size_t r = 0; r < status_by_rank.size(); ++r) {
    std::vector<GroupActivity> of_rank;
    try {
      of_rank = groups_of(status_by_rank[r]);
    } catch (const UsageError&) {
      continue;  // a malformed status (refused by on_message already) tells nothing
    }
    for (auto& g : of_rank) {
      auto [it, fresh] = groups.try_emplace(g.name);
      if (fresh) order.push_back(g.name);
      if (it->second.ranks.empty()) it->second.ranks = std::move(g.ranks);
      it->second.by_rank[static_cast<int>(r)] = {g.entered, std::move(g.last),
                                                 std::move(g.activity)};
    }
  }
  std::string report;
  for (const auto& name : order) {
    const Seen& seen = groups[name];
    int64_t most = 0;
    bool active = false;
    for (const auto& [rank, entry] : seen.by_rank) {
      most = std::max(most, entry.entered);
      active = active || !entry.activity.empty();
    }
    std::string behind, detail;
    for (int rank : seen.ranks) {
      const auto it = seen.by_rank.find(rank);
      const int64_t entered = it == seen.by_rank.end() ? 0 : it->second.entered;
      std::string about = " unknown";
      if (it != seen.by_rank.end()) {
        about = " entered " + std::to_string(entered) + " (last " + it->second.last +
                (it->second.activity.empty() ? "" : ", in " + it->second.activity) + ")";
      }
      detail += (detail.empty() ? "" : ", ") + std::string("rank ") + std::to_string(rank) + about;
      if (entered < most) behind += (behind.empty() ? "" : ", ") + std::to_string(rank);
    }
    // Point-to-point groups (pipelines) legitimately differ in counts; their activity says where
    // each rank waits.
    if (behind.empty() && !active) continue;
    report += std::string(report.empty() ? "" : "; ") + "group " + name + ": ";
    report += active ? "ranks wait in (" + detail + ")"
                     : "ranks [" + behind + "] did not enter collective #" + std::to_string(most) +
                           " (" + detail + ")";
  }
  return report;
}

// ---------------------------------------------------------------------------------------------
// Coordinator

Coordinator::Coordinator(int world_size, HeartbeatOptions options, ClockSource clock)
    : monitor_(world_size, options, std::move(clock)), status_(static_cast<size_t>(world_size)) {}

void Coordinator::on_message(int rank, const Json& message) {
  if (rank < 0 || rank >= world_size()) return;
  const auto type = json_field<std::string>(message, "type", "");
  const auto text = json_field<std::string>(message, "message", "unknown error");
  const bool consequence = json_field<bool>(message, "consequence", false);
  const Json status = json_field<Json>(message, "status", Json());
  if (type == "heartbeat") groups_of(status);  // refuses a malformed one before it is recorded
  monitor_.heard(rank);
  if (type == "heartbeat") {
    status_[static_cast<size_t>(rank)] = status;
  } else if (type == "error") {
    Verdict v{.rank = rank, .reason = "rank " + std::to_string(rank) + " failed: " + text};
    if (!consequence) {
      if (!cause_) cause_ = std::move(v);
    } else if (!consequence_) {
      consequence_ = std::move(v);
      consequence_at_ = monitor_.now();
    }
  }
}

void Coordinator::on_finished(int rank) {
  if (rank >= 0 && rank < world_size()) monitor_.finished(rank);
}

void Coordinator::on_lost(int rank, const std::string& how) {
  if (rank < 0 || rank >= world_size()) return;
  monitor_.finished(rank);
  if (!cause_) cause_ = Verdict{.rank = rank, .reason = "rank " + std::to_string(rank) + " " + how};
}

void Coordinator::on_regrouped(const std::vector<int>& restarted) {
  cause_.reset();
  consequence_.reset();
  verdict_.reset();
  for (int rank : restarted) {
    monitor_.restarted(rank);
    status_.at(static_cast<size_t>(rank)) = nullptr;
  }
}

void Coordinator::on_ending_hung(int rank) {
  if (rank < 0 || rank >= world_size()) return;
  monitor_.finished(rank);
  if (verdict_ && verdict_->rank == rank && verdict_->silent) verdict_.reset();
}

std::string Coordinator::stall_report() const { return runtime::stall_report(status_); }

std::optional<Coordinator::Verdict> Coordinator::verdict() {
  if (verdict_) return verdict_;
  if (cause_) {
    verdict_ = cause_;
  } else if (const auto silent = monitor_.find_silent()) {
    const std::string stall = stall_report();
    verdict_ = Verdict{.rank = silent->member,
                       .reason = silent->describe("rank " + std::to_string(silent->member)) +
                                 (stall.empty() ? "" : "; " + stall),
                       .silent = true};
  } else if (consequence_ && monitor_.now() - consequence_at_ >= 2 * options().interval) {
    verdict_ = consequence_;
  }
  return verdict_;
}

}  // namespace cohort::runtime

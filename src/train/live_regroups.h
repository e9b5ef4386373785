// The decisions of live recovery (FailureConfig::Recovery::kLive, live_recovery.h) over a group
// of workers, each known by its index in the group as it first started: which worker is lost,
// which survivors are ready to regroup and how far each got, and, once every survivor is ready,
// the new group. Bookkeeping only: whoever runs the processes feeds it what it sees and carries
// out what it decides (signals, replacements, the decision in the store), so that every host of
// the decisions decides alike. The local driver hosts it today.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "cohort/json.h"
#include "cohort/runtime/coordinator.h"

namespace cohort::train {

struct LiveRegroupsOptions {
  int world_size = 1;   // workers of the first group
  int min_workers = 1;  // the fewest a group may have (ScalingConfig::min_workers)
  // How long the survivors have to say they are ready, from the first loss of a round, and a
  // lost worker's place to free itself for a replacement (RunConfig::setup_timeout).
  std::chrono::milliseconds deadline{60'000};
  // Whether lost worker `index`'s place takes a replacement (FailureConfig::replace_lost and
  // its slot); null: always.
  std::function<bool(int index)> replaceable;
  runtime::ClockSource clock = runtime::steady_clock_source();
};

class LiveRegroups {
 public:
  explicit LiveRegroups(LiveRegroupsOptions options);

  // Worker `index`'s rank in the group now; -1 once it is no longer in it (live recovery renumbers
  // the survivors).
  int rank_of(int index) const { return rank_of_.at(static_cast<size_t>(index)); }
  // The workers of the group now that are neither lost nor ended, by index.
  std::vector<int> survivors() const;
  // Whether any worker ended since the start, lost ones included.
  bool any_exited() const;
  // Whether worker `index`'s loop trains a model that can regroup ("live_model"), and has not
  // said it is ready to regroup since.
  bool training(int index) const { return training_.count(index) > 0; }
  // Whether lost worker `index`'s place takes a replacement.
  bool replaceable(int index) const { return !options_.replaceable || options_.replaceable(index); }
  // Live rounds decided so far.
  int rounds() const { return rounds_; }

  // What the workers say and do.
  void on_training(int index);
  void on_ready(int index, int64_t steps, int64_t syncs);
  void on_exited(int index);

  // Worker `index` was lost (killed, or hung and then killed) while the group trains. The
  // others go on without it (`goes_on`) while every other survivor trains or regroups already,
  // none ended, and a replacement or at least min_workers survivors remain; otherwise the group
  // restarts, and `refusal` says why where that is worth a line (too few workers).
  struct Loss {
    bool goes_on = false;
    std::string refusal;
    int left = 0;  // survivors
  };
  Loss lose(int index, const std::string& cause);

  // The new group, once every survivor is ready: the survivors keep their order; a lost
  // worker's place goes to a replacement where its place is free (`place_free`, waited for until
  // the deadline), else the group shrinks. The survivor that got furthest (optimizer steps, then
  // synchronisations) is the source of the state.
  struct Decision {
    int round = 0;
    Json record;                    // "members", "source", "progress", "cause"
    std::vector<int> group;         // the new group's workers by index, in the order of new rank
    std::vector<int> replacements;  // those started anew in a lost worker's place
    int64_t steps = 0;              // the source's optimizer steps
    std::string cause;
  };
  struct Poll {
    std::optional<Decision> decision;
    std::string stop;  // why the group restarts instead
  };
  // Nothing while no regroup is due or a survivor is not ready yet.
  Poll poll(const std::function<bool(int index)>& place_free);
  // "live recovery: 3 workers go on after step 22 (rank(s) 1 replaced, the others in the same
  // processes)", of the decision just made; `replaced_by` follows "replaced" (" by ...").
  std::string describe(const Decision& decision, const std::string& replaced_by = "") const;

 private:
  using SteadyTime = runtime::SteadyTime;
  SteadyTime now() const { return options_.clock(); }

  LiveRegroupsOptions options_;
  std::vector<int> rank_of_;
  std::vector<bool> lost_;
  std::vector<bool> exited_;
  std::set<int> training_;
  std::map<int, std::pair<int64_t, int64_t>> ready_;  // by index: (steps, syncs)
  std::optional<SteadyTime> deadline_;
  std::string cause_;
  int rounds_ = 0;
};

}  // namespace cohort::train

/// \file
/// The coordinator: who of a worker group is alive, who failed first, and which ranks did not enter
/// the collective the others wait in. Kept apart from the collectives (a dead or stopped peer is
/// noticed here, not by a collective that hangs) and the same under every launch mode: the local
/// driver feeds it from its workers' control pipes; under cohort launch, torchrun-style variables,
/// Slurm or mpirun, rank 0 hosts it (CoordinatorServer) and the other ranks reach it over TCP
/// (runtime::connect_to_coordinator); under cohort launch a run that recovers live has its job
/// host keep it, and every rank connects. Time comes from an injectable clock, so its logic is
/// tested without sleeping.
#pragma once
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cohort/comm/job_secret.h"
#include "cohort/json.h"
#include "cohort/limits.h"
#include "cohort/timeouts.h"

namespace cohort::runtime {

/// A point in time of the coordinator's clock.
using SteadyTime = std::chrono::steady_clock::time_point;
/// Where the coordinator reads the time; std::chrono::steady_clock::now unless a test gives its
/// own.
using ClockSource = std::function<SteadyTime()>;
/// The steady clock's now().
ClockSource steady_clock_source();

/// The beat every member sends, and how long a silent one is given.
struct HeartbeatOptions {
  /// How often a member beats.
  std::chrono::milliseconds interval{1'000};
  /// How long a silent member is given (after its first message).
  std::chrono::milliseconds timeout = kDefaultHeartbeatTimeout;
  /// Before its first message a member is starting up (the rendezvous deadline covers that, and
  /// names it more precisely): it gets this much longer, counted from its own start or from the
  /// latest first message of a peer, whichever is later (a peer's rendezvous deadline runs from
  /// that peer's start, which a loaded machine delays).
  std::chrono::milliseconds startup_grace{0};
  /// Throws UsageError naming the value unless interval > 0, timeout > 0 and startup_grace >= 0.
  void validate() const;
};
/// The interval for a timeout: a fifth of it, between 10 ms and 1 s (a member then misses about
/// five beats before it is given up).
std::chrono::milliseconds heartbeat_interval_for(std::chrono::milliseconds timeout);

/// Which of n members went silent: a member is heard from by any message; one that finished is no
/// longer expected to be.
class HeartbeatMonitor {
 public:
  /// A monitor of `members` members, all expected to beat, reading `clock`.
  HeartbeatMonitor(int members, HeartbeatOptions options,
                   ClockSource clock = steady_clock_source());
  /// Any message from `member`: it is alive.
  void heard(int member);
  /// `member` ended cleanly: it is no longer expected to beat.
  void finished(int member);
  /// `member` starts again (a replacement): expected to beat after its start-up grace.
  void restarted(int member);
  /// A member silent too long.
  struct Silence {
    /// Which member.
    int member = -1;
    /// The time it was given.
    std::chrono::milliseconds allowed{};
    /// It had been heard from before.
    bool started = false;
    /// "rank 1 sent no heartbeat for 3 s: it hangs or was stopped" (`who` names the member).
    std::string describe(const std::string& who) const;
  };
  /// The first member silent longer than it is allowed, or nullopt.
  std::optional<Silence> find_silent() const;
  /// Whether every member finished (none is expected to beat any more).
  bool all_finished() const;
  /// The options it was made with.
  const HeartbeatOptions& options() const { return options_; }
  /// The clock's time now.
  SteadyTime now() const { return clock_(); }

 private:
  HeartbeatOptions options_;
  ClockSource clock_;
  // When the latest member sent its first message (the monitor's creation until one does).
  SteadyTime latest_arrival_;
  std::vector<SteadyTime> last_;
  std::vector<bool> heard_;
  std::vector<bool> finished_;
};

/// What a rank's heartbeat carries: every process group of this process (comm::group_activity()),
/// as {"groups": [{"name", "ranks", "entered", "last"}, ...]}.
Json activity_status();

/// Horovod's stall inspector over every process group, sub-groups included: from each rank's
/// latest activity_status() (null when unknown), names per group the members that did not enter
/// the collective its furthest member is in, e.g. "group train: ranks [1] did not enter
/// collective #12 (rank 0 entered 12 (last allreduce), rank 1 entered 11 (last allreduce))".
/// "" when every group is level or nothing is known.
std::string stall_report(const std::vector<Json>& status_by_rank);

/// The coordinator's judgement of a group of ranks, from their messages ("heartbeat" with its
/// status, "error" with "message" and "consequence", anything else counts as a sign of life),
/// their ends and the clock.
class Coordinator {
 public:
  /// A coordinator of `world_size` ranks that expects heartbeats as `options` says.
  Coordinator(int world_size, HeartbeatOptions options, ClockSource clock = steady_clock_source());

  /// A rank's message: {"type": "heartbeat", "status": ...} or {"type": "error", "message":
  /// "...", "consequence": bool}; others are ignored. UsageError naming the field of a message
  /// that is no JSON object or has a field of the wrong type (json_field; nothing is recorded).
  void on_message(int rank, const Json& message);
  /// `rank` ended cleanly: it is no longer expected to beat.
  void on_finished(int rank);
  /// `rank` ended without finishing, `how` says how ("exited with code 1", ...).
  void on_lost(int rank, const std::string& how);
  /// Silent `rank` is being ended by whoever runs it (live recovery: its loss follows): its
  /// silence is no verdict, and it is no longer expected to beat.
  void on_ending_hung(int rank);
  /// The group went on after a failure (live recovery): no verdict so far stands, and `restarted`
  /// (a replacement in a lost rank's place, starting up) is expected to beat again.
  void on_regrouped(const std::vector<int>& restarted);

  /// Why the group must stop.
  struct Verdict {
    int rank = -1;        ///< the rank that caused it
    std::string reason;   ///< one line naming the rank and what happened
    bool silent = false;  ///< the rank sent nothing for too long: it hangs or was stopped
  };
  /// Whether every rank finished or was lost: nobody is expected any more (the run's end, or
  /// nobody left to go on with).
  bool all_finished() const { return monitor_.all_finished(); }
  /// Why the group must stop, naming the rank that caused it, or nullopt. In this order: a rank's
  /// own error; a rank that ended without finishing; a silent rank (with the stall report); a
  /// rank whose collective failed because of a peer, once no cause came within two heartbeat
  /// intervals of it. The first verdict stays.
  std::optional<Verdict> verdict();
  /// Which ranks entered which collectives, from their last heartbeats: what names a hang.
  std::string stall_report() const;
  /// Each rank's last heartbeat status.
  const std::vector<Json>& status() const { return status_; }
  /// The number of ranks.
  int world_size() const { return static_cast<int>(status_.size()); }
  /// The heartbeat options.
  const HeartbeatOptions& options() const { return monitor_.options(); }

 private:
  HeartbeatMonitor monitor_;
  std::vector<Json> status_;
  std::optional<Verdict> cause_;        ///< an error of a rank's own, or a lost rank
  std::optional<Verdict> consequence_;  ///< the first peer-caused error
  SteadyTime consequence_at_{};
  std::optional<Verdict> verdict_;
};

/// How a CoordinatorServer listens: address, ranks, heartbeats and the run's token.
struct CoordinatorServerOptions {
  std::string bind_address = "127.0.0.1";  ///< the address it listens on (port 0: a free one)
  int world_size = 1;                      ///< ranks of the group
  /// Rank 0 runs in the server's process and hands it its messages (deliver). False: every rank
  /// connects, rank 0 too (the job host of cohort launch, a process that holds no rank).
  bool rank0_in_process = true;
  HeartbeatOptions heartbeat;  ///< the beats it sends and expects
  /// A rank that presents another token (another run, or another round of it) is refused.
  std::string token;
  /// Every connection first proves it holds the job's secret (comm/job_secret.h); one that does
  /// not is closed and logged with its address before any line of it is parsed.
  comm::JobSecret secret;
  /// Every well-formed message of a rank (rank 0's own included), under the server's lock, on
  /// the thread that delivers it. It may not call the server back.
  std::function<void(int rank, const Json& message)> on_message;

  /// Live recovery (the host that regroups the ranks: train's rank 0 under cohort launch, or the
  /// job host). Each is called on the server's thread; none may call the server back but
  /// `on_tick`.
  struct LiveHooks {
    /// A rank's connection closed before it finished: true when the others go on without it.
    /// Then there is no verdict, and every other connected rank is told {"type": "peer_lost"}
    /// (runtime::note_peer_lost), so that its collectives stop waiting for the lost one; rank 0,
    /// when in this process, is the hook's to tell.
    std::function<bool(int rank, const std::string& how)> go_on_without;
    /// A rank that connects went silent (a verdict of silence, `reason`): true when the host has
    /// it ended (its connection then closes, and go_on_without decides). Then its silence is no
    /// verdict. Under the server's lock.
    std::function<bool(int rank, const std::string& reason)> end_hung;
    /// After each round of the server's loop (at least once a heartbeat interval, at most a
    /// second apart), without its lock.
    std::function<void()> on_tick;
  };
  LiveHooks live;  ///< none by default: a lost rank is a verdict
};

/// The coordinator under an external launcher, hosted by rank 0 or by cohort launch's job host:
/// listens on `bind_address` (port 0: a free one) for the ranks' connections, one line of JSON per
/// message (as the local driver's control pipes; at most kMaxCoordinatorLine of cohort/limits.h),
/// beats to every rank each interval so they can tell a stopped host, and on a verdict tells every
/// rank to stop with its reason, then calls `on_verdict` (on its thread).
class CoordinatorServer {
 public:
  /// Starts listening; `on_verdict` gets the verdict (on the server's thread).
  CoordinatorServer(CoordinatorServerOptions options,
                    std::function<void(const Coordinator::Verdict&)> on_verdict,
                    ClockSource clock = steady_clock_source());
  ~CoordinatorServer();
  CoordinatorServer(const CoordinatorServer&) = delete;
  CoordinatorServer& operator=(const CoordinatorServer&) = delete;

  /// host:port, for the other ranks.
  std::string address() const;
  /// A message of a rank in this process (rank 0's own heartbeats and errors).
  void deliver(int rank, const std::string& line);
  /// Waits up to `within` for a verdict (e.g. after a collective failed because of a peer, for
  /// the coordinator to name the cause). The verdict, or nullopt.
  std::optional<Coordinator::Verdict> await_verdict(std::chrono::milliseconds within);
  /// The run ended: ranks that leave now are no longer failures.
  void finish();
  /// The host stops the group itself (a rule of the run broken): a verdict of `reason`, naming
  /// no rank, acted on as any (every rank told to stop, then `on_verdict`). Nothing when a
  /// verdict came first.
  void stop(const std::string& reason);
  /// Whether every rank said it finished or was lost without a replacement to come: nobody is
  /// expected any more.
  bool all_finished() const;
  /// Live recovery re-formed the group: no verdict so far stands, and `restarted` (replacements
  /// that connect in lost ranks' places, with their ranks' hello) are expected to beat again.
  void regrouped(const std::vector<int>& restarted);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace cohort::runtime

#pragma once
#include <chrono>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace cohort::runtime {

/// How a WorkerGroup starts its workers: how many, the program, environment, role and logs, and
/// its grace periods.
struct WorkerGroupOptions {
  int num_workers = 1;  ///< workers to start
  /// Program and arguments of every worker; empty means this process's own (re-execution).
  std::string executable;
  std::vector<std::string> argv;  ///< arguments after the program's name
  /// Added to every worker's environment, then `rank_env(rank)` on top.
  std::map<std::string, std::string> env;
  std::function<std::map<std::string, std::string>(int rank)>
      rank_env;  ///< per rank: variables on top of `env`
  /// Per-rank log files (rank-R.log, unabridged) go here when set.
  std::filesystem::path log_dir;
  /// What the children are told they are (COHORT_ROLE), with the control channel on fd 3:
  /// "worker" for a driver's workers, "trial" for a Tuner's trials. Empty for a launcher's
  /// workers, which find their group from the torchrun-style variables instead and have no
  /// control channel. Either way they die with this process.
  std::string role = "worker";
  /// When set, the role of worker `rank` instead (with or without the control channel as `role`).
  std::function<std::string(int rank)> rank_role;
  /// How messages name worker `rank`; default "rank R".
  std::function<std::string(int rank)> rank_name;
  /// When set, the workers for which it is true are not started by start(): restart() starts
  /// them when they are wanted (cohort launch's job host). Until then they count as ended
  /// cleanly.
  std::function<bool(int rank)> started_later;
  /// After a worker failed, how long the others may take to end on their own (told by their
  /// coordinator, which names the cause) before the group is stopped. 0: stopped at once.
  std::chrono::milliseconds failure_grace{0};
  /// Between SIGTERM and SIGKILL when the group is stopped.
  std::chrono::milliseconds stop_grace{3'000};
  /// After one worker finished cleanly, how long the others may still run before they are
  /// considered hung and stopped.
  std::chrono::milliseconds exit_skew_timeout{120'000};
  /// Before the group is stopped because a worker failed or hung, the workers still running are
  /// sent this signal (0: none) and given up to `dump_grace`, or until `dumped` (when set) says
  /// they wrote what they were asked for (their flight recorders), before they are stopped.
  int dump_signal = 0;
  /// How long the workers are given to answer dump_signal.
  std::chrono::milliseconds dump_grace{0};
  /// Whether the workers of these ranks, the ones still running, have answered dump_signal.
  std::function<bool(const std::vector<int>& running)> dumped;
};

/// How a worker ended.
struct WorkerExit {
  int rank = 0;       ///< its rank
  std::string name;   ///< as messages name it ("rank R" unless WorkerGroupOptions::rank_name)
  int pid = 0;        ///< its process id
  int exit_code = 0;  ///< when it exited
  int signal = 0;     ///< when a signal ended it
  bool stopped_by_driver = false;  ///< the group stopped it (after another's failure, or a signal)
  /// The group went on without it (WorkerGroup::tolerate): its end is no failure of the group.
  bool tolerated = false;
  /// Whether it ended cleanly: exit code 0, no signal, not stopped.
  bool ok() const { return signal == 0 && exit_code == 0 && !stopped_by_driver; }
  /// "rank 1 (pid 123) exited with code 1", or how it ended otherwise.
  std::string describe() const;
};

/// How the group ended.
struct GroupOutcome {
  bool success = false;  ///< every worker ended cleanly
  /// SIGINT or SIGTERM received by this process, which then stopped the group.
  int interrupted_by = 0;
  /// A SIGINT asked the workers to stop on their own (accept_stop_requests); they did or not.
  bool stop_requested = false;
  std::vector<WorkerExit> exits;            ///< by rank
  std::optional<WorkerExit> first_failure;  ///< the first worker that failed, when one did
  std::string failure_reason;               ///< one line, when !success
  /// When the group began stopping: the moment its failure was noticed.
  std::chrono::steady_clock::time_point stop_began{};
};

/// What WorkerGroup::wait() calls while it waits.
struct WorkerGroupHandlers {
  /// A complete line a worker printed. Default: printed with a "(rank=R, pid=P) " prefix.
  std::function<void(int rank, int pid, bool is_stderr, const std::string& line)> on_output;
  /// A line the worker sent on its control channel (runtime/control_channel.h).
  std::function<void(int rank, const std::string& message)> on_control;
  /// A worker ended (cleanly or not), before the group reacts to it.
  std::function<void(const WorkerExit& exit)> on_exit;
  /// Called about every 100 ms while waiting.
  std::function<void()> on_tick;
  /// The first SIGINT was passed on to workers that accept stop requests (accept_stop_requests).
  std::function<void()> on_stop_request;
};

/// A group of local worker processes, each a re-execution of this program with its rank in the
/// environment (never a fork of this threaded process). The group is all-or-nothing: when one
/// worker fails the others are stopped. No worker outlives the group: the destructor stops them,
/// and each worker dies with this process (runtime::bind_lifetime_to_driver). A handler may let the
/// group go on without a failed worker (tolerate).
class WorkerGroup {
 public:
  /// A group of `options`; nothing starts before start().
  explicit WorkerGroup(WorkerGroupOptions options);
  ~WorkerGroup();
  WorkerGroup(const WorkerGroup&) = delete;
  WorkerGroup& operator=(const WorkerGroup&) = delete;

  /// Starts the workers.
  void start();
  /// Forwards output and control messages until every worker has exited, one failed (the rest
  /// are then stopped), or this process got SIGINT/SIGTERM.
  GroupOutcome wait(const WorkerGroupHandlers& handlers = {});
  /// One step of wait(), for a caller that runs several groups in one loop (the Tuner's trials):
  /// forwards what arrives within `max_wait`, reacts to exits, and returns the outcome once the
  /// group has ended (then never again). Hold an InterruptScope around the loop, so that Ctrl-C
  /// stops the groups instead of ending this process.
  std::optional<GroupOutcome> poll(const WorkerGroupHandlers& handlers,
                                   std::chrono::milliseconds max_wait);
  /// From a handler inside wait(): ends the group as failed, with this reason. `failure`: a
  /// worker failed or hangs (the workers get dump_signal first), not a plain stop (a restart
  /// with more workers, a driver's error).
  void request_stop(std::string reason, bool failure = false);
  /// From WorkerGroupHandlers::on_exit: the group goes on without worker `rank`, whose failed end
  /// then neither stops the others nor fails the group (live recovery).
  void tolerate(int rank);
  /// Kills worker `rank` and its helpers at once (SIGKILL to its process group): a hung worker
  /// that the others must go on without. Its end reaches on_exit as any other.
  void kill(int rank);
  /// Sends `signal` to worker `rank` alone (not its helpers), when it runs.
  void signal(int rank, int signal);
  /// Starts worker `rank` again after it ended (a replacement), or for the first time when
  /// start() left it (WorkerGroupOptions::started_later), with `env` on top of its environment;
  /// it is running and watched as at start(). RuntimeError when it still runs or cannot be
  /// started.
  void restart(int rank, const std::map<std::string, std::string>& env);
  /// True once the group is being stopped (a failure, a request or a signal).
  bool stopping() const;
  /// From a handler inside wait(): the workers stop on their own when asked (they poll
  /// train::should_stop()). From then on the first SIGINT sends each worker kStopRequestSignal
  /// (control_channel.h) instead of stopping the group, and the group waits for them to end; a
  /// second SIGINT, or a SIGTERM, stops it at once.
  void accept_stop_requests();
  /// SIGTERM, then SIGKILL after stop_grace; reaps every worker.
  void stop();
  /// The workers' process ids, by rank.
  std::vector<int> pids() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// While one is alive, SIGINT and SIGTERM do not end this process: the signal is recorded and
/// every WorkerGroup being polled stops its workers. wait() holds one itself; scopes nest.
class InterruptScope {
 public:
  InterruptScope();
  ~InterruptScope();
  InterruptScope(const InterruptScope&) = delete;
  InterruptScope& operator=(const InterruptScope&) = delete;
  /// SIGINT or SIGTERM once one arrived, else 0.
  static int signal();
};

/// Whether process group `pgid` still has a member. Each worker leads its own group, so after it
/// died this tells whether helpers it started (or the worker itself, stuck in the kernel) remain.
bool process_group_alive(int pgid);

/// The path of this process's executable and its arguments, for re-execution.
std::string self_executable();
/// This process's arguments (argv without the program), for re-execution.
std::vector<std::string> self_arguments();

}  // namespace cohort::runtime

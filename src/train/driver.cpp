#include "train/driver.h"

#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <iostream>
#include <set>
#include <thread>

#include "cohort/comm/store.h"
#include "cohort/error.h"
#include "cohort/runtime/control_channel.h"
#include "cohort/runtime/coordinator.h"
#include "cohort/runtime/environment.h"
#include "cohort/runtime/gpus.h"
#include "cohort/runtime/process.h"
#include "cohort/runtime/worker_group.h"
#include "cohort/runtime/worker_info.h"
#include "cohort/train/dashboard.h"
#include "runtime/worker_spec.h"
#include "train/flight_records.h"
#include "train/live_recovery.h"
#include "train/live_regroups.h"
#include "train/progress.h"
#include "train/run_files.h"
#include "train/run_recorder.h"
#include "train/run_status.h"
#include "train/session_spec.h"
#include "train/snapshots.h"
#include "train/worker_session.h"

namespace cohort::train {
namespace {

using Clock = std::chrono::steady_clock;

// The cause first: a rank killed from outside (its peers then fail in their collectives), else
// the first rank whose own code threw, else the first bad exit. The other failures follow.
std::string describe_failure(const runtime::GroupOutcome& outcome,
                             const std::map<int, std::string>& worker_errors,
                             const std::vector<int>& error_order) {
  std::vector<std::string> causes;
  for (const auto& e : outcome.exits) {
    if (e.signal != 0 && !e.stopped_by_driver && !e.tolerated) causes.push_back(e.describe());
  }
  for (int rank : error_order) {
    causes.push_back("rank " + std::to_string(rank) + " failed: " + worker_errors.at(rank));
  }
  if (causes.empty()) causes.push_back(outcome.failure_reason);
  std::string text = causes.front();
  for (size_t i = 1; i < causes.size(); ++i) text += (i == 1 ? " (then " : "; ") + causes[i];
  return causes.size() > 1 ? text + ")" : text;
}

// Every rank must call report() equally often: a rank that finished with fewer calls than
// another made would leave that one waiting for it.
class ReportCounter {
 public:
  explicit ReportCounter(int world)
      : counts_(static_cast<size_t>(world), 0), finished_(static_cast<size_t>(world), false) {}

  // Returns a reason to stop, or "".
  std::string on_report(int rank, int64_t index) {
    counts_[static_cast<size_t>(rank)] = index;
    for (size_t r = 0; r < counts_.size(); ++r) {
      if (finished_[r] && !lost_[r] && counts_[r] < index)
        return mismatch(static_cast<int>(r), rank, index);
    }
    return "";
  }
  // A live regroup: the loops start their reports again from the first; `lost` report no more.
  void regroup(const std::vector<bool>& lost) {
    std::fill(counts_.begin(), counts_.end(), 0);
    lost_ = lost;
  }
  std::string on_clean_exit(int rank) {
    finished_[static_cast<size_t>(rank)] = true;
    for (size_t r = 0; r < counts_.size(); ++r) {
      if (!lost_[r] && counts_[r] > counts_[static_cast<size_t>(rank)])
        return mismatch(rank, static_cast<int>(r), counts_[r]);
    }
    return "";
  }

 private:
  std::string mismatch(int finished, int other, int64_t index) const {
    return "rank " + std::to_string(finished) + " finished after " +
           std::to_string(counts_[static_cast<size_t>(finished)]) + " report() calls while rank " +
           std::to_string(other) + " made call #" + std::to_string(index) +
           ": every rank must call report() the same number of times";
  }
  std::vector<int64_t> counts_;
  std::vector<bool> finished_;
  std::vector<bool> lost_ = std::vector<bool>(counts_.size(), false);
};

// The local driver: starts the worker group, and starts it again after a failure while the
// FailureConfig allows, each time from the latest valid checkpoint.
class Driver {
 public:
  Driver(const ScalingConfig& scaling, const RunConfig& run, const Json& config)
      : scaling_(scaling), run_(run), config_(config), console_(run.verbose) {}

  Result run();

 private:
  // What one start of the worker group ended with.
  struct Attempt {
    runtime::GroupOutcome outcome;
    std::string error;         // empty on success
    std::string driver_error;  // a rule the run broke: not retried
    int failed_rank = -1;
    Clock::time_point detected;
    // Stopped right after a checkpoint to restart with more workers: not a failure.
    bool grow = false;
  };

  Attempt run_attempt(const std::optional<Checkpoint>& resume_from);
  // Elastic training: the slots that can take a worker now, at most num_workers.
  std::vector<int> free_slots() const;
  // How many workers a group could have now: the running group's and the free slots beyond it,
  // in whole model replicas.
  int workers_available() const;
  // Workers per model replica: with a mesh an elastic group shrinks and grows by whole pipelines
  // and tensor-parallel groups (pp x tp workers); 1 without one.
  int replica_size() const { return scaling_.mesh.pp * scaling_.mesh.tp; }
  // The first of `slots` that make whole replicas.
  std::vector<int> whole_replicas(std::vector<int> slots) const {
    slots.resize(slots.size() / static_cast<size_t>(replica_size()) *
                 static_cast<size_t>(replica_size()));
    return slots;
  }
  // Waits up to the setup deadline for at least the minimum number of free slots; throws
  // RuntimeError naming the busy slots when they do not come.
  std::vector<int> wait_for_slots();
  void record_resize(size_t from, const std::string& reason);
  int min_workers() const {
    return scaling_.min_workers > 0 ? scaling_.min_workers : scaling_.num_workers;
  }
  double since_start() const {
    return std::chrono::duration<double>(Clock::now() - started_).count();
  }

  ScalingConfig scaling_;
  RunConfig run_;
  Json config_;
  Console console_;
  Clock::time_point started_ = Clock::now();
  std::chrono::system_clock::time_point started_wall_ = std::chrono::system_clock::now();
  std::optional<Dashboard> dashboard_;  // RunConfig::dashboard, while the driver runs
  std::optional<RunRecorder> recorder_;
  std::optional<RunStatus> status_;
  comm::Store store_;
  // Elastic training: the slots the current group runs in (rank r in slots_[r]), and the pid of
  // the last worker of every slot (its process group tells whether anything of it is left).
  std::vector<int> slots_;
  // The node's visible GPUs, shared out by slot, and how many each worker gets (0: CPU).
  std::vector<std::string> gpus_;
  int gpus_per_worker_ = 0;
  std::vector<int> slot_pids_;
};

std::vector<int> Driver::free_slots() const {
  std::vector<int> free;
  for (int slot = 0; slot < scaling_.num_workers; ++slot) {
    if (runtime::process_group_alive(slot_pids_[static_cast<size_t>(slot)])) continue;
    if (scaling_.slot_available && !scaling_.slot_available(slot)) continue;
    free.push_back(slot);
  }
  return free;
}

int Driver::workers_available() const {
  std::vector<int> slots = slots_;
  for (int slot : free_slots())
    if (std::find(slots_.begin(), slots_.end(), slot) == slots_.end()) slots.push_back(slot);
  return static_cast<int>(whole_replicas(slots).size());
}

std::vector<int> Driver::wait_for_slots() {
  const auto deadline = Clock::now() + run_.setup_timeout;
  bool told = false;
  while (true) {
    auto free = free_slots();
    if (static_cast<int>(whole_replicas(free).size()) >= min_workers()) return whole_replicas(free);
    if (Clock::now() >= deadline) {
      std::string busy;
      for (int slot = 0; slot < scaling_.num_workers; ++slot) {
        if (std::find(free.begin(), free.end(), slot) == free.end())
          busy += (busy.empty() ? "" : ", ") + std::to_string(slot);
      }
      throw RuntimeError("only " + std::to_string(free.size()) + " of " +
                         std::to_string(scaling_.num_workers) + " worker slots are free (slots [" +
                         busy + "] still busy after " +
                         std::to_string(run_.setup_timeout.count() / 1000) +
                         " s), fewer than the " + std::to_string(min_workers()) +
                         " the group needs: lower ScalingConfig.min_workers or free the slots");
    }
    if (!told && run_.verbose >= 1) {
      console_.message("cohort: waiting for worker slots: " + std::to_string(free.size()) + " of " +
                       std::to_string(min_workers()) + " needed are free");
      told = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

void Driver::record_resize(size_t from, const std::string& reason) {
  if (from == slots_.size()) return;
  recorder_->result().resizes.push_back({{"from", from},
                                         {"to", slots_.size()},
                                         {"reports", recorder_->result().metrics_history.size()},
                                         {"at_s", since_start()},
                                         {"reason", reason}});
  if (run_.verbose >= 1) {
    console_.message("cohort: the group " +
                     std::string(slots_.size() > from ? "grows" : "shrinks") + " from " +
                     std::to_string(from) + " to " + std::to_string(slots_.size()) + " workers (" +
                     reason + ")");
  }
}

Result Driver::run() {
  // Everything the driver creates for the run, the run directory first, takes the run's mask.
  const ScopedUmask umask(run_.umask);
  gpus_ = runtime::visible_gpus();
  gpus_per_worker_ = runtime::check_gpu_request(
      scaling_.use_gpu, scaling_.resources_per_worker.gpus, scaling_.num_workers, gpus_);
  // First: a port in use is refused before the run directory is touched.
  if (run_.dashboard) {
    std::filesystem::create_directories(run_.storage_path);
    dashboard_.emplace(run_.storage_path, *run_.dashboard);
    console_.message("cohort: dashboard at " + dashboard_->url());
  }
  recorder_.emplace(run_, run_.name.empty() ? default_run_name() : run_.name, config_, console_);
  status_.emplace(recorder_->run_dir());
  std::optional<Checkpoint> resume_from = recorder_->resume_point();
  // The job's secret: the one a Tuner (or the user) gave, else a fresh one. The workers get it in
  // their environment; every connection between them proves it holds it.
  store_ = comm::Store::connect(
      {.host = "127.0.0.1",
       .port = 0,
       .is_server = true,
       .timeout = run_.setup_timeout,
       .secret = runtime::job_secret_from_env().value_or(comm::JobSecret::generate())});
  slot_pids_.assign(static_cast<size_t>(scaling_.num_workers), 0);
  slots_ = wait_for_slots();

  const int max_failures = run_.failure_config.max_failures;
  Attempt attempt;
  while (true) {
    attempt = run_attempt(resume_from);
    if (attempt.grow) {
      const size_t from = slots_.size();
      resume_from = recorder_->latest_on_disk();
      slots_ = whole_replicas(free_slots());
      record_resize(from, "worker slots became free");
      continue;
    }
    if (attempt.error.empty() || attempt.outcome.interrupted_by != 0 ||
        attempt.outcome.stop_requested || !attempt.driver_error.empty())
      break;
    const int failures = static_cast<int>(recorder_->result().failures.size()) + 1;
    const bool restart = max_failures == -1 || failures <= max_failures;
    recorder_->result().failures.push_back(
        {{"rank", attempt.failed_rank},
         {"slot", attempt.failed_rank >= 0 ? Json(slots_[static_cast<size_t>(attempt.failed_rank)])
                                           : Json(nullptr)},
         {"cause", attempt.error},
         {"reports", recorder_->result().metrics_history.size()},
         {"detected_at_s", std::chrono::duration<double>(attempt.detected - started_).count()},
         {"restarted", restart},
         {"recovery_s", nullptr}});
    if (!restart) break;
    // From disk, verified: rank 0 may have committed a checkpoint the driver never heard of
    // before the group was stopped.
    resume_from = recorder_->latest_on_disk();
    const size_t from = slots_.size();
    try {
      slots_ = wait_for_slots();
    } catch (const RuntimeError& e) {
      attempt.error += "; no restart: " + std::string(e.what());
      recorder_->result().failures.back()["restarted"] = false;
      break;
    }
    record_resize(from, "after the failure of rank " + std::to_string(attempt.failed_rank));
    if (run_.verbose >= 1) {
      console_.message("cohort: worker group failed (" + attempt.error + "); restart " +
                       std::to_string(failures) +
                       (max_failures == -1 ? "" : " of " + std::to_string(max_failures)) +
                       " from " +
                       (resume_from ? resume_from->path().string()
                                    : std::string("the beginning (no checkpoint yet)")));
    }
  }

  std::optional<std::string> error;
  if (!attempt.error.empty()) {
    const size_t restarts =
        recorder_->result().failures.empty() ? 0 : recorder_->result().failures.size() - 1;
    error = restarts > 0 && attempt.driver_error.empty() && attempt.outcome.interrupted_by == 0
                ? "after " + std::to_string(restarts) + " restart(s): " + attempt.error
                : attempt.error;
  }
  recorder_->result().interrupted =
      attempt.outcome.stop_requested && attempt.outcome.interrupted_by == 0 && !error;
  Result result = recorder_->finish(error, static_cast<int>(slots_.size()), since_start());
  // The run's snapshots on this node (train::snapshot): gone with a run that ended well; a failed
  // one keeps them for a run that resumes it, but not the live rounds' states.
  if (!result.ok()) remove_live_states(recorder_->run_dir());
  if (!run_.snapshot_path.empty()) {
    const auto snapshots = snapshot_run_folder(run_.snapshot_path, recorder_->run_dir());
    if (result.ok()) {
      remove_tree(snapshots);
    } else {
      remove_live_states(snapshots);
      if (!held_snapshots(snapshots).empty() && run_.verbose >= 1) {
        console_.message("cohort: the run's in-memory snapshots stay in " + snapshots.string() +
                         " for a run that resumes it; remove the folder to free the memory");
      }
    }
  }
  status_->write(!result.ok()         ? "failed"
                 : result.interrupted ? "interrupted"
                                      : "finished",
                 result.failures, /*force=*/true);
  if (result.interrupted && run_.verbose >= 1) {
    console_.message("cohort: stopped at your request" +
                     (result.checkpoint ? " after " + result.checkpoint->path().string()
                                        : std::string(" before any checkpoint")) +
                     "; run it again with the same storage path and name to resume");
  }
  if (attempt.outcome.interrupted_by != 0) {
    // Ctrl-C or SIGTERM stops the whole program, as the user asked, now that nothing is left
    // running and the result is on disk.
    std::cout.flush();
    std::signal(attempt.outcome.interrupted_by, SIG_DFL);
    std::raise(attempt.outcome.interrupted_by);
  }
  return result;
}

Driver::Attempt Driver::run_attempt(const std::optional<Checkpoint>& resume_from) {
  const int world = static_cast<int>(slots_.size());
  runtime::WorkerGroupOptions options;
  options.num_workers = world;
  options.log_dir = recorder_->run_dir() / "logs";
  // No rank waits on a finished peer longer than on a collective.
  options.exit_skew_timeout = run_.collective_timeout;
  const std::string threads = std::to_string(scaling_.resources_per_worker.cpu_threads);
  options.env = {{"OMP_NUM_THREADS", threads}, {"MKL_NUM_THREADS", threads}};
  const runtime::HeartbeatOptions heartbeat = heartbeat_options(run_);
  const SessionSpec session{
      .config = config_,
      .name = recorder_->name(),
      .run_dir = recorder_->run_dir().string(),
      .run_start_ns =
          std::chrono::duration_cast<std::chrono::nanoseconds>(started_wall_.time_since_epoch())
              .count(),
      .resume_from = resume_from ? resume_from->path().string() : "",
      .resume = run_.resume,
      .snapshot_path = run_.snapshot_path.string(),
      .live_recovery = run_.failure_config.recovery == FailureConfig::Recovery::kLive,
      .next_checkpoint_index = recorder_->next_checkpoint_index(),
      .tensorboard_histograms = run_.tensorboard.enabled && run_.tensorboard.histograms,
      .profile_first = run_.profile_steps.first,
      .profile_last = run_.profile_steps.last,
      .log_every_steps = run_.log_every_steps,
      .scaling = session_scaling_of(scaling_)};
  runtime::WorkerSpec spec{
      .build = runtime::program_build_id(),
      .driver_pid = ::getpid(),
      // A fresh token per start: nothing of a failed start's store keys or staging is reused.
      .run_token = new_run_token(),
      .cpu_threads = scaling_.resources_per_worker.cpu_threads,
      .setup_timeout = run_.setup_timeout,
      .collective_timeout = run_.collective_timeout,
      .heartbeat = heartbeat,
      .gpus_per_worker = gpus_per_worker_,
      .backend = scaling_.backend,
      .umask = run_.umask,
      .session = to_json(session)};
  // The environment of worker `index` (its slot's) as rank `rank` of `world_size`, with `mine`.
  const int port = store_.port();
  const auto env_of = [port, slots = slots_, gpus = gpus_, per_worker = gpus_per_worker_,
                       secret = store_.secret()](int index, int rank, int world_size,
                                                 runtime::WorkerSpec mine) {
    auto env = runtime::worker_env({.world_rank = rank,
                                    .local_rank = index,
                                    .node_rank = 0,
                                    .world_size = world_size,
                                    .local_world_size = static_cast<int>(slots.size()),
                                    .master_addr = "127.0.0.1",
                                    .master_port = port});
    const int slot = slots[static_cast<size_t>(index)];
    mine.slot = slot;
    env[runtime::kWorkerSpecVar] = runtime::to_text(mine);
    runtime::add_job_secret_env(env, secret);
    if (per_worker > 0) env["CUDA_VISIBLE_DEVICES"] = runtime::gpus_of_slot(gpus, slot, per_worker);
    return env;
  };
  options.rank_env = [env_of, world, spec](int rank) { return env_of(rank, rank, world, spec); };
  // Live recovery (FailureConfig::Recovery::kLive; live_recovery.h, live_regroups.h): who is
  // lost, who is ready, the new group; and each worker's rank in the group now, by its index in
  // the worker group (live recovery renumbers the survivors).
  const bool live = run_.failure_config.recovery == FailureConfig::Recovery::kLive;
  const std::vector<int> first_slots = slots_;
  LiveRegroups regroups(
      {.world_size = world,
       .min_workers = min_workers(),
       .deadline = run_.setup_timeout,
       .replaceable = [this, first_slots](int index) {
         return run_.failure_config.replace_lost &&
                (!scaling_.slot_available ||
                 scaling_.slot_available(first_slots[static_cast<size_t>(index)]));
       }});
  // Before a failure stops the group, the workers still running write their flight recorders
  // (<run>/flight/rank-R.json), which the failure's message then reads.
  const auto attempt_began = std::filesystem::file_time_type::clock::now();
  options.dump_signal = runtime::kFlightDumpSignal;
  options.dump_grace = flight_dump_grace(heartbeat);
  options.dumped = [&regroups, run_dir = recorder_->run_dir(),
                    attempt_began](const std::vector<int>& running) {
    std::vector<int> ranks;
    for (int index : running)
      if (regroups.rank_of(index) >= 0) ranks.push_back(regroups.rank_of(index));
    return flight_records_written(run_dir, ranks, attempt_began);
  };

  runtime::WorkerGroup group(std::move(options));
  Attempt attempt;
  std::map<int, std::string> worker_errors;
  std::vector<int> error_order;
  std::set<int> consequences;
  ReportCounter report_counter(world);
  // Heartbeats and the stall inspector; exits and errors the driver reads from the processes.
  runtime::Coordinator coordinator(world, heartbeat);
  int hung_rank = -1;
  bool trained = false;
  bool stop_asked = false;  // the first Ctrl-C was passed on to the workers
  bool accepts_stop_requests = false;
  auto stop_because = [&](const std::string& reason) {
    if (reason.empty() || !attempt.driver_error.empty()) return;
    attempt.driver_error = reason;
    group.request_stop(reason);
  };

  std::map<int, std::string> killed_as_hung;  // by worker index: the coordinator's verdict
  bool awaiting_recovery = false;  // regrouped: the new rank 0's next step ends the recovery
  // A worker that was killed (or hung, then killed by the driver) while the others train: the
  // group goes on without it when live recovery is on and enough workers remain.
  auto go_on_without = [&](const runtime::WorkerExit& exit) {
    const bool hung = killed_as_hung.count(exit.rank) > 0;
    if (!live || group.stopping() || exit.ok() || (exit.signal == 0 && !hung) ||
        (exit.stopped_by_driver && !hung))
      return;
    const std::string cause = hung ? killed_as_hung.at(exit.rank) : exit.describe();
    const int rank = regroups.rank_of(exit.rank);
    const auto loss = regroups.lose(exit.rank, cause);
    if (!loss.refusal.empty()) console_.message("cohort: " + loss.refusal);
    if (!loss.goes_on) return;
    group.tolerate(exit.rank);
    // Helpers it started go with it: its slot is free for a replacement.
    group.kill(exit.rank);
    // The survivors' collectives stop waiting for it (a transport may never notice it is gone).
    for (int i : regroups.survivors()) group.signal(i, runtime::kPeerLostSignal);
    attempt.detected = Clock::now();
    recorder_->result().failures.push_back({{"rank", rank},
                                            {"slot", first_slots[static_cast<size_t>(exit.rank)]},
                                            {"cause", cause},
                                            {"reports", recorder_->result().metrics_history.size()},
                                            {"detected_at_s", since_start()},
                                            {"restarted", false},
                                            {"live", true},
                                            {"recovery_s", nullptr}});
    if (run_.verbose >= 1)
      console_.message("cohort: " + cause + ": the " + std::to_string(loss.left) +
                       " survivor(s) regroup without restarting (live recovery)");
  };
  // Once every survivor is ready: the new group, published in the store; replacements start in
  // the lost workers' slots.
  auto regroup_if_ready = [&] {
    if (group.stopping()) return;
    auto poll = regroups.poll([&](int index) {
      // Its helpers were killed with it; the slot is free once they are gone.
      return !runtime::process_group_alive(group.pids()[static_cast<size_t>(index)]);
    });
    if (!poll.stop.empty()) group.request_stop(poll.stop);
    if (!poll.decision) return;
    const auto& d = *poll.decision;
    Json record = d.record;
    record["next_checkpoint"] = recorder_->next_checkpoint_index();
    store_.set(live_decision_key(spec.run_token, d.round), record.dump());
    const size_t from = slots_.size();
    slots_.clear();
    for (int i : d.group) slots_.push_back(first_slots[static_cast<size_t>(i)]);
    const int new_world = static_cast<int>(d.group.size());
    for (int i : d.replacements) {
      SessionSpec joining = session;
      joining.live_round = d.round;
      joining.live_source = d.record["source"].get<int>();
      joining.next_checkpoint_index = recorder_->next_checkpoint_index();
      runtime::WorkerSpec replacement = spec;
      replacement.session = to_json(joining);
      group.restart(i, env_of(i, regroups.rank_of(i), new_world, replacement));
      slot_pids_[static_cast<size_t>(first_slots[static_cast<size_t>(i)])] =
          group.pids()[static_cast<size_t>(i)];
      status_->on_restart(i, group.pids()[static_cast<size_t>(i)]);
    }
    coordinator.on_regrouped(d.replacements);
    std::vector<bool> gone(static_cast<size_t>(world));
    for (int i = 0; i < world; ++i) gone[static_cast<size_t>(i)] = regroups.rank_of(i) < 0;
    report_counter.regroup(gone);
    record_resize(from, "live recovery: " + d.cause);
    if (run_.verbose >= 1) console_.message("cohort: " + regroups.describe(d));
    awaiting_recovery = true;
  };

  runtime::WorkerGroupHandlers handlers;
  handlers.on_output = [&](int rank, int pid, bool is_stderr, const std::string& line) {
    if (run_.verbose >= 1 || is_stderr) console_.worker_line(rank, pid, is_stderr, line);
  };
  handlers.on_exit = [&](const runtime::WorkerExit& exit) {
    regroups.on_exited(exit.rank);
    status_->on_exit(exit.rank, exit.ok());
    coordinator.on_finished(exit.rank);
    if (exit.ok()) stop_because(report_counter.on_clean_exit(exit.rank));
    go_on_without(exit);
  };
  handlers.on_tick = [&] {
    console_.tick();
    status_->write("running", recorder_->result().failures);
    if (group.stopping()) return;  // a failure is already being handled
    regroup_if_ready();
    if (const auto verdict = coordinator.verdict()) {
      if (killed_as_hung.count(verdict->rank) > 0) return;
      if (live && regroups.training(verdict->rank) &&
          (regroups.replaceable(verdict->rank) ||
           static_cast<int>(regroups.survivors().size()) > min_workers())) {
        // The others go on without it: killed, its connections close and their collectives fail.
        killed_as_hung[verdict->rank] = verdict->reason;
        group.kill(verdict->rank);
        return;
      }
      hung_rank = verdict->rank;
      attempt.detected = Clock::now();
      group.request_stop(verdict->reason, /*failure=*/true);
    }
  };
  handlers.on_stop_request = [&] {
    stop_asked = true;
    console_.message(
        "cohort: stopping after the next checkpoint (Ctrl-C again stops the workers at once)");
  };
  handlers.on_control = [&](int index, const std::string& line) {
    Json message;
    std::string type;
    // Its rank in the group now (live recovery renumbers the survivors).
    const int rank = regroups.rank_of(index);
    try {
      message = Json::parse(line);
      type = json_field<std::string>(message, "type", "");
      // Errors are the driver's to order (it sees the processes' exits too): the coordinator
      // takes the signs of life.
      coordinator.on_message(index, type == "error" ? Json{{"type", "alive"}} : message);
    } catch (const std::exception& e) {
      console_.message("cohort: ignoring a malformed control message from rank " +
                       std::to_string(rank) + ": " + e.what());
      return;
    }
    if (type == "heartbeat") return;
    if (type == "regroup_ready") {
      regroups.on_ready(index, json_field<int64_t>(message, "steps", 0),
                        json_field<int64_t>(message, "syncs", 0));
      return;
    }
    if (type == "live_model") {
      regroups.on_training(index);
      return;
    }
    if (awaiting_recovery && rank == 0 && (type == "progress" || type == "step")) {
      awaiting_recovery = false;
      status_->on_training();  // the replacements train too
      auto& failure = recorder_->result().failures.back();
      failure["recovery_s"] = since_start() - failure["detected_at_s"].get<double>();
      if (run_.verbose >= 1) {
        console_.message("cohort: live recovery: training again " +
                         std::to_string(failure["recovery_s"].get<double>()) +
                         " s after the failure was detected");
      }
    }
    if (type == "restored") {  // before training: what the group restores from
      if (rank == 0) recorder_->on_restored(message);
      return;
    }
    if (rank == 0 && !trained) {
      trained = true;
      status_->on_training();
      // The group trains again: the previous failure is recovered.
      if (!recorder_->result().failures.empty() &&
          recorder_->result().failures.back()["recovery_s"].is_null()) {
        recorder_->result().failures.back()["recovery_s"] =
            since_start() - recorder_->result().failures.back()["detected_at_s"].get<double>();
      }
    }
    if (type == "report_begin") {
      stop_because(report_counter.on_report(index, message.value("index", int64_t{0})));
    } else if ((type == "report" || type == "checkpoint") && rank == 0) {
      std::string broken;
      if (type == "report") {
        recorder_->on_report(message, broken);
        status_->on_report(message);
        stop_because(broken);
      } else {
        recorder_->on_checkpoint(message);  // committed behind the loop (SaveOptions::async)
      }
      // Elastic: a checkpoint was just committed, so a restart with more workers loses nothing.
      // Not once a rank finished: the loop is over, and a restart would only run an empty one.
      if (broken.empty() && message.contains("checkpoint") &&
          static_cast<int>(slots_.size()) < scaling_.num_workers && !group.stopping() &&
          !stop_asked && !regroups.any_exited() &&
          workers_available() > static_cast<int>(slots_.size())) {
        attempt.grow = true;
        group.request_stop("worker slots are free again: restarting the group with more workers");
      }
    } else if (type == "accepts_stop_requests") {
      if (!accepts_stop_requests && run_.verbose >= 1) {
        console_.message("cohort: Ctrl-C stops the run after its next checkpoint; twice, at once");
      }
      accepts_stop_requests = true;
      group.accept_stop_requests();
    } else if (type == "step" && rank == 0) {
      recorder_->on_step(message);
    } else if (type == "progress") {
      console_.progress(message["progress"]);
      status_->on_progress(message["progress"]);
    } else if (type == "error") {
      if (!worker_errors.count(index)) {
        error_order.push_back(index);
        if (message.value("consequence", false)) consequences.insert(index);
      }
      worker_errors[index] = message.value("message", std::string{"unknown error"});
    }
  };

  group.start();
  std::vector<std::string> devices;
  for (int rank = 0; rank < world; ++rank) {
    const int slot = slots_[static_cast<size_t>(rank)];
    slot_pids_[static_cast<size_t>(slot)] = group.pids()[static_cast<size_t>(rank)];
    devices.push_back(gpus_per_worker_ > 0
                          ? "cuda (GPU " + runtime::gpus_of_slot(gpus_, slot, gpus_per_worker_) +
                                ")"
                          : "cpu");
  }
  status_->on_group_start(group.pids(), devices);
  status_->write("running", recorder_->result().failures, /*force=*/true);
  if (run_.verbose >= 1) {
    std::string pids;
    for (int pid : group.pids()) pids += (pids.empty() ? "" : " ") + std::to_string(pid);
    console_.message("cohort: started " + std::to_string(world) + " worker(s) [pids " + pids +
                     "], run directory " + recorder_->run_dir().string());
  }
  attempt.outcome = group.wait(handlers);
  console_.tick(/*flush_all=*/true);
  if (attempt.detected == Clock::time_point{}) {
    attempt.detected = attempt.outcome.stop_began != Clock::time_point{}
                           ? attempt.outcome.stop_began
                           : Clock::now();
  }
  const std::string stall = coordinator.stall_report();
  if (!attempt.driver_error.empty()) {
    attempt.error = attempt.driver_error;
  } else if (hung_rank >= 0) {
    attempt.error = attempt.outcome.failure_reason;
    attempt.failed_rank = hung_rank;
  } else if (!attempt.outcome.success) {
    std::stable_partition(error_order.begin(), error_order.end(),
                          [&](int r) { return !consequences.count(r); });
    attempt.error = describe_failure(attempt.outcome, worker_errors, error_order);
    // The rank blamed is the first cause the error names: a rank killed by a signal, else the
    // first whose error is not a consequence of another's failure (a peer's closed connection,
    // reported before the kill was seen, must not take the blame).
    attempt.failed_rank = attempt.outcome.first_failure ? attempt.outcome.first_failure->rank : -1;
    if (!error_order.empty() && !consequences.count(error_order.front()))
      attempt.failed_rank = error_order.front();
    for (const auto& e : attempt.outcome.exits) {
      if (e.signal != 0 && !e.stopped_by_driver && !e.tolerated) {
        attempt.failed_rank = e.rank;
        break;
      }
    }
    if (!consequences.empty() && !stall.empty()) attempt.error += "; " + stall;
  }
  if (!attempt.outcome.success && !attempt.error.empty()) {
    const std::string flights = flight_report(recorder_->run_dir(), world, attempt_began);
    if (!flights.empty()) attempt.error += "; " + flights;
  }
  return attempt;
}

}  // namespace

runtime::HeartbeatOptions heartbeat_options(const RunConfig& run) {
  runtime::HeartbeatOptions heartbeat{
      .interval = runtime::heartbeat_interval_for(run.failure_config.heartbeat_timeout),
      .timeout = run.failure_config.heartbeat_timeout,
      // Before its first heartbeat a rank is still starting up, which the rendezvous deadline
      // covers (and names more precisely): it gets that much longer.
      .startup_grace = run.setup_timeout};
  heartbeat.validate();
  return heartbeat;
}

Result run_driver(const ScalingConfig& scaling, const RunConfig& run, const Json& config) {
  return Driver(scaling, run, config).run();
}

}  // namespace cohort::train

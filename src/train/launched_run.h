// The bookkeeping of a run under a launcher, what the local driver keeps without its processes:
// the run directory (RunRecorder), the coordinator the ranks talk to (runtime::CoordinatorServer)
// and, with live recovery, its decisions (LaunchedRegroups). Rank 0 hosts it in its own process;
// under cohort launch a run that recovers live has the job host keep it instead (job_host.cpp: a
// process of the program on node 0 that holds no rank), so that rank 0 is lost and replaced like
// any other rank.
#pragma once
#include <chrono>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "cohort/comm/store.h"
#include "cohort/json.h"
#include "cohort/runtime/coordinator.h"
#include "cohort/runtime/worker_info.h"
#include "cohort/train/config.h"
#include "cohort/train/result.h"
#include "train/launched_regroups.h"
#include "train/progress.h"
#include "train/run_recorder.h"

namespace cohort::train {

// What a process publishes about its program at the rendezvous: its build and host (ranks built
// from different sources must not train together).
std::string program_identity();
// Throws naming `who` when the identity it published (program_identity) is of another build than
// rank 0's.
void check_same_program(const std::string& who, const std::string& identity,
                        const std::string& rank0_identity);
// One write to stderr: a launcher's own lines (mpirun's) must not land inside it.
void say_at_once(const std::string& line);
// The store of the job a process of cohort launch that holds no rank belongs to (a data worker,
// the job host: `who`), joined with the job secret of its environment.
comm::Store join_launched_job(const runtime::LaunchedJobInfo& job, const std::string& who,
                              std::chrono::milliseconds timeout);

struct LaunchedRunOptions {
  int world_size = 1;     // the ranks the launcher started
  int restart_round = 0;  // the launcher's round (COHORT_RESTART_ROUND)
  std::string job_id;
  std::string launcher;  // who started the ranks, as messages name it
  comm::Store store;     // the job's store
  // Where the coordinator listens: an address of this host that every rank reaches.
  std::string bind_address = "127.0.0.1";
  // Rank 0 keeps the run in its own process; false: the job host does (every rank connects).
  bool rank0_in_process = true;
  int min_workers = 1;  // the fewest ranks a live regroup goes on with
  std::chrono::steady_clock::time_point started = std::chrono::steady_clock::now();
  // The coordinator's verdict, on its thread (the job is being stopped).
  std::function<void(const runtime::Coordinator::Verdict&)> on_verdict;
  // Every message of a rank that connects, with its rank in the group now (live recovery
  // renumbers the survivors), on the coordinator's thread under its lock: it may not call the
  // coordinator back.
  std::function<void(int rank, const Json& message)> on_message;
};

class LaunchedRun {
 public:
  // Opens the run directory, the coordinator and, when `run` recovers live (only with the job
  // host), its decisions.
  LaunchedRun(const RunConfig& run, const Json& config, LaunchedRunOptions options);
  LaunchedRun(const LaunchedRun&) = delete;
  LaunchedRun& operator=(const LaunchedRun&) = delete;

  // Tells the ranks where the run and its coordinator are (the store's "job/<round>/run") and,
  // with live recovery, the launchers that the job goes on after a lost rank.
  void publish();
  // A message of rank 0 of the group now (the others' are the coordinator's alone): its reports,
  // checkpoints, restores, steps and progress go into the run's files and console. Returns what
  // broke a rule of the run ("" when nothing did).
  std::string record(const Json& message);
  // Whether record() takes `message` (heartbeats and the decisions' messages it leaves alone).
  static bool records(const Json& message);
  // Ends the run, once: its failures and result.json. nullopt when it had ended already (the
  // other of two threads that may end it).
  std::optional<Result> finish(const std::optional<std::string>& error, int world_size);
  // Ends the run after the coordinator's verdict, once: every rank was told to stop and writes
  // its flight recorder, which the error then names.
  std::optional<Result> finish_after(const runtime::Coordinator::Verdict& verdict);

  runtime::CoordinatorServer& coordinator() { return *coordinator_; }
  // The ranks of the group now: the launcher's, less those live recovery went on without.
  int world_size();
  const std::filesystem::path& run_dir() const { return recorder_->run_dir(); }
  Console& console() { return console_; }

 private:
  // Under bookkeeping_, by the thread that ended the run.
  Result write_result(const std::optional<std::string>& error, int world_size);

  const RunConfig& run_;
  LaunchedRunOptions options_;
  const std::filesystem::file_time_type began_on_disk_;
  const std::chrono::system_clock::time_point started_wall_;
  const runtime::HeartbeatOptions heartbeat_;
  Console console_;
  // The recorder is written by whoever records rank 0's messages and, when the coordinator stops
  // the job, by the thread that takes the verdict: whichever comes first ends the run.
  std::mutex bookkeeping_;
  bool finished_ = false;
  std::optional<RunRecorder> recorder_;
  std::optional<Checkpoint> resume_from_;
  std::string token_;
  // Declared before the coordinator, which feeds them: they outlive it.
  std::optional<LaunchedRegroups> regroups_;
  std::unique_ptr<runtime::CoordinatorServer> coordinator_;
};

}  // namespace cohort::train

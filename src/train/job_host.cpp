// cohort launch's job host (runtime::kJobHostRole): a process of the program on node 0 that holds
// no rank. Under cohort launch a run that recovers live keeps its bookkeeping here instead of in
// rank 0 (LaunchedRun: the run directory, the coordinator every rank connects to, live recovery's
// decisions), so that rank 0 is lost and replaced like any other rank. Node 0's launcher starts it
// at rank 0's word (runtime::launch_host_key); it returns the run's Result from fit(), as the
// local driver does, once every rank finished or after the coordinator's verdict.
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>

#include "cohort/error.h"
#include "cohort/runtime/worker_info.h"
#include "train/driver.h"
#include "train/launched_run.h"
#include "train/run_files.h"

namespace cohort::train {

bool job_host_keeps_run(const RunConfig& run, const runtime::WorkerInfo& launch) {
  return run.failure_config.recovery == FailureConfig::Recovery::kLive &&
         launch.launcher == "cohort-launch";
}

Result host_launched_run(const ScalingConfig& scaling, const RunConfig& run, const Json& config) {
  const auto started = std::chrono::steady_clock::now();
  const auto job = runtime::job_host_from_env();
  if (run.failure_config.recovery != FailureConfig::Recovery::kLive) {
    throw UsageError(
        "the job host (" + std::string(runtime::kRoleVar) + "=" + runtime::kJobHostRole +
        ") keeps a run that recovers live (FailureConfig.recovery, --recovery live), and this "
        "program's Trainer does not: cohort launch starts one only when rank 0 asks for it");
  }
  // As each rank checks it (run_launched): the launcher's ranks are as many as the Trainer's.
  const int fewest = scaling.min_workers > 0 ? scaling.min_workers : scaling.num_workers;
  if (job.train_ranks > scaling.num_workers || job.train_ranks < fewest) {
    throw UsageError("ScalingConfig.num_workers=" + std::to_string(scaling.num_workers) +
                     (scaling.min_workers > 0
                          ? " (min_workers=" + std::to_string(scaling.min_workers) + ")"
                          : std::string()) +
                     " but cohort launch started " + std::to_string(job.train_ranks) +
                     " ranks (the job host's " + runtime::kTrainRanksVar +
                     "): make them agree (--nnodes x --nproc-per-node)");
  }
  // Everything of the run takes its mask while it lasts.
  const ScopedUmask umask(run.umask);
  auto store = join_launched_job(job, "the job host", run.setup_timeout);
  const std::string round = "job/" + std::to_string(job.restart_round) + "/";
  // The same program as the ranks, or a clear refusal (as between ranks).
  check_same_program("the job host", program_identity(), store.get(round + "binary/0"));

  // What the coordinator's thread hands this one: rank 0's messages for the run's files, and the
  // verdict. The files are written here, not on that thread, which must keep beating.
  std::mutex mutex;
  std::condition_variable arrived;
  std::deque<Json> inbox;
  std::optional<runtime::Coordinator::Verdict> verdict;
  LaunchedRun host(run, config,
                   {.world_size = job.train_ranks,
                    .restart_round = job.restart_round,
                    .job_id = job.job_id,
                    .launcher = "cohort launch",
                    .store = store,
                    .bind_address = runtime::data_plane_address(job.master_addr),
                    .rank0_in_process = false,
                    .min_workers = fewest,
                    .started = started,
                    .on_verdict =
                        [&](const runtime::Coordinator::Verdict& v) {
                          {
                            std::lock_guard lock(mutex);
                            verdict = v;
                          }
                          arrived.notify_all();
                        },
                    .on_message =
                        [&](int rank, const Json& message) {
                          if (rank != 0 || !LaunchedRun::records(message)) return;
                          {
                            std::lock_guard lock(mutex);
                            inbox.push_back(message);
                          }
                          arrived.notify_all();
                        }});
  host.publish();
  const auto interval = heartbeat_options(run).interval;
  while (true) {
    // Looked at before the messages are taken: a rank's last messages arrive before its bye.
    const bool ended = host.coordinator().all_finished();
    std::deque<Json> taken;
    std::optional<runtime::Coordinator::Verdict> judged;
    {
      std::unique_lock lock(mutex);
      if (!ended) arrived.wait_for(lock, interval, [&] { return !inbox.empty() || verdict; });
      taken.swap(inbox);
      judged = verdict;
    }
    for (const auto& message : taken) {
      if (const auto broken = host.record(message); !broken.empty())
        host.coordinator().stop(broken);
    }
    // Only this thread ends the run: each returns a result.
    if (judged) return host.finish_after(*judged).value();
    if (ended) return host.finish(std::nullopt, host.world_size()).value();
  }
}

}  // namespace cohort::train

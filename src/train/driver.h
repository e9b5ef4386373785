// The driver side of Trainer::fit: starts the worker group, collects reports, writes the run
// directory, returns the Result.
#pragma once
#include <map>

#include "cohort/data/dataset.h"
#include "cohort/json.h"
#include "cohort/runtime/coordinator.h"
#include "cohort/runtime/worker_info.h"
#include "cohort/train/config.h"
#include "cohort/train/result.h"

namespace cohort::train {

Result run_driver(const ScalingConfig& scaling, const RunConfig& run, const Json& config);

// The heartbeats of a run, under the driver and under launchers alike: an interval for
// FailureConfig::heartbeat_timeout, and start-up given the rendezvous deadline too.
runtime::HeartbeatOptions heartbeat_options(const RunConfig& run);

// Under an external launcher (runtime::detect_launch): this process is one rank; rank 0 also
// keeps the run directory and returns the Result (unless cohort launch's job host keeps them:
// then every rank ends its process).
Result run_launched(const std::function<void(const Json&)>& train_loop,
                    const ScalingConfig& scaling, const RunConfig& run, const Json& config,
                    const std::map<std::string, data::Dataset>& datasets, runtime::WorkerInfo info);

// Whether cohort launch's job host keeps a launched run (one that recovers live under cohort
// launch) instead of its rank 0.
bool job_host_keeps_run(const RunConfig& run, const runtime::WorkerInfo& launch);

// cohort launch's job host (runtime::kJobHostRole, job_host.cpp): keeps the run of every rank
// that recovers live, and returns its Result once they finished or the coordinator stopped them.
Result host_launched_run(const ScalingConfig& scaling, const RunConfig& run, const Json& config);

// The worker side: joins the group, runs the loop, ends the process.
[[noreturn]] void run_worker(const std::function<void(const Json&)>& train_loop,
                             const ScalingConfig& scaling,
                             const std::map<std::string, data::Dataset>& datasets);

// In a preprocessing worker a rank started: serves that rank's shard of the dataset named by
// COHORT_DATA_DATASET, then ends the process (never returns).
[[noreturn]] void serve_dataset_shard(const std::map<std::string, data::Dataset>& datasets);

}  // namespace cohort::train

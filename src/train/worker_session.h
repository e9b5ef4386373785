// The state of a running worker: its context, its prepared models, its report count.
#pragma once
#include <memory>
#include <vector>

#include "cohort/parallel/distributed_data_parallel.h"
#include "cohort/train/context.h"

namespace cohort::train {

struct WorkerSession {
  TrainContext context;
  std::vector<std::unique_ptr<parallel::DistributedDataParallel>> models;
  int64_t reports = 0;
};

// The session of this process; nullptr outside a train loop.
WorkerSession* current_session();
void set_current_session(std::unique_ptr<WorkerSession> session);

// Environment variables by which the driver describes the run to its workers.
inline constexpr const char* kConfigVar = "COHORT_TRAIN_LOOP_CONFIG";
inline constexpr const char* kNameVar = "COHORT_EXPERIMENT_NAME";
inline constexpr const char* kRunDirVar = "COHORT_RUN_DIR";
inline constexpr const char* kRunStartVar = "COHORT_RUN_START_NS";
inline constexpr const char* kThreadsVar = "COHORT_CPU_THREADS";
inline constexpr const char* kSetupTimeoutVar = "COHORT_SETUP_TIMEOUT_MS";
inline constexpr const char* kCollectiveTimeoutVar = "COHORT_COLLECTIVE_TIMEOUT_MS";
inline constexpr const char* kUseGpuVar = "COHORT_USE_GPU";

}  // namespace cohort::train

// What the local driver hands each worker it starts: one serialized spec in one variable
// (COHORT_WORKER_SPEC), read and checked in one place, instead of a variable per setting.
#pragma once
#include <chrono>
#include <cstdint>
#include <string>

#include "cohort/json.h"
#include "cohort/optim/precision.h"
#include "cohort/parallel/mesh_shape.h"
#include "cohort/runtime/coordinator.h"
#include "cohort/timeouts.h"
#include "cohort/train/config.h"

namespace cohort::train {

// What a worker's session takes from the run's ScalingConfig besides the worker count: under the
// local driver the driver's (in the spec), not that of the first Trainer the worker's re-executed
// program constructs (a program may fit one loop several times with other meshes or precisions);
// under a launcher the program's own (every rank runs the same).
struct SessionScaling {
  parallel::MeshShape mesh;        // ScalingConfig::mesh (pp, tp)
  std::string precision = "fp32";  // ScalingConfig::precision
  optim::LossScalerOptions loss_scaler;
  int num_parameter_servers = 0;
  std::string remote_preprocessing_dataset;
};
SessionScaling session_scaling_of(const ScalingConfig& scaling);

struct WorkerSpec {
  // The program that wrote it (runtime::program_build_id()) and the driver's pid: a spec left in
  // the environment by another build or another run is refused.
  std::string build;
  int driver_pid = 0;
  // Unique to this start of the group: nothing of an earlier start's store keys or staging
  // folders is mistaken for this one's.
  std::string run_token;
  Json config = Json::object();  // the train loop's
  std::string name;
  std::string run_dir;
  int64_t run_start_ns = 0;
  int cpu_threads = 1;
  std::chrono::milliseconds setup_timeout = kDefaultSetupTimeout;
  std::chrono::milliseconds collective_timeout = kDefaultCollectiveTimeout;
  runtime::HeartbeatOptions heartbeat;
  int gpus_per_worker = 0;  // 0: CPU training
  std::string backend = "auto";
  std::string resume_from;     // a checkpoint folder, or empty
  bool resume = true;          // RunConfig::resume: a newer snapshot may be restored from instead
  std::string snapshot_path;   // RunConfig::snapshot_path
  bool live_recovery = false;  // FailureConfig::recovery is kLive
  // A replacement started by a live regroup: the round it joins (0: a worker of the group's
  // start), and the rank whose state it takes.
  int live_round = 0;
  int live_source = 0;
  int64_t next_checkpoint_index = 0;
  int slot = 0;                         // the worker slot (ScalingConfig) the rank runs in
  bool tensorboard_histograms = false;  // RunConfig::tensorboard.histograms
  int64_t profile_first = 0;            // RunConfig::profile_steps
  int64_t profile_last = 0;
  int64_t log_every_steps = 0;  // RunConfig::log_every_steps
  int umask = 077;              // RunConfig::umask: the worker process creates its files with it
  SessionScaling scaling;       // the driver's ScalingConfig
};

std::string to_text(const WorkerSpec& spec);
// Parses and checks a spec: a UsageError of one line naming the field and its value when it is
// malformed, of another build, or of another driver than this process's parent.
WorkerSpec worker_spec_from_text(const std::string& text);
// This worker's spec, from its environment; a UsageError when there is none.
WorkerSpec worker_spec_from_env();

}  // namespace cohort::train

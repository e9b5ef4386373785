// What the local driver hands each worker's session (the train loop's settings), inside the
// worker spec that runtime/worker_spec.h reads and checks: the driver's run, resume and scaling
// settings rather than those of the first Trainer the worker's re-executed program constructs.
#pragma once
#include <cstdint>
#include <string>

#include "cohort/json.h"
#include "cohort/optim/precision.h"
#include "cohort/parallel/mesh_shape.h"
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

struct SessionSpec {
  Json config = Json::object();  // the train loop's
  std::string name;
  std::string run_dir;
  int64_t run_start_ns = 0;
  std::string resume_from;     // a checkpoint folder, or empty
  bool resume = true;          // RunConfig::resume: a newer snapshot may be restored from instead
  std::string snapshot_path;   // RunConfig::snapshot_path
  bool live_recovery = false;  // FailureConfig::recovery is kLive
  // A replacement started by a live regroup: the round it joins (0: a worker of the group's
  // start), and the rank whose state it takes.
  int live_round = 0;
  int live_source = 0;
  int64_t next_checkpoint_index = 0;
  bool tensorboard_histograms = false;  // RunConfig::tensorboard.histograms
  int64_t profile_first = 0;            // RunConfig::profile_steps
  int64_t profile_last = 0;
  int64_t log_every_steps = 0;  // RunConfig::log_every_steps
  SessionScaling scaling;       // the driver's ScalingConfig
};

Json to_json(const SessionSpec& spec);
// Reads and checks the session's part of a worker spec: a UsageError of one line naming the field
// and its value when it is malformed.
SessionSpec session_spec_from_json(const Json& session);

}  // namespace cohort::train

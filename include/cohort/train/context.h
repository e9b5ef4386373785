#pragma once
#include <chrono>
#include <filesystem>
#include <string>

#include <c10/core/Device.h>

#include "cohort/comm/process_group.h"
#include "cohort/optim/precision.h"
#include "cohort/parallel/mesh.h"

namespace cohort::train {

/// Who this worker is and what it can use (Ray Train's TrainContext).
class TrainContext {
 public:
  int get_world_rank() const { return world_rank; }
  int get_local_rank() const { return local_rank; }
  int get_node_rank() const { return node_rank; }
  int get_world_size() const { return world_size; }
  int get_local_world_size() const { return local_world_size; }
  const std::string& get_experiment_name() const { return experiment_name; }
  /// The run directory, `<storage_path>/<name>`.
  const std::filesystem::path& get_storage_path() const { return storage_path; }
  c10::Device get_device() const { return device; }
  /// ScalingConfig::precision.
  optim::Precision get_precision() const { return precision; }
  /// The group of all workers, for the user's own collectives (e.g. summing evaluation counts).
  comm::ProcessGroup& get_process_group() { return process_group; }
  /// Whether ScalingConfig::mesh asked for pipeline or tensor parallelism (pp or tp > 1).
  bool has_mesh() const { return mesh.world().valid(); }
  /// The mesh of ScalingConfig::mesh: this rank's coordinates and its dp, pp and tp groups.
  /// Throws UsageError when the run has none (has_mesh() false).
  const parallel::DeviceMesh& get_mesh() const;
  /// When the driver started the run: for start-up timings.
  std::chrono::system_clock::time_point get_run_start_time() const { return run_start; }

  int world_rank = 0;
  int local_rank = 0;
  int node_rank = 0;
  int world_size = 1;
  int local_world_size = 1;
  std::string experiment_name;
  std::filesystem::path storage_path;
  c10::Device device = c10::Device(c10::DeviceType::CPU);
  optim::Precision precision = optim::Precision::kFp32;
  comm::ProcessGroup process_group;
  parallel::DeviceMesh mesh;
  std::chrono::system_clock::time_point run_start;
};

/// The context of the running worker. Throws RuntimeError outside a train loop.
TrainContext& get_context();

}  // namespace cohort::train

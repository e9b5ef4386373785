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
  /// This worker's rank among all workers, from 0.
  int get_world_rank() const { return world_rank; }
  /// Its rank among the workers of its host.
  int get_local_rank() const { return local_rank; }
  /// Its host's rank among the job's hosts.
  int get_node_rank() const { return node_rank; }
  /// The number of workers.
  int get_world_size() const { return world_size; }
  /// The number of workers on this worker's host.
  int get_local_world_size() const { return local_world_size; }
  /// RunConfig::name: the run's name.
  const std::string& get_experiment_name() const { return experiment_name; }
  /// The run directory, `<storage_path>/<name>`.
  const std::filesystem::path& get_storage_path() const { return storage_path; }
  /// The device the worker trains on: cuda:0 (its own GPU) or the CPU.
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

  // The values the getters return, set by the worker's session before the loop starts.
  int world_rank = 0;                                      ///< get_world_rank()
  int local_rank = 0;                                      ///< get_local_rank()
  int node_rank = 0;                                       ///< get_node_rank()
  int world_size = 1;                                      ///< get_world_size()
  int local_world_size = 1;                                ///< get_local_world_size()
  std::string experiment_name;                             ///< get_experiment_name()
  std::filesystem::path storage_path;                      ///< get_storage_path()
  c10::Device device = c10::Device(c10::DeviceType::CPU);  ///< get_device()
  optim::Precision precision = optim::Precision::kFp32;    ///< get_precision()
  comm::ProcessGroup process_group;                        ///< get_process_group()
  parallel::DeviceMesh mesh;                               ///< get_mesh()
  std::chrono::system_clock::time_point run_start;         ///< get_run_start_time()
};

/// The context of the running worker. Throws RuntimeError outside a train loop (and on another
/// thread than the loop's).
TrainContext& get_context();

}  // namespace cohort::train

#pragma once
#include <map>
#include <optional>
#include <string>

namespace cohort::runtime {

// Who this process is in its worker group, in torchrun's terms.
struct WorkerInfo {
  int world_rank = 0;
  int local_rank = 0;
  int node_rank = 0;
  int world_size = 1;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
};

// Environment variable names (torchrun's, plus cohort's own for the local spawner).
inline constexpr const char* kRoleVar = "COHORT_ROLE";
inline constexpr const char* kWorkerRole = "worker";
inline constexpr const char* kDriverPidVar = "COHORT_DRIVER_PID";
inline constexpr const char* kControlFdVar = "COHORT_CONTROL_FD";

// Reads RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK (or GROUP_RANK), MASTER_ADDR,
// MASTER_PORT. Returns nullopt when RANK and WORLD_SIZE are both unset; throws UsageError naming
// the variable when they are inconsistent.
std::optional<WorkerInfo> worker_info_from_env();

// The variables that describe `info` to a child process.
std::map<std::string, std::string> worker_env(const WorkerInfo& info);

// True in a process that the local worker group started in the worker role.
bool is_spawned_worker();

// In a spawned worker: die with the driver even if it is SIGKILLed, so no worker is orphaned.
void bind_lifetime_to_driver();

}  // namespace cohort::runtime

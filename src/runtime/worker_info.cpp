#include "cohort/runtime/worker_info.h"

#include <sys/prctl.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>

#include "cohort/error.h"

namespace cohort::runtime {
namespace {

std::optional<std::string> env(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return std::nullopt;
  return std::string(value);
}

int env_int(const char* name, int fallback, int min_value) {
  auto value = env(name);
  if (!value) return fallback;
  int parsed = 0;
  try {
    size_t used = 0;
    parsed = std::stoi(*value, &used);
    if (used != value->size()) throw std::invalid_argument(*value);
  } catch (const std::exception&) {
    throw UsageError(std::string(name) + "='" + *value + "' is not an integer");
  }
  if (parsed < min_value) {
    throw UsageError(std::string(name) + "=" + *value + " must be >= " + std::to_string(min_value));
  }
  return parsed;
}

}  // namespace

std::optional<WorkerInfo> worker_info_from_env() {
  if (!env("RANK") && !env("WORLD_SIZE")) return std::nullopt;
  if (!env("RANK")) throw UsageError("WORLD_SIZE is set but RANK is not: set both or neither");
  if (!env("WORLD_SIZE")) throw UsageError("RANK is set but WORLD_SIZE is not: set both or neither");
  WorkerInfo info;
  info.world_size = env_int("WORLD_SIZE", 1, 1);
  info.world_rank = env_int("RANK", 0, 0);
  if (info.world_rank >= info.world_size) {
    throw UsageError("RANK=" + std::to_string(info.world_rank) + " must be < WORLD_SIZE=" +
                     std::to_string(info.world_size));
  }
  info.local_rank = env_int("LOCAL_RANK", info.world_rank, 0);
  info.local_world_size = env_int("LOCAL_WORLD_SIZE", info.world_size, 1);
  if (info.local_rank >= info.local_world_size) {
    throw UsageError("LOCAL_RANK=" + std::to_string(info.local_rank) +
                     " must be < LOCAL_WORLD_SIZE=" + std::to_string(info.local_world_size));
  }
  info.node_rank = env_int("NODE_RANK", env_int("GROUP_RANK", 0, 0), 0);
  auto addr = env("MASTER_ADDR");
  if (!addr && info.world_size > 1) {
    throw UsageError("MASTER_ADDR is not set: give the address of rank 0's host");
  }
  info.master_addr = addr.value_or("127.0.0.1");
  info.master_port = env_int("MASTER_PORT", 0, 0);
  if (info.master_port == 0 && info.world_size > 1) {
    throw UsageError("MASTER_PORT is not set: give the rendezvous port on rank 0's host");
  }
  if (info.master_port > 65535) {
    throw UsageError("MASTER_PORT=" + std::to_string(info.master_port) + " is not a port (1-65535)");
  }
  return info;
}

std::map<std::string, std::string> worker_env(const WorkerInfo& info) {
  return {{"RANK", std::to_string(info.world_rank)},
          {"WORLD_SIZE", std::to_string(info.world_size)},
          {"LOCAL_RANK", std::to_string(info.local_rank)},
          {"LOCAL_WORLD_SIZE", std::to_string(info.local_world_size)},
          {"NODE_RANK", std::to_string(info.node_rank)},
          {"GROUP_RANK", std::to_string(info.node_rank)},
          {"MASTER_ADDR", info.master_addr},
          {"MASTER_PORT", std::to_string(info.master_port)}};
}

bool is_spawned_worker() { return env(kRoleVar).value_or("") == kWorkerRole; }

void bind_lifetime_to_driver() {
  auto driver = env(kDriverPidVar);
  if (!driver) return;
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  // The driver may have died before the line above ran.
  if (std::to_string(getppid()) != *driver) _exit(1);
}

namespace {
// Runs before main(): a worker must not outlive its driver, even while still starting up.
const bool kBound = [] {
  if (is_spawned_worker()) bind_lifetime_to_driver();
  return true;
}();
}  // namespace

}  // namespace cohort::runtime

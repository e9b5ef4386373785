#include "env_command.h"

#include <netdb.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <thread>
#include <vector>

#include <torch/cuda.h>

#include "cohort/error.h"
#include "cohort/runtime/blas.h"
#include "cohort/runtime/gpus.h"
#include "cohort/runtime/worker_info.h"
#include "cohort/version.h"

extern char** environ;

namespace cohort::cli {
namespace {

const char* on_off(bool on) { return on ? "on" : "off"; }

bool resolves(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0) return false;
  ::freeaddrinfo(found);
  return true;
}

// `name=value` as a report may show it: a secret's value hidden, a long one (a worker spec) cut.
std::string shown(const std::string& name, const std::string& value) {
  for (const char* secret : {"SECRET", "TOKEN", "PASSWORD", "KEY"}) {
    if (name.find(secret) != std::string::npos)
      return name + "=(set, " + std::to_string(value.size()) + " characters, not shown)";
  }
  constexpr size_t kLongest = 120;
  if (value.size() <= kLongest) return name + "=" + value;
  return name + "=" + value.substr(0, kLongest) + "... (" + std::to_string(value.size()) +
         " characters)";
}

// The variables that steer cohort or a launcher it reads, as they are set here.
std::vector<std::string> launch_variables() {
  static const std::vector<std::string> exact = {
      "RANK",       "WORLD_SIZE",  "LOCAL_RANK",  "LOCAL_WORLD_SIZE",   "NODE_RANK",
      "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "CUDA_VISIBLE_DEVICES"};
  std::vector<std::string> out;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    const auto name = entry.substr(0, entry.find('='));
    const bool ours = name.rfind("COHORT_", 0) == 0 || name.rfind("OMPI_COMM_WORLD_", 0) == 0 ||
                      name == "SLURM_PROCID" || name == "SLURM_STEP_NUM_TASKS" ||
                      name == "SLURM_STEP_NODELIST" || name == "SLURM_JOB_ID";
    if (ours || std::find(exact.begin(), exact.end(), name) != exact.end())
      out.push_back(shown(name, entry.substr(std::min(entry.size(), name.size() + 1))));
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

std::string version_line() {
  return std::string("cohort ") + build::kVersion + " (git " + build::kGitRevision +
         "), libtorch " + build::kLibtorchVersion + ", CUDA " + on_off(build::kWithCuda) +
         ", NCCL " + on_off(build::kWithNccl);
}

CLI::App* add_env_command(CLI::App& app) {
  return app.add_subcommand("env",
                            "Print what cohort sees: versions, devices, the launch mode and rank "
                            "it would take from the environment, the address it would use");
}

int run_env_command() {
  int code = 0;
  std::vector<std::string> warnings;
  std::cout << version_line() << "\n";
  std::cout << "host         " << runtime::host_name() << ", "
            << std::thread::hardware_concurrency() << " CPUs\n";
  const auto gpus = runtime::visible_gpus();
  std::cout << "GPUs         " << torch::cuda::device_count() << " usable by libtorch";
  if (!gpus.empty()) {
    std::cout << " (visible:";
    for (const auto& gpu : gpus) std::cout << " " << gpu;
    std::cout << ")";
  }
  std::cout << "\n";
  const auto blas = runtime::blas_library();
  std::cout << "BLAS         " << blas.name << (blas.path.empty() ? "" : " (" + blas.path + ")")
            << ": libtorch's matrix products on the CPU\n";
  if (const auto advice = runtime::blas_advice(); !advice.empty()) warnings.push_back(advice);
  if (!build::kWithCuda && !gpus.empty())
    warnings.push_back("GPUs are visible but this build has no CUDA: it trains on the CPU");
  std::string master = "127.0.0.1";
  try {
    if (const auto launch = runtime::detect_launch()) {
      std::cout << "launch       " << launch->launcher << ": rank " << launch->world_rank << " of "
                << launch->world_size << ", local rank " << launch->local_rank << " of "
                << launch->local_world_size << ", node " << launch->node_rank << ", rendezvous "
                << launch->master_addr << ":" << launch->master_port << "\n";
      master = launch->master_addr;
    } else {
      std::cout << "launch       none: `cohort train` and a Trainer start their own workers here\n";
    }
  } catch (const UsageError& e) {
    std::cout << "launch       the launcher's variables contradict each other\n";
    warnings.push_back(e.what());
    code = 2;
  }
  if (const char* addr = std::getenv("MASTER_ADDR"); addr != nullptr && *addr != '\0')
    master = addr;
  const bool reachable = resolves(master);
  if (!reachable)
    warnings.push_back("MASTER_ADDR '" + master +
                       "' does not resolve here: workers could not reach the rendezvous");
  try {
    std::cout << "data plane   binds " << runtime::data_plane_address(master)
              << (reachable ? " (the address that reaches " + master + ")"
                            : std::string(" (no route to the rendezvous host is known)"))
              << "\n";
  } catch (const std::exception& e) {
    std::cout << "data plane   no address\n";
    warnings.push_back(e.what());
  }
  const auto variables = launch_variables();
  std::cout << "variables    "
            << (variables.empty() ? "none of cohort's or a launcher's" : "cohort's and launchers'")
            << "\n";
  for (const auto& v : variables) std::cout << "  " << v << "\n";
  for (const auto& w : warnings) std::cout << "warning: " << w << "\n";
  std::cout.flush();
  return code;
}

}  // namespace cohort::cli

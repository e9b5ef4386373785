#include "cohort/runtime/worker_info.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cctype>
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

// `text` as a whole number (an optional sign, then digits, nothing after); nullopt otherwise.
std::optional<int> whole_number(const std::string& text) {
  try {
    size_t used = 0;
    const int parsed = std::stoi(text, &used);
    if (used == text.size()) return parsed;
  } catch (const std::exception&) {
  }
  return std::nullopt;
}

// The etcd that COHORT_RDZV names; nullopt when it is unset.
std::optional<comm::HostPort> etcd_from_env() {
  const auto endpoint = env(kRendezvousVar);
  if (!endpoint) return std::nullopt;
  return comm::parse_etcd_endpoint(*endpoint, kRendezvousVar);
}

}  // namespace

int env_int(const char* name, int fallback, int min_value) {
  auto value = env(name);
  if (!value) return fallback;
  const auto number = whole_number(*value);
  if (!number) throw UsageError(std::string(name) + "='" + *value + "' is not an integer");
  const int parsed = *number;
  if (parsed < min_value) {
    throw UsageError(std::string(name) + "=" + *value + " must be >= " + std::to_string(min_value));
  }
  return parsed;
}

std::string env_string(const char* name) { return env(name).value_or(""); }

std::optional<comm::JobSecret> job_secret_from_env() {
  const auto text = env(kJobSecretVar);
  const auto file = env(kJobSecretFileVar);
  const auto insecure = env(kInsecureVar);
  if (insecure && *insecure != "0" && *insecure != "1") {
    throw UsageError(std::string(kInsecureVar) + "='" + *insecure + "': give 1 or 0");
  }
  if (insecure == "1" && (text || file)) {
    throw UsageError(std::string(kInsecureVar) + "=1 with " +
                     (text ? kJobSecretVar : kJobSecretFileVar) +
                     " set: a job runs with a secret or without one (--insecure); unset one");
  }
  if (insecure == "1") return comm::JobSecret();
  if (text && file) {
    throw UsageError(std::string(kJobSecretVar) + " and " + kJobSecretFileVar +
                     " are both set: give the job's secret one way (unset one of them)");
  }
  if (text) return comm::JobSecret::from_text(*text, kJobSecretVar);
  if (file) return comm::JobSecret::read_file(*file);
  return std::nullopt;
}

void add_job_secret_env(std::map<std::string, std::string>& env, const comm::JobSecret& secret) {
  // An empty value is an unset variable (env()).
  env[kJobSecretVar] = secret.text();
  env[kJobSecretFileVar] = "";
  env[kInsecureVar] = secret.empty() ? "1" : "";
}

namespace {

// The job of a process of cohort launch that holds no rank; `who` names it in errors ("data
// workers").
LaunchedJobInfo launched_job_from_env(const std::string& who, const std::string& flag) {
  LaunchedJobInfo info{.master_addr = env_string("MASTER_ADDR"),
                       .store_port = env_int(kStorePortVar, 0, 1),
                       .train_ranks = env_int(kTrainRanksVar, 0, 1),
                       .restart_round = env_int(kRestartRoundVar, 0, 0),
                       .job_id = env_string(kJobIdVar),
                       .etcd = etcd_from_env()};
  if (info.master_addr.empty() || info.store_port == 0 || info.train_ranks == 0) {
    throw UsageError(std::string("MASTER_ADDR, ") + kStorePortVar + " and " + kTrainRanksVar +
                     " must be set: start " + who + " with cohort launch" + flag);
  }
  if (info.store_port > 65535) {
    throw UsageError(std::string(kStorePortVar) + "=" + std::to_string(info.store_port) +
                     " is not a port (1-65535)");
  }
  return info;
}

}  // namespace

std::optional<DataMemberInfo> data_member_from_env() {
  const int member = env_int(kDataMemberVar, -1, 0);
  if (member < 0) return std::nullopt;
  return DataMemberInfo{.member = member,
                        .job = launched_job_from_env("data workers", " --data-workers")};
}

LaunchedJobInfo job_host_from_env() {
  return launched_job_from_env("the job host", " (it starts one when rank 0 asks)");
}

DataShardInfo data_shard_from_env() {
  DataShardInfo info{.dataset = env_string(kDataDatasetVar)};
  if (info.dataset.empty()) throw UsageError(std::string(kDataDatasetVar) + " is not set");
  const std::string shard = env_string(kDataShardVar);
  const auto slash = shard.find('/');
  const auto rank = whole_number(shard.substr(0, slash));
  const auto shards =
      slash == std::string::npos ? std::nullopt : whole_number(shard.substr(slash + 1));
  if (!rank || !shards || *rank < 0 || *shards < 1 || *rank >= *shards) {
    throw UsageError(std::string(kDataShardVar) + " is '" + shard +
                     "', not the rank's shard as r/n (0 <= r < n)");
  }
  info.rank = *rank;
  info.shards = *shards;
  return info;
}

std::optional<WorkerInfo> worker_info_from_env() {
  if (!env("RANK") && !env("WORLD_SIZE")) return std::nullopt;
  if (!env("RANK")) throw UsageError("WORLD_SIZE is set but RANK is not: set both or neither");
  if (!env("WORLD_SIZE"))
    throw UsageError("RANK is set but WORLD_SIZE is not: set both or neither");
  WorkerInfo info;
  info.world_size = env_int("WORLD_SIZE", 1, 1);
  info.world_rank = env_int("RANK", 0, 0);
  if (info.world_rank >= info.world_size) {
    throw UsageError("RANK=" + std::to_string(info.world_rank) +
                     " must be < WORLD_SIZE=" + std::to_string(info.world_size));
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
    throw UsageError("MASTER_PORT=" + std::to_string(info.master_port) +
                     " is not a port (1-65535)");
  }
  return info;
}

namespace {

int required_int(const char* name, int min_value) {
  if (!env(name)) throw UsageError(std::string(name) + " is not set");
  return env_int(name, 0, min_value);
}

void check_ranks(WorkerInfo& info, const std::string& rank_var, const std::string& size_var) {
  if (info.world_rank >= info.world_size) {
    throw UsageError(rank_var + "=" + std::to_string(info.world_rank) + " must be < " + size_var +
                     "=" + std::to_string(info.world_size));
  }
  if (info.local_rank >= info.local_world_size) {
    throw UsageError("local rank " + std::to_string(info.local_rank) +
                     " must be < the local world size " + std::to_string(info.local_world_size));
  }
}

// MASTER_ADDR/MASTER_PORT when given, else the launcher's defaults.
void rendezvous_from_env(WorkerInfo& info, const std::optional<std::string>& default_addr,
                         int default_port, const std::string& hint) {
  auto addr = env("MASTER_ADDR");
  if (!addr) addr = default_addr;
  if (!addr) throw UsageError("MASTER_ADDR is not set: " + hint);
  info.master_addr = *addr;
  info.master_port = env_int("MASTER_PORT", default_port, 1);
  if (info.master_port > 65535) {
    throw UsageError("MASTER_PORT=" + std::to_string(info.master_port) +
                     " is not a port (1-65535)");
  }
}

int port_from_job(const std::string& job) {
  int64_t number = 0;
  for (char c : job) {
    if (std::isdigit(static_cast<unsigned char>(c)))
      number = (number * 10 + (c - '0')) % 1'000'000'007;
  }
  return 15000 + static_cast<int>(number % 10000);
}

}  // namespace

std::optional<int> launched_world_size() {
  if (spawned_role() == kJobHostRole) return job_host_from_env().train_ranks;
  if (const auto launch = detect_launch()) return launch->world_size;
  return std::nullopt;
}

std::string first_slurm_host(const std::string& nodelist) {
  // The first top-level item: commas inside brackets do not end it.
  int depth = 0;
  size_t end = 0;
  while (end < nodelist.size() && !(nodelist[end] == ',' && depth == 0)) {
    depth += nodelist[end] == '[' ? 1 : nodelist[end] == ']' ? -1 : 0;
    ++end;
  }
  const std::string item = nodelist.substr(0, end);
  const auto open = item.find('[');
  if (open == std::string::npos) return item;
  const auto close = item.find(']', open);
  if (close == std::string::npos)
    throw UsageError("Slurm node list '" + nodelist + "' has an unclosed '['");
  const std::string ranges = item.substr(open + 1, close - open - 1);
  const std::string first = ranges.substr(0, std::min(ranges.find(','), ranges.find('-')));
  return first_slurm_host(item.substr(0, open) + first +
                          item.substr(close + 1));  // "rack[1-2]-n[1-4]"
}

int slurm_tasks_on_node(const std::string& tasks_per_node, int node) {
  // "2(x3),1": 2 tasks on each of nodes 0-2, then 1 on node 3.
  int seen = 0;
  size_t pos = 0;
  while (pos < tasks_per_node.size()) {
    size_t used = 0;
    const int tasks = std::stoi(tasks_per_node.substr(pos), &used);
    pos += used;
    int repeat = 1;
    if (tasks_per_node.compare(pos, 2, "(x") == 0) {
      repeat = std::stoi(tasks_per_node.substr(pos + 2), &used);
      pos += 2 + used + 1;
    }
    if (node < seen + repeat) return tasks;
    seen += repeat;
    if (pos < tasks_per_node.size() && tasks_per_node[pos] == ',') ++pos;
  }
  throw UsageError("Slurm tasks-per-node list '" + tasks_per_node + "' has no entry for node " +
                   std::to_string(node));
}

std::optional<WorkerInfo> detect_launch() {
  std::optional<WorkerInfo> info;
  if (env("RANK") || env("WORLD_SIZE")) {
    info = worker_info_from_env();
    info->launcher = env(kLauncherVar).value_or("torchrun");
    info->job_id = env(kJobIdVar).value_or(env("TORCHELASTIC_RUN_ID").value_or(""));
    info->restart_round = env_int(kRestartRoundVar, env_int("TORCHELASTIC_RESTART_COUNT", 0, 0), 0);
    info->store_on_launcher = env(kStoreOnLauncherVar).value_or("") == "1";
    // torchrun's agent serves its own (c10d) store on MASTER_PORT; ours goes next to it.
    const bool torch_agent = env("TORCHELASTIC_USE_AGENT_STORE").value_or("") == "True";
    info->store_port = env_int(
        kStorePortVar, info->master_port + (torch_agent && !info->store_on_launcher ? 1 : 0), 0);
  } else if (env("OMPI_COMM_WORLD_RANK") || env("OMPI_COMM_WORLD_SIZE")) {
    info.emplace();
    info->launcher = "openmpi";
    info->world_rank = required_int("OMPI_COMM_WORLD_RANK", 0);
    info->world_size = required_int("OMPI_COMM_WORLD_SIZE", 1);
    info->local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK", info->world_rank, 0);
    info->local_world_size = env_int("OMPI_COMM_WORLD_LOCAL_SIZE", info->world_size, 1);
    info->node_rank = env_int("OMPI_COMM_WORLD_NODE_RANK", 0, 0);
    check_ranks(*info, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE");
    // Open MPI 4 names the job in OMPI_MCA_ess_base_jobid; Open MPI 5 (PRRTE) only in
    // PMIX_NAMESPACE ("prterun-<host>-<pid>@1"). Without either, two jobs on a host would share
    // one default port.
    const std::string job =
        env("OMPI_MCA_ess_base_jobid").value_or(env("PMIX_NAMESPACE").value_or(""));
    info->job_id = env(kJobIdVar).value_or(job.empty() ? "" : "openmpi-" + job);
    const bool one_host = info->local_world_size == info->world_size;
    rendezvous_from_env(
        *info, one_host ? std::optional<std::string>("127.0.0.1") : std::nullopt,
        port_from_job(job),
        "across hosts, mpirun must pass rank 0's host address: mpirun -x MASTER_ADDR=<host> ...");
    info->store_port = info->master_port;
  } else if (env("SLURM_PROCID") && env("SLURM_STEP_NUM_TASKS")) {
    info.emplace();
    info->launcher = "slurm";
    info->world_rank = required_int("SLURM_PROCID", 0);
    info->world_size = required_int("SLURM_STEP_NUM_TASKS", 1);
    info->local_rank = env_int("SLURM_LOCALID", 0, 0);
    info->node_rank = env_int("SLURM_NODEID", 0, 0);
    const auto per_node = env("SLURM_STEP_TASKS_PER_NODE");
    info->local_world_size =
        per_node ? slurm_tasks_on_node(*per_node, info->node_rank) : info->world_size;
    check_ranks(*info, "SLURM_PROCID", "SLURM_STEP_NUM_TASKS");
    const std::string job = env("SLURM_JOB_ID").value_or("");
    info->job_id = env(kJobIdVar).value_or(
        job.empty() ? "" : "slurm-" + job + "." + env("SLURM_STEP_ID").value_or("0"));
    info->restart_round = env_int("SLURM_RESTART_COUNT", 0, 0);
    const auto nodes =
        env("SLURM_STEP_NODELIST") ? env("SLURM_STEP_NODELIST") : env("SLURM_JOB_NODELIST");
    rendezvous_from_env(
        *info, nodes ? std::optional<std::string>(first_slurm_host(*nodes)) : std::nullopt,
        port_from_job(job), "srun sets SLURM_STEP_NODELIST; set MASTER_ADDR to rank 0's host");
    info->store_port = info->master_port;
  }
  if (info) info->etcd = etcd_from_env();
  return info;
}

std::string data_plane_address(const std::string& master_addr) {
  auto name = env(kIfnameVar);
  if (!name) name = env("GLOO_SOCKET_IFNAME");
  if (name) {
    ifaddrs* list = nullptr;
    if (::getifaddrs(&list) != 0)
      throw RuntimeError("getifaddrs failed: cannot list network interfaces");
    std::string found, names;
    for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
      if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
      names += (names.empty() ? "" : ", ") + std::string(i->ifa_name);
      if (*name == i->ifa_name && found.empty()) {
        char text[INET_ADDRSTRLEN];
        ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, text,
                    sizeof text);
        found = text;
      }
    }
    ::freeifaddrs(list);
    if (found.empty()) {
      throw UsageError("network interface '" + *name +
                       "' (COHORT_IFNAME/GLOO_SOCKET_IFNAME) has no IPv4 address here; "
                       "interfaces with one: " +
                       names);
    }
    return found;
  }
  if (auto address = env(kIfaddrVar)) return *address;
  // Which local address routes to the master: a UDP "connection" sends nothing.
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* result = nullptr;
  if (::getaddrinfo(master_addr.c_str(), "9", &hints, &result) != 0 || result == nullptr)
    return "127.0.0.1";
  std::string address = "127.0.0.1";
  const int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd >= 0 && ::connect(fd, result->ai_addr, result->ai_addrlen) == 0) {
    sockaddr_in local{};
    socklen_t length = sizeof local;
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) == 0) {
      char text[INET_ADDRSTRLEN];
      ::inet_ntop(AF_INET, &local.sin_addr, text, sizeof text);
      address = text;
    }
  }
  if (fd >= 0) ::close(fd);
  ::freeaddrinfo(result);
  return address;
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

bool is_spawned_worker() { return spawned_role() == kWorkerRole; }

std::string spawned_role() { return env(kRoleVar).value_or(""); }

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
  bind_lifetime_to_driver();  // when started by a WorkerGroup (COHORT_DRIVER_PID set)
  return true;
}();
}  // namespace

std::string host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return "localhost";
  return name;
}

}  // namespace cohort::runtime

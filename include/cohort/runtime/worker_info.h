#pragma once
#include <map>
#include <optional>
#include <string>

#include "cohort/comm/address.h"
#include "cohort/comm/job_secret.h"
#include "cohort/runtime/environment.h"

namespace cohort::runtime {

/// Who this process is in its worker group, in torchrun's terms.
struct WorkerInfo {
  int world_rank = 0;                     ///< rank among all workers (RANK)
  int local_rank = 0;                     ///< rank on this host (LOCAL_RANK)
  int node_rank = 0;                      ///< this host's index (GROUP_RANK / NODE_RANK)
  int world_size = 1;                     ///< workers in the job (WORLD_SIZE)
  int local_world_size = 1;               ///< workers on this host (LOCAL_WORLD_SIZE)
  std::string master_addr = "127.0.0.1";  ///< rank 0's host (MASTER_ADDR)
  int master_port = 0;                    ///< rank 0's port (MASTER_PORT)
  /// Who started this process: "cohort" (the local driver), "cohort-launch", "torchrun",
  /// "openmpi" or "slurm".
  std::string launcher = "torchrun";
  /// The job this process belongs to, checked when joining the rendezvous ("" : not checked).
  std::string job_id;
  /// Restarts of the group so far (a launcher's restart count): keys of earlier rounds are not
  /// reused.
  int restart_round = 0;
  /// The rendezvous store: served by rank 0 at master_addr:store_port, or by the launcher (node
  /// 0's cohort launch, or torchrun's agent) when store_on_launcher.
  int store_port = 0;
  bool store_on_launcher = false;  ///< the launcher serves the store, not rank 0
  /// The store is etcd at this address instead (COHORT_RDZV, or RunConfig::rendezvous).
  std::optional<comm::HostPort> etcd;
};

/// The whole number in environment variable `name`, or `fallback` when it is unset or empty;
/// UsageError naming the variable and its value when it is no whole number or less than
/// `min_value`. Every integer setting of the environment is read through it.
int env_int(const char* name, int fallback, int min_value);

/// The value of environment variable `name`; empty when it is unset.
std::string env_string(const char* name);

/// Where a process of `cohort launch` that holds no rank (a data worker, the job host) finds its
/// job: the job's store, and how many train ranks the job has.
struct LaunchedJobInfo {
  std::string master_addr;             ///< the store's host (MASTER_ADDR)
  int store_port = 0;                  ///< the store's port (COHORT_STORE_PORT)
  int train_ranks = 0;                 ///< the job's train ranks (COHORT_TRAIN_RANKS)
  int restart_round = 0;               ///< restarts of the job so far (COHORT_RESTART_ROUND)
  std::string job_id;                  ///< the job, checked at the store (COHORT_JOB_ID)
  std::optional<comm::HostPort> etcd;  ///< the store is etcd there instead (COHORT_RDZV)
};

/// A data worker of `cohort launch --data-workers` (COHORT_DATA_MEMBER set): its index, and its
/// job, whose ranks it serves until they all finish.
struct DataMemberInfo {
  int member = 0;       ///< its index among the job's data workers (COHORT_DATA_MEMBER)
  LaunchedJobInfo job;  ///< where its job is
};
/// This process's data-worker settings; nullopt when COHORT_DATA_MEMBER is unset. UsageError naming
/// the variable that is missing or malformed, and the fix.
std::optional<DataMemberInfo> data_member_from_env();
/// The job of cohort launch's job host (COHORT_ROLE=job-host). UsageError naming the variable
/// that is missing or malformed, and the fix.
LaunchedJobInfo job_host_from_env();

/// A preprocessing worker that a rank started for one of its Trainer datasets: the dataset's name
/// and the rank's shard of it.
struct DataShardInfo {
  std::string dataset;  ///< the Trainer dataset (COHORT_DATA_DATASET)
  int rank = 0;         ///< the shard's index (COHORT_DATA_SHARD "r/n")
  int shards = 1;       ///< the number of shards
};
/// This process's dataset and shard; UsageError naming the variable that is missing or malformed.
DataShardInfo data_shard_from_env();

/// Reads RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK (or GROUP_RANK), MASTER_ADDR,
/// MASTER_PORT. Returns nullopt when RANK and WORLD_SIZE are both unset; throws UsageError naming
/// the variable when they are inconsistent.
std::optional<WorkerInfo> worker_info_from_env();

/// How this process was launched, from its environment, in this order: torchrun-style variables
/// (also set by cohort's driver and `cohort launch`), OpenMPI's mpirun (OMPI_COMM_WORLD_*), Slurm's
/// srun (SLURM_PROCID with SLURM_STEP_NUM_TASKS). nullopt: not launched (a plain start). Throws
/// UsageError naming the variable that is missing or inconsistent. The rendezvous address is
/// MASTER_ADDR/MASTER_PORT when set; else under Slurm the first host of the step's node list and
/// port 15000 + job id % 10000; under mpirun on one host 127.0.0.1 and 15000 + job id % 10000.
/// Under any of them, COHORT_RDZV=etcd://HOST:PORT puts the store in etcd there.
std::optional<WorkerInfo> detect_launch();

/// The ranks a launcher started for this process's job: detect_launch()'s world size, or in
/// cohort launch's job host (which holds no rank) its job's train ranks; nullopt when not
/// launched. A program takes it as its number of workers (`cohort train` does, without
/// --workers).
std::optional<int> launched_world_size();

/// The first host name of a Slurm host list such as "node[07-09,12],gpu1" ("node07").
std::string first_slurm_host(const std::string& nodelist);
/// Tasks on node `node` from a Slurm tasks-per-node list such as "2(x3),1".
int slurm_tasks_on_node(const std::string& tasks_per_node, int node);

/// This host's name (gethostname), as messages and run files name it.
std::string host_name();

/// The address of this host that the data plane (Gloo) binds to: the interface named by
/// COHORT_IFNAME (or GLOO_SOCKET_IFNAME), else the address COHORT_IFADDR, else the source address
/// the kernel picks to reach `master_addr` (on a multi-homed host, the one on the master's
/// network). Throws UsageError naming the interfaces there are when the named one has no IPv4
/// address.
std::string data_plane_address(const std::string& master_addr);

/// The job secret COHORT_JOB_SECRET holds, or the file COHORT_JOB_SECRET_FILE names; an empty one
/// under COHORT_INSECURE=1; nullopt when none of them is set. UsageError naming the variables
/// when more than one is set, or when the secret is shorter than JobSecret::kMinBytes, or the
/// file is missing, empty or not private (mode 0600).
std::optional<comm::JobSecret> job_secret_from_env();

/// Sets in `env`, a child process's variables, what hands it `secret` (COHORT_JOB_SECRET; an empty
/// secret as COHORT_INSECURE=1), clearing the other ways this process may have been given one, so
/// that the child's job_secret_from_env() returns `secret`.
void add_job_secret_env(std::map<std::string, std::string>& env, const comm::JobSecret& secret);

/// The variables that describe `info` to a child process.
std::map<std::string, std::string> worker_env(const WorkerInfo& info);

/// True in a process that the local worker group started in the worker role.
bool is_spawned_worker();
/// The role a WorkerGroup gave this process (kWorkerRole, kTrialRole), "" when none.
std::string spawned_role();

/// In a spawned worker: die with the driver even if it is SIGKILLed, so no worker is orphaned.
void bind_lifetime_to_driver();

}  // namespace cohort::runtime

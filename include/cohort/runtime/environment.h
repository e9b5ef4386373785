/// \file
/// Every COHORT_* environment variable, named once. The torchrun-style variables (RANK,
/// WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR, MASTER_PORT), Slurm's and
/// Open MPI's are read in runtime/worker_info.cpp; cohort's own are these.
#pragma once

namespace cohort::runtime {

/// What this process is: empty for the program the user started; otherwise re-executed by
/// cohort in one of the roles below.
inline constexpr const char* kRoleVar = "COHORT_ROLE";
inline constexpr const char* kWorkerRole = "worker";  ///< a Trainer's worker
/// A Tuner's trial: runs one trial's Trainer as its driver (tune/tuner.h).
inline constexpr const char* kTrialRole = "trial";
/// A preprocessing worker: serves a data pipeline's tasks (data/data_iterator.h).
inline constexpr const char* kDataWorkerRole = "data";
/// The job host of `cohort launch`: a process of the program on node 0 that holds no rank and
/// keeps the run's bookkeeping, its coordinator and live recovery's decisions, so that every rank,
/// rank 0 included, can be lost and replaced (train::FailureConfig::Recovery::kLive). Started at
/// rank 0's word (runtime::launch_host_key); finds the job as a data worker does
/// (runtime::job_host_from_env).
inline constexpr const char* kJobHostRole = "job-host";

/// Set by the local driver (runtime::WorkerGroup) in each child: the driver's pid (the child ends
/// with it) and the control channel's file descriptor.
inline constexpr const char* kDriverPidVar = "COHORT_DRIVER_PID";
inline constexpr const char* kControlFdVar =
    "COHORT_CONTROL_FD";  ///< the control channel's file descriptor (3)
/// The local driver's whole worker spec, serialized (src/runtime/worker_spec.h).
inline constexpr const char* kWorkerSpecVar = "COHORT_WORKER_SPEC";

/// Set by `cohort launch` (and read under any launcher): the job's id, the launcher, the restart
/// round, and where the rendezvous store is served.
inline constexpr const char* kJobIdVar = "COHORT_JOB_ID";
inline constexpr const char* kLauncherVar =
    "COHORT_LAUNCHER";  ///< "cohort-launch", or the launcher it runs under
inline constexpr const char* kRestartRoundVar =
    "COHORT_RESTART_ROUND";  ///< restarts of the job so far
inline constexpr const char* kStoreOnLauncherVar =
    "COHORT_STORE_ON_LAUNCHER";  ///< "1": node 0's launcher serves the store
inline constexpr const char* kStorePortVar = "COHORT_STORE_PORT";  ///< the store's port
/// "etcd://HOST:PORT": the rendezvous store is etcd there (`cohort launch --rdzv`; or set for ranks
/// under another launcher). Unset or empty: cohort's own store.
inline constexpr const char* kRendezvousVar = "COHORT_RDZV";
/// Set by `cohort launch` in a replacement that live recovery starts in a lost rank's place: what
/// rank 0 decided, as JSON: {"index": the lost rank's place (as the coordinator knows it),
/// "rank", "world_size": in the new group, "live_round", "source", "next_checkpoint"}.
inline constexpr const char* kLiveJoinVar = "COHORT_LIVE_JOIN";

/// The job's secret (comm/job_secret.h), at least 16 bytes: set by the user under torchrun, srun
/// or mpirun, and by the local driver and `cohort launch` in the processes they start.
inline constexpr const char* kJobSecretVar = "COHORT_JOB_SECRET";
/// A file holding the job's secret instead (mode 0600, refused otherwise).
inline constexpr const char* kJobSecretFileVar = "COHORT_JOB_SECRET_FILE";
/// "1": the job runs without a secret (`cohort launch --insecure`): its connections prove nothing.
inline constexpr const char* kInsecureVar = "COHORT_INSECURE";
/// Set by `cohort launch --data-workers`: in every process of the job, how many data workers its
/// nodes run; in such a data worker (role "data"), its index among them and the job's number of
/// ranks (it gets no RANK or WORLD_SIZE: it holds no rank; nor does the job host, which gets the
/// number of ranks too).
inline constexpr const char* kDataMembersVar = "COHORT_DATA_MEMBERS";
inline constexpr const char* kDataMemberVar =
    "COHORT_DATA_MEMBER";  ///< a data worker's index among the job's data workers
inline constexpr const char* kTrainRanksVar =
    "COHORT_TRAIN_RANKS";  ///< the job's number of train ranks

/// A preprocessing worker's: the address of the consumer it serves and the fingerprint of the
/// pipeline it must build; under a Trainer, the dataset's name and the shard ("r/n", its
/// data-parallel index and degree: with a mesh, not its world rank and size).
inline constexpr const char* kDataAddressVar = "COHORT_DATA_ADDRESS";
inline constexpr const char* kDataPipelineVar =
    "COHORT_DATA_PIPELINE";  ///< the pipeline's fingerprint
inline constexpr const char* kDataDatasetVar =
    "COHORT_DATA_DATASET";  ///< the dataset's name under a Trainer
inline constexpr const char* kDataShardVar = "COHORT_DATA_SHARD";  ///< the shard, "r/n"

/// A Tuner's trial process and its workers: the trial's folder.
inline constexpr const char* kTrialDirVar = "COHORT_TRIAL_DIR";

/// Set by the user: the network interface (or address) the data plane binds to, and the NVML
/// library to load instead of the driver's libnvidia-ml.so.1.
inline constexpr const char* kIfnameVar = "COHORT_IFNAME";
inline constexpr const char* kIfaddrVar = "COHORT_IFADDR";  ///< an address of the interface instead
inline constexpr const char* kNvmlLibraryVar = "COHORT_NVML_LIBRARY";  ///< the NVML library to load

}  // namespace cohort::runtime

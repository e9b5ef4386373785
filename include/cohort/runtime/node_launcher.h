#pragma once
#include <chrono>
#include <string>
#include <vector>

#include "cohort/timeouts.h"

namespace cohort::runtime {

/// One node's share of a multi-node job on machines without a scheduler (what torchrun is for
/// PyTorch): `cohort launch` runs this once on every node.
struct NodeLaunchOptions {
  int nnodes = 1;     ///< nodes in the job
  int node_rank = 0;  ///< this node's index, from 0
  /// Node 0's address and the port its launcher serves the rendezvous store on (bound to that
  /// address only). Workers rendezvous through the same store.
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;  ///< the store's port on node 0
  /// Keep the rendezvous in etcd at this "etcd://HOST:PORT" (`--rdzv`) instead of in node
  /// 0's launcher: membership, the run record and barriers live in etcd under the job's lease
  /// (comm::StoreOptions::etcd), so the job outlives any node, node 0's included. Each round
  /// numbers the nodes in the order they join; master_addr/master_port are not used.
  std::string etcd;
  /// With etcd: the fewest nodes a restarted round may have. A round after the loss of a node
  /// goes on with the nodes left when they are at least this many (each worker program must
  /// accept the smaller world, e.g. cohort train --min-workers). 0: every round has nnodes.
  int min_nodes = 0;
  /// Train workers (ranks) on this node; nodes may differ. 0: a CPU-only node (needs data_workers).
  int nproc_per_node = 1;
  /// Preprocessing processes on this node for the job's trainers: the program in the data role,
  /// taking the map_batches work of the dataset ScalingConfig::remote_preprocessing_dataset names
  /// over TCP. Ranks are numbered over the nodes in node order.
  int data_workers = 0;
  /// The program each worker runs, with its arguments.
  std::vector<std::string> command;
  /// Times the whole job is restarted after a worker or a node fails.
  int max_restarts = 0;
  /// Every node must join each round within this.
  std::chrono::milliseconds rendezvous_timeout = kDefaultSetupTimeout;
  /// A node whose launcher is silent this long is lost.
  std::chrono::milliseconds heartbeat_timeout = kDefaultNodeHeartbeatTimeout;
  /// Checked when a node joins; empty: derived from the command line, so that another job given
  /// the same master address is refused.
  std::string job_id;
  /// Run without a job secret: no connection of the job proves anything (COHORT_INSECURE=1 in its
  /// processes). Otherwise the secret is COHORT_JOB_SECRET's (or COHORT_JOB_SECRET_FILE's), the
  /// same on every node; a single-node job without one gets a fresh one.
  bool insecure = false;
  int verbose = 1;  ///< 0: quiet; 1: a line per event
};

/// Live recovery under cohort launch (train::FailureConfig::Recovery::kLive): the job host (a
/// process of the program on node 0 that holds no rank, runtime::kJobHostRole) hosts the
/// coordinator and decides how the ranks regroup after a loss; each launcher tolerates its rank
/// killed by a signal, rank 0 included, and starts the replacement the job host asks for. They
/// agree through these keys of the job's store, for launch round `round` (the workers'
/// COHORT_RESTART_ROUND):
///  - launch_host_key(round): set by rank 0 as its run starts: "1" when the run recovers live,
///    and node 0's launcher starts the job host; "0" when rank 0 keeps the run itself.
///  - launch_live_key(round): set by the job host when the job recovers live. Only then does a
///    launcher go on without a rank that a signal ended.
///  - launch_place_free_key(round, rank, n): set by the launcher of `rank` once nothing of its
///    n-th lost process (from 1) is left: the place takes a replacement.
///  - launch_replacement_key(round, rank, n): set by the job host: start the replacement of
///    `rank`'s n-th lost process, with what the value says: {"rank", "world_size", ...}, all of it
///    passed in kLiveJoinVar (runtime/environment.h).
///  - launch_kill_key(round, rank, n): set by the job host when `rank`'s process hangs (its
///    coordinator heard nothing from it for the heartbeat timeout; the value says so): kill it,
///    and it is the n-th lost. launch_kills_key(round) then counts up, so that a launcher reads
///    those keys only when one was set.
std::string launch_live_key(int round);
/// See launch_live_key: the launcher's word that `rank`'s n-th lost process is gone.
std::string launch_place_free_key(int round, int rank, int n);
/// See launch_live_key: the job host's word to start the replacement of `rank`'s n-th lost process.
std::string launch_replacement_key(int round, int rank, int n);
/// See launch_live_key: the job host's word to kill `rank`'s process, which hangs (its n-th loss).
std::string launch_kill_key(int round, int rank, int n);
/// See launch_live_key: how many launch_kill_key the job host set in the round.
std::string launch_kills_key(int round);
/// See launch_live_key: rank 0's word to node 0's launcher to start the job host.
std::string launch_host_key(int round);

/// Runs the node's workers until the job ends; returns the exit status for the process: 0 when
/// every worker of every node succeeded, 1 otherwise (with the reason printed, naming a lost
/// node). Throws UsageError for bad options.
int launch_node(const NodeLaunchOptions& options);

}  // namespace cohort::runtime

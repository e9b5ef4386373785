#pragma once
#include <chrono>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>

#include "cohort/json.h"
#include "cohort/optim/precision.h"
#include "cohort/parallel/mesh_shape.h"
#include "cohort/timeouts.h"

namespace torch::optim {
class Optimizer;
}

namespace cohort {

/// What each worker gets: CPU threads and GPUs (Ray's resources_per_worker).
struct WorkerResources {
  /// Intra-op threads of each worker (torch::set_num_threads, OMP_NUM_THREADS).
  int cpu_threads = 1;
  /// GPUs of each worker, with use_gpu (0 then means 1). A worker sees only its own GPUs
  /// (CUDA_VISIBLE_DEVICES), so its device is cuda:0.
  int gpus = 0;
};

/// How many workers, and what each one gets (Ray Train's ScalingConfig).
///
/// Elastic training: with min_workers set, a group that lost a worker restarts with as many
/// workers as there are free slots (at least min_workers; it waits up to the setup deadline for
/// them), and grows back toward num_workers at the next checkpoint after a slot is free again.
/// Slot s is worker s of a full group (with use_gpu, GPU s). Every restart resumes from the
/// latest checkpoint; samplers shard the data for the new world size.
struct ScalingConfig {
  /// The size of the group; with min_workers, the most workers it runs.
  int num_workers = 1;
  /// The fewest workers an elastic group may run with; 0: always num_workers.
  int min_workers = 0;
  /// Train on GPUs: each worker gets resources_per_worker.gpus of the node's visible GPUs,
  /// get_context().get_device() is its first, prepare_model moves the model there and batches
  /// arrive there. A UsageError before any worker starts when the node has too few.
  bool use_gpu = false;
  WorkerResources resources_per_worker;  ///< threads and GPUs of each worker
  /// The collectives' transport (Ray's TorchConfig.backend): "auto" (Gloo for CPU tensors, NCCL
  /// for CUDA ones), "gloo" (also for CUDA tensors: e.g. several workers sharing one GPU, which
  /// NCCL refuses) or "nccl".
  std::string backend = "auto";
  /// The numerics of each training step, used by train::autocast(), train::backward() and
  /// train::step_optimizer(): "fp32"; "bf16" (CPU or GPU: the forward under bfloat16 autocast);
  /// "fp16" (GPU only: float16 autocast and dynamic loss scaling, an overflowing step skipped on
  /// every rank alike). Parameters and optimizer state stay float32. A UsageError before any
  /// worker starts for fp16 without use_gpu, naming bf16 as the fix.
  std::string precision = "fp32";
  /// fp16's loss scaler.
  optim::LossScalerOptions loss_scaler;
  /// Whether slot s can take a worker now, asked on top of cohort's own check (no process of the
  /// slot's previous worker is left, e.g. one stuck in the kernel after SIGKILL). For a health
  /// check of the slot's device, or a test. Runs in the driver.
  std::function<bool(int slot)> slot_available;
  /// Runs on every worker when train::load_checkpoint restores a checkpoint written by a group of
  /// another size, after the optimizer state is loaded: e.g. train::linear_lr_scaling. With a mesh
  /// on either side the sizes are the data-parallel degrees (dp; without a mesh, the world).
  std::function<void(torch::optim::Optimizer& optimizer, int previous_world_size, int world_size)>
      on_world_size_change;
  /// Parameter servers of a model prepared with sync parallel::AsyncParameterServer whose
  /// `servers` is 0 (`cohort train --sync async-ps:K --parameter-servers S`): they run in the first
  /// S workers' processes, so 1 to num_workers; 0 means 1. Set with another sync mode, a
  /// UsageError at prepare_model. An elastic group smaller than S runs one server per worker.
  int num_parameter_servers = 0;
  /// Parallel degrees over the workers: data x pipeline x tensor parallelism, e.g.
  /// {.dp = 2, .pp = 2, .tp = 2} for 8 workers; they multiply to num_workers (dp 0: what is left).
  /// With pp or tp > 1 every worker gets the mesh's named sub-groups (get_context().get_mesh())
  /// and get_dataset_shard() shards the data over dp: the ranks of one pipeline and of one
  /// tensor-parallel group read the same rows. With min_workers (a multiple of pp x tp, dp left at
  /// 0) the group shrinks and grows by whole model replicas: only dp changes.
  parallel::MeshShape mesh;
  /// Preprocessing on other nodes: under `cohort launch`, a node started with --data-workers N
  /// (a CPU-only node: --nproc-per-node 0) runs N data workers for the job. They take the
  /// map_batches work of this Trainer dataset's shards over TCP, beside each rank's own workers,
  /// worker k serving rank k % num_workers. Empty: they serve nothing.
  std::string remote_preprocessing_dataset = "train";
};

/// How a run survives failing workers (Ray Train's FailureConfig).
struct FailureConfig {
  /// Restarts of the worker group after a failure (a worker died, threw, or stopped
  /// heart-beating); each restart resumes from the latest valid checkpoint. 0: none; -1: unlimited.
  int max_failures = 0;
  /// A worker that sends no heartbeat for this long is considered hung (or stopped) and fails.
  std::chrono::milliseconds heartbeat_timeout = kDefaultHeartbeatTimeout;
  /// What the failure of one worker does to the others.
  enum class Recovery {
    /// The group stops and starts again from the newest checkpoint or snapshot (max_failures).
    kRestart,
    /// The survivors go on without a worker that was killed or hung (then killed): they abort
    /// the step in flight, re-form the group (with a replacement in its place, replace_lost),
    /// all take the state of the survivor that stepped furthest (with local SGD or DiLoCo, those
    /// as far keep their own replicas), re-balance the epoch's remaining rows and continue at
    /// the current step, in the same processes. For loops of a train::ParallelModel whose plan
    /// is DDP, local SGD, DiLoCo or ZeRO with replicated shards (ZeroOptions::shard_group_size;
    /// no mesh or parameter server), under the local driver or cohort launch (whose job host,
    /// on node 0, then keeps the run instead of rank 0, so that any rank can be replaced); where
    /// the group cannot go on (a failure outside a step's collectives, too few workers) it
    /// restarts, as kRestart.
    kLive,
  };
  /// kRestart or kLive (`cohort train --recovery`).
  Recovery recovery = Recovery::kRestart;
  /// kLive: a lost worker's place goes to a replacement the driver starts in its slot (when
  /// ScalingConfig::slot_available allows), which takes the state from a survivor, so the group
  /// keeps its size; false: the group shrinks (`cohort train --no-replace-lost`).
  bool replace_lost = true;
};

/// Which checkpoints a run keeps (Ray Train's CheckpointConfig).
struct CheckpointConfig {
  /// How many to keep; 0 keeps all. The latest is always kept too, for resuming.
  int num_to_keep = 0;
  /// The reported metric that ranks checkpoints; empty: the most recent are the best.
  std::string checkpoint_score_attribute;
  /// "max" or "min": whether a higher or a lower score is better.
  std::string checkpoint_score_order = "max";
};

/// TensorBoard event files of a run, under `<run>/tensorboard/` (Ray Tune's TBXLogger; see
/// train/summary_writer.h). The driver writes them (under a launcher, rank 0 or cohort launch's
/// job host).
struct TensorBoardConfig {
  /// Every numeric metric of every report as a scalar at its training_iteration (nested objects as
  /// "outer/inner"), the train_loop_config as text; a resumed run tells TensorBoard to drop the
  /// steps past its checkpoint that the crashed attempt wrote.
  bool enabled = true;
  /// Also histograms of rank 0's prepared models' parameters and gradients at each report
  /// (`"parameters/<name>"`, `"gradients/<name>"`).
  bool histograms = false;
  /// The hparams plugin's session: these hyperparameter values (name -> number, string or bool),
  /// and the run's end status. A Tune trial gets its sampled config here. Empty: no session.
  Json hparams = Json::object();
};

/// Where a dashboard (train/dashboard.h) listens. Ray's dashboard port is the default.
struct DashboardOptions {
  /// 127.0.0.1: this host only; "0.0.0.0" lets other hosts in.
  std::string host = "127.0.0.1";
  /// 0: a free port.
  int port = 8265;
  /// Off loopback, every request must carry this token: `?token=` once (Dashboard::url() has it),
  /// then the cookie that request sets. Empty: a fresh random one per dashboard. On loopback no
  /// token is asked (only this host's processes reach it).
  std::string token;
};

/// Where results go and how the run behaves (Ray Train's RunConfig).
struct RunConfig {
  /// The run's folder under storage_path; empty: `"cohort_<date>_<time>"`.
  std::string name;
  std::filesystem::path storage_path =
      "./cohort_results";        ///< where run directories are made (Ray's storage_path)
  FailureConfig failure_config;  ///< how many failures the run survives, and how a hang is noticed
  CheckpointConfig checkpoint_config;  ///< how many checkpoints are kept, and by which metric
  /// Running again with the same storage_path and name continues from the latest valid
  /// checkpoint (train::get_checkpoint() returns it). false starts afresh (old checkpoints stay
  /// on disk, untouched, and new ones are numbered after them).
  bool resume = true;
  /// Where each node keeps train::snapshot's in-memory snapshots: memory-backed storage local to
  /// the node (tmpfs), which outlives the worker processes. A restarted group restores from the
  /// newest snapshot its nodes hold when it is newer than the latest checkpoint; the run's folder
  /// in it goes when the run ends. Empty: snapshot() is an error.
  std::filesystem::path snapshot_path = "/dev/shm/cohort-snapshots";
  /// 0: silent driver; 1: a line per report and a progress bar on a terminal.
  int verbose = 1;
  /// Under a launcher: "etcd://HOST:PORT" makes the ranks rendezvous in etcd there rather than in
  /// rank 0's (or the launcher's) store, as COHORT_RDZV does (`cohort launch --rdzv` sets it).
  /// Empty: COHORT_RDZV's, else cohort's own store. Ignored by cohort's own driver.
  std::string rendezvous;
  /// Rendezvous and process-group setup deadline.
  std::chrono::milliseconds setup_timeout = kDefaultSetupTimeout;
  /// Deadline of every collective (a peer that died or hangs ends in an error, not a hang).
  std::chrono::milliseconds collective_timeout = kDefaultCollectiveTimeout;
  /// Called in the driver (under a launcher: in rank 0, or in cohort launch's job host) after
  /// each report is committed, with the record that metrics.jsonl gets: rank 0's metrics plus
  /// "training_iteration", "timestamp" and, when one came with it, "checkpoint" (its path). The
  /// Tuner follows its trials with this.
  std::function<void(const Json& record)> on_report;
  TensorBoardConfig tensorboard;  ///< TensorBoard event files of the run (on by default)
  /// Which steps' train::log_step metrics (the training loss and step time every N steps) rank 0
  /// sends to `<run>/steps.jsonl`, TensorBoard (`"step/<metric>"`) and the dashboard's step charts:
  /// every N-th optimizer step; 0: the first step, then one about every 15 seconds.
  int64_t log_every_steps = 0;
  /// Files the driver writes into the run directory once it owns it (file name -> content), each
  /// atomically, replacing what a previous start wrote: e.g. `cohort train` writes its effective
  /// options as config.json. Names are plain file names.
  std::map<std::string, std::string> extra_files;
  /// Permission bits taken from the run directory and from what cohort writes in it, as the
  /// shell's umask (octal): 077, the default, keeps a run to its user (folders 0700, files 0600:
  /// checkpoints hold the model and where the data stood); 022 lets others read it. 0 to 0777.
  /// The run's processes create their files with it while the run lasts; the driver's own umask
  /// is back when fit() returns.
  int umask = 077;
  /// A live dashboard of the storage path's runs, served by the driver while it runs
  /// (`cohort train --dashboard [PORT]`); the driver prints its address. `cohort dashboard
  /// STORAGE_PATH` serves the same page for running and finished runs. Unset: none.
  std::optional<DashboardOptions> dashboard;
  /// Steps whose phases (cohort/trace.h) each rank records as a Chrome trace,
  /// `<run>/trace/rank-R.json`, written when step `last` ends (or when the loop ends inside the
  /// range): open the files in Perfetto (ui.perfetto.dev) or chrome://tracing, several ranks at
  /// once. Steps count from 1 as train::step_optimizer ends them. {0, 0}: none.
  struct ProfileSteps {
    int64_t first = 0;  ///< the first step traced, from 1
    int64_t last = 0;   ///< the last step traced (inclusive)
  } profile_steps;      ///< the traced steps
};

/// How check_configs names an option in its messages: by its field ("ScalingConfig.min_workers")
/// unless mapped here to what the user set instead (a program's flag: "--min-workers").
using OptionNames = std::map<std::string, std::string>;

/// What a Trainer checks of its configs before any worker starts (every value in range, the
/// parameter servers, an elastic mesh's replicas, the precision on this device, the GPUs, the
/// backend, the umask, the profiled steps, the timeouts): a UsageError of one line naming the
/// option and the fix. A program whose flags fill the configs passes `names` (field -> flag), so
/// that its users read their flags' names in the same checks.
void check_configs(const ScalingConfig& scaling, const RunConfig& run,
                   const OptionNames& names = {});

}  // namespace cohort

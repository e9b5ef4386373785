// The state of a running worker: its context, its prepared models, its report count.
#pragma once
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "cohort/comm/store.h"
#include "cohort/data/dataset.h"
#include "cohort/data/epoch_position.h"
#include "cohort/optim/loss_scaler.h"
#include "cohort/parallel/distributed_data_parallel.h"
#include "cohort/parallel/local_sgd.h"
#include "cohort/parallel/parameter_server.h"
#include "cohort/parallel/zero_optimizer.h"
#include "cohort/train/checkpoint.h"
#include "cohort/train/config.h"
#include "cohort/train/context.h"
#include "train/async_checkpoint.h"
#include "train/data_positions.h"
#include "train/kept_tensors.h"

namespace cohort::train {

struct WorkerSession {
  TrainContext context;
  comm::Store store;
  // Unique to this start of the group: store keys and staging folders of an earlier, crashed
  // start can never be mistaken for this one's.
  std::string run_token;
  std::chrono::milliseconds collective_timeout{};
  // The models passed to prepare_model, in order, each with the engine that keeps its replicas
  // in step: DDP, made by prepare_model, or the engine prepare_optimizer makes around the
  // optimizer (ZeRO at stage >= 1; local SGD and DiLoCo; the parameter server), null until then.
  // Until then a model of a sync mode other than DDP has a hook on its first parameter's gradient
  // accumulator that stops a backward which would train without synchronising. It is not a tensor
  // hook (register_hook): libtorch keeps a removed one's wrapper, and activation checkpointing
  // treats a parameter with tensor hooks as hooked for good.
  struct PreparedModel {
    std::shared_ptr<torch::nn::Module> module;
    parallel::SyncMode sync;
    parallel::ZeroOptions zero;
    std::unique_ptr<parallel::DistributedDataParallel> ddp;
    parallel::ZeroOptimizer* zero_optimizer = nullptr;
    parallel::LocalSgdOptimizer* local_sgd = nullptr;
    parallel::ParameterServerOptimizer* parameter_server = nullptr;
    std::function<void()> remove_guard;  // takes that hook off (empty: none)

    // Whether prepare_optimizer makes its engine (every plan but DDP's).
    bool engine_wraps_optimizer() const { return ddp == nullptr; }
    // Whether that engine was made.
    bool has_optimizer_engine() const {
      return zero_optimizer != nullptr || local_sgd != nullptr || parameter_server != nullptr;
    }
    // Its engine's optimizer steps (0 before prepare_optimizer).
    int64_t optimizer_steps() const;
    // Its engine's type, for messages: "DistributedDataParallel", "ZeroOptimizer", ...
    const char* engine_name() const;
  };
  std::vector<PreparedModel> prepared_models;
  // ScalingConfig::num_parameter_servers.
  int num_parameter_servers = 0;
  // At the last report: the parameter servers' staleness sum and pushes of this rank.
  int64_t staleness_at_report = 0;
  int64_t pushes_at_report = 0;
  // At the last report: this rank's bytes sent by its process group and optimizer steps.
  int64_t bytes_at_report = 0;
  int64_t steps_at_report = 0;
  // Calls of train::step_optimizer(): the steps of loops whose engines the session did not make
  // (a mesh's pipelines).
  int64_t steps_through_step_optimizer = 0;
  std::map<std::string, data::Dataset> datasets;
  std::optional<Checkpoint> resume_from;
  // After a live regroup, the tensors of this rank's own state that resume_from's folder lacks
  // (kept_tensors.h): read in place of its files, and dropped once the model loaded them.
  KeptState kept_state;
  int64_t reports = 0;
  int64_t next_checkpoint_index = 0;  // rank 0 names checkpoints
  decltype(ScalingConfig::on_world_size_change) on_world_size_change;
  // This host's data-plane address, where remote data workers connect.
  std::string interface_address = "127.0.0.1";
  std::string remote_preprocessing_dataset;
  // Data workers of the job's `cohort launch --data-workers` nodes (0: none).
  int data_members = 0;
  // RunConfig::umask: what the files of this rank's checkpoints are given.
  int umask = 077;
  // The loop called should_stop(): the driver was told it honours stop requests.
  bool accepts_stop_requests = false;
  // RunConfig::tensorboard.histograms: rank 0's reports carry its models' histograms.
  bool tensorboard_histograms = false;
  // Enabled for fp16 (ScalingConfig::precision); agrees on overflows over the context's group.
  std::unique_ptr<optim::LossScaler> loss_scaler;
  // Where this rank's data streams stand ("dataset:<name>" of get_dataset_shard, "loader:<n>" of
  // the n-th prepare_data_loader): a checkpoint keeps them, and a resumed run's streams start
  // after the rows its epoch had taken.
  StreamPositions data_positions;
  int data_loaders = 0;
  // train::log_step: which steps rank 0 logs (RunConfig::log_every_steps), when it logged last,
  // and the times between its calls since.
  struct StepLog {
    int64_t every_steps = 0;
    std::optional<std::chrono::steady_clock::time_point> last_call, last_logged;
    std::vector<double> gaps_ms;
  } step_log;
  // train::SaveOptions::async and train::snapshot: this rank's save in flight (made at the
  // first).
  std::unique_ptr<AsyncCheckpointWriter> checkpoint_writer;
  // train::snapshot: this node's folder of the run's snapshots (RunConfig::snapshot_path; empty:
  // none), the snapshots taken in this start, and the group that carries their buddy copies
  // (made at the first, behind the loop's back on the writer's thread).
  std::filesystem::path snapshot_folder;
  int64_t snapshots = 0;
  comm::ProcessGroup snapshot_group;
  // FailureConfig::Recovery::kLive: a peer's failure in one of a step's collectives regroups the
  // survivors (live_recovery.h) instead of ending this process. The driver answers under
  // live_decision_key(live_token, live_round + 1).
  bool live_recovery = false;
  std::string live_token;
  // comm::ProcessGroupOptions::aborted of the session's groups: a lost peer was signalled.
  std::function<bool()> collectives_aborted;
  int live_round = 0;
  // The ParallelModel the loop trains (registered by it while it lives): its optimizer steps and
  // synchronisations (local SGD's), whether each rank holds a replica of its own, ZeRO's
  // sharding group size (0: the state is not sharded) and a save of its state as rank `rank` of
  // the regrouped `world_size` (live_recovery.h's save_live_state), which a regroup takes from
  // the survivor that got furthest (and from those as far: their own; ZeRO's shards from those
  // that hold them).
  const void* live_owner = nullptr;
  std::function<int64_t()> live_steps;
  std::function<int64_t()> live_syncs;
  bool live_replicas = false;
  int live_shard_group = 0;
  std::function<void(const std::filesystem::path& dir, int rank, int world_size, bool whole)>
      live_save;
  // runtime::heap_for_setup() is in force: blocks of 4 MiB or more are mapped on their own while
  // the model is built and prepared. end_heap_setup() (the model prepared, or the first report)
  // ends it.
  bool heap_in_setup = false;
  // The data positions after the last completed step, and that step's rows.
  StreamPositions positions_at_step;
  int64_t rows_at_step = 0;
};

// Once the session's model is prepared: the heap's policy for steps (runtime::heap_for_steps),
// where runtime::heap_for_setup() was in force.
void end_heap_setup(WorkerSession& session);

// Optimizer steps taken so far: the most of any of the session's prepared models, or of the
// calls of train::step_optimizer() (which steps any optimizer).
int64_t optimizer_steps(const WorkerSession& session);

// A rank's data-parallel coordinates: its world rank and size, or with a mesh its dp index and
// degree (a pipeline's and a tensor-parallel group's ranks read the same rows, and the global
// batch scales with dp).
struct DataParallelPosition {
  int rank, world_size;
};
DataParallelPosition data_parallel_position(const TrainContext& context);

// Makes `precision` (a plan's) the worker's, with a loss scaler of `loss_scaler` for fp16: a
// UsageError naming both when the run's (ScalingConfig::precision) is another than fp32.
void use_precision(optim::Precision precision, const optim::LossScalerOptions& loss_scaler);

// The session of the train loop this thread runs (SessionScope's); nullptr outside one. The
// train:: functions of a loop (report, get_context, prepare_model, ...) act on it.
WorkerSession* current_session();

// Owns a worker's session while its train loop runs (run_worker's, run_launched's), and makes it
// this thread's current_session() until it ends. Scopes do not nest: one loop per thread at a
// time. The session ends with the scope, its groups and writer destroyed, except where the scope
// ends by an exception: a collective of its groups may still wait on a dead peer until its
// deadline, and their destructors would wait with it, so the session is left to the process's
// end (which skips it: end_process).
class SessionScope {
 public:
  explicit SessionScope(std::unique_ptr<WorkerSession> session);
  ~SessionScope();
  SessionScope(const SessionScope&) = delete;
  SessionScope& operator=(const SessionScope&) = delete;
  WorkerSession& session() { return *session_; }

 private:
  std::unique_ptr<WorkerSession> session_;
  int exceptions_at_start_;
};

// Store keys: assignment n of data worker k ("<prefix>/<k>/<n>", a JSON object), and its count.
inline std::string data_member_key(const std::string& run_token, int member) {
  return "data/" + run_token + "/member/" + std::to_string(member) + "/";
}
// The metric report() adds: the most any rank waited for data per batch since the last report.
inline constexpr const char* kIngestMetric = "ingest_wait_ms";
// And the bytes a worker sent per optimizer step since the last report (mean over the workers).
inline constexpr const char* kCommBytesMetric = "comm_bytes_per_step";
// With the parameter server: the mean staleness of the workers' pushes since the last report
// (updates the servers applied between a worker's pull and its push), and the largest so far.
inline constexpr const char* kStalenessMeanMetric = "staleness_mean";
inline constexpr const char* kStalenessMaxMetric = "staleness_max";

// Where an asynchronous save captures this rank's files (the session's writer's buffers), once
// wait_for_checkpoint_in_flight() returned.
CapturedFiles& checkpoint_capture();
// train::report with a checkpoint saved asynchronously: checkpoint_capture() holds this rank's
// files when `has_files`, which the session's writer writes into the run directory, and rank 0
// commits, behind the loop.
void report_async(const Json& metrics, bool has_files);
// train::snapshot with the files checkpoint_capture() holds (none: this rank has none): the
// session's writer keeps them on the node's memory-backed storage and copies them to the buddy.
void snapshot_async(const Json& metrics);
// At the start of a group (every rank, before the loop): when a snapshot that the ranks' nodes
// hold is newer than the checkpoint on disk, the session resumes from it instead; rank 0 says
// which it chose and why. With `resume` false the node's snapshots of the run are removed.
void choose_snapshot_to_restore(WorkerSession& session, bool resume,
                                std::chrono::milliseconds timeout);
// Waits for this rank's asynchronous save in flight, if any, and rethrows its failure; returns the
// seconds waited. A loop's end waits too (finish_session).
double wait_for_checkpoint_in_flight();
// Whether some rank's asynchronous save is still being written: a collective (every rank asks at
// the same point, and every rank gets the same answer).
bool checkpoint_in_flight_on_any_rank();
// What a train loop leaves in flight when it returns: its last asynchronous checkpoint, committed
// before the worker reports that it finished.
void finish_session();

// A fresh token for one start of a group: nothing of an earlier start's store keys or staging
// folders is mistaken for this one's.
std::string new_run_token();

// RunConfig::profile_steps: each rank's Chrome trace, <run>/trace/rank-R.json.
inline constexpr const char* kTraceDir = "trace";

// Where ranks assemble a checkpoint before rank 0 renames it into place.
inline constexpr const char* kStagingDir = ".staging";

}  // namespace cohort::train

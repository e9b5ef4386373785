#pragma once
#include <functional>
#include <map>
#include <string>

#include "cohort/data/dataset.h"
#include "cohort/json.h"
#include "cohort/train/config.h"
#include "cohort/train/result.h"

namespace cohort {

/// The per-worker training function; it receives the train_loop_config.
using TrainLoop = std::function<void(const Json& config)>;

/// Runs a training function on a group of workers (Ray Train's TorchTrainer).
///
/// fit() in the program the user started (the driver) starts `num_workers` processes that
/// re-execute this same program; in each of them the same fit() call runs `train_loop` as one
/// rank and ends that process. Everything before fit() therefore runs in every worker too, and
/// must be deterministic (parse flags, build configs), not side effects that must happen once.
class Trainer {
 public:
  /// A Trainer of `train_loop` (run on every worker, given `train_loop_config`), as many workers as
  /// `scaling_config` says, its run directory and recovery as `run_config` says, and Ray-Data-style
  /// `datasets` the loop reads with get_dataset_shard(name). Checks the configs; UsageError names a
  /// bad value.
  Trainer(TrainLoop train_loop, ScalingConfig scaling_config = {}, RunConfig run_config = {},
          Json train_loop_config = Json::object(),
          std::map<std::string, data::Dataset> datasets = {});

  /// Driver: returns when every worker has finished, or after a failure (Result::error).
  /// Worker: runs the loop and exits the process (never returns).
  /// Under a launcher (srun, mpirun, torchrun-style variables, cohort launch) every process is a
  /// rank: rank 0 runs the loop, keeps the run directory and returns the Result; the other ranks
  /// run the loop and exit (status 1 after a failure, for the launcher to restart them). Under
  /// cohort launch a run that recovers live (FailureConfig::Recovery::kLive) has a job host, one
  /// more process of the program on node 0 that holds no rank: its fit() keeps the run directory
  /// and returns the Result, as a driver's, and every rank, rank 0 too, runs the loop and exits.
  ///
  /// Each fit() owns the worker's session while its loop runs: the train:: functions (report,
  /// get_context, prepare_model, ...) act on it, from the thread that runs the loop. It ends when
  /// the loop does: rank 0's fit() under a launcher returns with its process group and store
  /// closed, so the program may call fit() again.
  Result fit();

  /// The loop every worker runs.
  const TrainLoop& train_loop() const { return train_loop_; }
  /// The workers and what each gets.
  const ScalingConfig& scaling_config() const { return scaling_; }
  /// The run's directory, failures, checkpoints and observability.
  const RunConfig& run_config() const { return run_; }
  /// The JSON each worker's loop gets.
  const Json& train_loop_config() const { return config_; }
  /// The datasets workers read with train::get_dataset_shard(name).
  const std::map<std::string, data::Dataset>& datasets() const { return datasets_; }

 private:
  TrainLoop train_loop_;
  ScalingConfig scaling_;
  RunConfig run_;
  Json config_;
  std::map<std::string, data::Dataset> datasets_;
};

/// Whether a Trainer of `run` fit() in this process is the run's driver: it keeps the run
/// directory and returns the Result. The program the user started, under no launcher; rank 0
/// under a launcher; under cohort launch, for a run that recovers live, the job host instead
/// (rank 0 is then a rank as any). What must be said or checked once before fit() (a line about
/// the data, a memory budget) belongs where this is true: everything before fit() runs in every
/// worker too.
bool is_driver(const RunConfig& run);

}  // namespace cohort

/// \file
/// Hyperparameter search (Ray Tune's Tuner): trials drawn from a param space, each a worker group
/// of its own, run side by side within the host's CPU threads, stopped early by a scheduler,
/// persisted under the storage path and resumable after the driver died.
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cohort/json.h"
#include "cohort/train/config.h"
#include "cohort/train/result.h"
#include "cohort/train/trainer.h"
#include "cohort/tune/scheduler.h"
#include "cohort/tune/search_space.h"

namespace cohort::tune {

/// How a search runs: the metric and mode, the samples, concurrency, the scheduler and searcher,
/// the time budget.
struct TuneConfig {
  /// The reported metric that ranks trials, and whether higher ("max") or lower ("min") is better.
  /// Schedulers and get_best_result() use them.
  std::string metric;
  std::string mode;  ///< "max" or "min"
  /// Trials drawn; with grid_search domains, the whole grid is repeated this many times.
  int num_samples = 1;
  /// Trials running at once; 0: as many as the CPU threads allow.
  int max_concurrent_trials = 0;
  /// null: FIFOScheduler (every trial runs to its end).
  std::shared_ptr<TrialScheduler> scheduler;
  /// null: BasicVariantGenerator (grid and random search) seeded with `seed`.
  std::shared_ptr<Searcher> search_alg;
  /// Wall-clock budget of the experiment: then running trials are stopped and no new one starts.
  /// 0: none.
  double time_budget_s = 0;
  /// Seeds the sampling of the param space: the same seed gives the same trials.
  uint64_t seed = 0;
  /// The CPU threads all running trials may request together (a trial requests num_workers x
  /// resources_per_worker.cpu_threads); 0: this host's CPUs. Trials that do not fit wait.
  int max_cpu_threads = 0;
  /// Metrics shown in the status table; empty: `metric`, then up to three others a trial reports.
  std::vector<std::string> metric_columns;
};

/// One trial of an experiment, as the status table and trials.csv show it.
struct TrialInfo {
  std::string trial_id;  ///< "00003"
  std::string name;      ///< "trial_00003": its run directory under the experiment
  Json config;           ///< the param space with every domain resolved
  std::string status;    ///< "PENDING", "RUNNING", "TERMINATED" or "ERROR"
  /// Stopped by the scheduler or the time budget before it finished on its own.
  bool stopped_early = false;
  int cpu_threads = 1;                ///< CPU threads of its worker
  int64_t iterations = 0;             ///< reports so far
  double time_total_s = 0;            ///< seconds it ran
  Json last_result = Json::object();  ///< its last report's record
  std::optional<std::string> error;   ///< its error, when it failed
};

/// What an experiment produced (Ray Tune's ResultGrid): one Result per trial that ran, in trial
/// order, each with the trial's config.
class ResultGrid {
 public:
  /// The grid of `experiment_path`'s trials and their results, ranked by `metric` and `mode`.
  ResultGrid(std::filesystem::path experiment_path, std::vector<TrialInfo> trials,
             std::vector<Result> results, std::string metric, std::string mode);

  /// The number of results.
  size_t size() const { return results_.size(); }
  /// Result `i`, in trial order.
  const Result& operator[](size_t i) const { return results_.at(i); }
  /// The first result.
  std::vector<Result>::const_iterator begin() const { return results_.begin(); }
  /// One past the last result.
  std::vector<Result>::const_iterator end() const { return results_.end(); }

  /// The trial with the best `metric` (default: TuneConfig's), by its last result (scope "last")
  /// or its best result ever (scope "all"). Trials that never reported the metric are skipped;
  /// throws UsageError when none did.
  Result get_best_result(std::string metric = "", std::string mode = "",
                         const std::string& scope = "last") const;
  /// Trials that failed.
  int num_errors() const;
  /// Trials that finished (TERMINATED).
  int num_terminated() const;
  /// `"trial_00003: <error>"` for every errored trial.
  std::vector<std::string> errors() const;
  /// Every trial's state.
  const std::vector<TrialInfo>& trials() const { return trials_; }
  /// One row per trial: name, status, `config/<param>` columns, iterations, time_total_s, its last
  /// metrics and error (Ray's get_dataframe()). The Tuner also writes it as trials.csv.
  std::vector<Json> table() const;
  /// table() as a CSV file.
  void write_csv(const std::filesystem::path& file) const;
  /// The experiment's folder.
  const std::filesystem::path& experiment_path() const { return path_; }

 private:
  std::filesystem::path path_;
  std::vector<TrialInfo> trials_;
  std::vector<Result> results_;
  std::string metric_, mode_;
};

/// Runs trials of a trainable over a param space.
///
/// Like Trainer::fit(), fit() re-executes this program: once per trial (in a trial role, where
/// the same fit() call runs the trial's Trainer as its driver and ends the process) and once per
/// worker of each trial. Everything before fit() runs in all of them and must be deterministic.
///
/// A Trainer's param space: its top-level keys go into the train_loop_config (merged over the
/// Trainer's own), except "scaling_config" ({"num_workers", "min_workers", "cpu_threads"}) which
/// changes the trial's ScalingConfig; Ray's nesting under "train_loop_config" works too. Each
/// trial runs with the Trainer's RunConfig (failure_config, checkpoints, timeouts) in its own
/// folder `<storage_path>/<name>/trial_NNNNN`. Of the Tuner's RunConfig only name, storage_path,
/// verbose (0: silent, 1: the status table) and extra_files (written into the experiment's
/// folder) are used.
class Tuner {
 public:
  /// A Tuner of `trainable` (a Trainer, run once per trial with the trial's config; the param
  /// space's "scaling_config" changes its ScalingConfig) over `param_space` (search_space.h), as
  /// `tune_config` says, in run_config's storage_path and name.
  Tuner(Trainer trainable, Json param_space, TuneConfig tune_config = {},
        RunConfig run_config = {});
  /// A function trainable: one worker per trial with `resources`, the function receiving the
  /// trial's config; it calls train::report and may use checkpoints as a Trainer's loop does.
  Tuner(TrainLoop trainable, Json param_space, TuneConfig tune_config = {},
        RunConfig run_config = {}, WorkerResources resources = {});

  /// Whether `experiment_path` holds an experiment that Tuner::restore can continue.
  static bool can_restore(const std::filesystem::path& experiment_path);
  /// Continues an experiment whose driver was stopped or killed: finished trials (TERMINATED,
  /// ERROR) are not rerun, unfinished ones resume from their latest checkpoints, and the rest
  /// of the search goes on. The param space and TuneConfig come from the experiment; a custom
  /// scheduler or search_alg (which cannot be saved) is given again in `objects`.
  static Tuner restore(const std::filesystem::path& experiment_path, Trainer trainable,
                       TuneConfig objects = {});
  /// restore() for a function trainable, with its worker's resources.
  static Tuner restore(const std::filesystem::path& experiment_path, TrainLoop trainable,
                       TuneConfig objects = {}, WorkerResources resources = {});

  /// Runs the experiment: trials until the search ends or the budget is spent; the results of
  /// every trial that ran.
  ResultGrid fit();

 private:
  Tuner(Trainer trainable, bool function_trainable);
  Trainer trainable_;
  bool function_trainable_ = false;
  Json param_space_ = Json::object();
  TuneConfig config_;
  RunConfig run_;
  std::filesystem::path restore_from_;
};

}  // namespace cohort::tune

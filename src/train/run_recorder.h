// The bookkeeping of a run: its directory, metrics.jsonl/csv, the checkpoints it keeps and
// result.json. The local driver keeps one; under an external launcher rank 0 does.
#pragma once
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <string>

#include "cohort/json.h"
#include "cohort/train/config.h"
#include "cohort/train/result.h"
#include "train/checkpoint_manager.h"
#include "train/progress.h"
#include "train/run_files.h"
#include "train/tensorboard_log.h"

namespace cohort::train {

// "cohort_<date>_<time>": the run name when RunConfig gives none.
std::string default_run_name();

// A rank whose step time (its waits for peers not counted) is more than this times the median
// rank's is a straggler: each report that finds one prints a line naming it.
inline constexpr double kStragglerRatio = 1.2;
// ... and at least this much slower: differences in steps of microseconds are noise.
inline constexpr double kStragglerMinMs = 1.0;
// That line, for a report's metrics (slowest_rank, step_time_ms_max, step_time_ms_median), or
// nothing.
std::optional<std::string> straggler_line(const Json& metrics);

class RunRecorder {
 public:
  // Creates (or reopens) <storage_path>/<name>; throws UsageError when it is not writable.
  // `config` (the train_loop_config) goes into result.json.
  RunRecorder(const RunConfig& run, const std::string& name, const Json& config, Console& console);

  // The checkpoint to resume from: with RunConfig::resume, the run's latest valid one (a corrupt
  // one skipped with a warning), and the metrics history up to it is reloaded. `restarted`: a
  // launcher's restart of the same job (round > 0), whose history goes on even without a
  // checkpoint on disk (its group may restore from an in-memory snapshot, as the driver's restarts
  // keep theirs).
  std::optional<Checkpoint> resume_point(bool restarted = false);
  // After a failed start: the latest valid checkpoint on disk, including any that rank 0
  // committed before the group was stopped.
  std::optional<Checkpoint> latest_on_disk();
  int64_t next_checkpoint_index() const { return checkpoints_.next_index(); }

  // A "report" control message of rank 0 (with "histograms" when RunConfig::tensorboard asks for
  // them). Sets `driver_error` when the run broke a rule.
  void on_report(const Json& message, std::string& driver_error);
  // A "checkpoint" control message of rank 0: a checkpoint saved asynchronously
  // (SaveOptions::async) was committed after its report.
  void on_checkpoint(const Json& message);
  // A "restored" control message of rank 0: what the (re)started group restores from (a
  // snapshot, or the disk, and why). The console says it; the failure that caused the restart
  // records it ("restored_from": "snapshot" or "disk", "restored_checkpoint": its path).
  void on_restored(const Json& message);
  // A "step" control message of rank 0 (train::log_step): a line of steps.jsonl, and TensorBoard
  // scalars "step/<metric>" at that step.
  void on_step(const Json& message);

  // Writes metrics.csv and result.json; returns the final Result.
  Result finish(const std::optional<std::string>& error, int workers, double wall_seconds);

  const std::filesystem::path& run_dir() const { return run_dir_; }
  const std::string& name() const { return name_; }
  Result& result() { return result_; }

 private:
  std::string name_;
  std::filesystem::path run_dir_;
  bool resume_;
  TensorBoardConfig tensorboard_config_;
  Console& console_;
  RunDirLock lock_;
  CheckpointManager checkpoints_;
  Result result_;
  std::ofstream steps_log_;
  std::function<void(const Json&)> on_report_;
  bool score_checked_ = false;  // CheckpointConfig's score attribute, at the first epoch's report
  std::optional<TensorBoardLog> tensorboard_;  // from resume_point() on, when enabled
};

}  // namespace cohort::train

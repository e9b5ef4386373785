#pragma once
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "cohort/json.h"
#include "cohort/train/checkpoint.h"

namespace cohort {

/// What a run produced (Ray Train's Result).
struct Result {
  /// The last metrics rank 0 reported.
  Json metrics = Json::object();
  /// Every report of rank 0, in order (also in metrics.jsonl).
  std::vector<Json> metrics_history;
  /// The latest checkpoint, and the kept ones best first (by CheckpointConfig's score) with the
  /// metrics reported with them.
  std::optional<Checkpoint> checkpoint;
  std::vector<std::pair<Checkpoint, Json>>
      best_checkpoints;  ///< the kept checkpoints with their metrics, best first
                         ///< (CheckpointConfig's score)
  /// The configuration the run was given: a Trainer run's train_loop_config; in a tune::ResultGrid,
  /// the trial's config (its param space with every search domain resolved).
  Json config = Json::object();
  /// The run directory: `<storage_path>/<name>`.
  std::filesystem::path path;
  /// Set when the run failed: which rank, and why.
  std::optional<std::string> error;
  /// How many workers the last group had.
  int workers = 0;
  double wall_seconds = 0;  ///< the run's wall-clock time, start to end, restarts included
  /// One entry per worker-group failure: {"rank", "cause", "reports" (rank 0's reports before
  /// it), "detected_at_s" (since the start), "restarted" (bool), "recovery_s" (until the new group
  /// trained again)}; when a snapshot was newer than the disk's checkpoint (train::snapshot),
  /// also "restored_from" ("snapshot" or "disk") and "restored_checkpoint" (its folder).
  std::vector<Json> failures;
  /// Elastic training: one entry per change of the group's size: {"from", "to", "reports",
  /// "at_s", "reason"}.
  std::vector<Json> resizes;
  /// The run stopped early at a request (the first Ctrl-C, or kStopRequestSignal under a
  /// launcher) after committing a checkpoint: running it again resumes there.
  bool interrupted = false;

  /// Whether the run ended without an error.
  bool ok() const { return !error.has_value(); }

  /// Reloads a run directory written by Trainer::fit (result.json, metrics.jsonl and the
  /// checkpoints). A run whose driver died has no result.json: error says so.
  static Result from_path(const std::filesystem::path& run_dir);
};

}  // namespace cohort

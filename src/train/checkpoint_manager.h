// Which checkpoints of a run exist, which are best, which go: the driver's bookkeeping
// (rank 0's under an external launcher). Snapshot in checkpoint_manager.json.
#pragma once
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "cohort/train/checkpoint.h"
#include "cohort/train/config.h"

namespace cohort::train {

class CheckpointManager {
 public:
  CheckpointManager(std::filesystem::path run_dir, CheckpointConfig config);
  // The manager as its checkpoint_manager.json left it (for reading a finished run: nothing is
  // verified or written). Empty when there is no snapshot.
  static CheckpointManager from_snapshot(const std::filesystem::path& run_dir);

  // Takes in the run directory's checkpoints (for resuming). Invalid ones are skipped; each
  // skip is returned as a warning line.
  std::vector<std::string> adopt_existing();
  // Number for the next checkpoint: after every checkpoint_* folder on disk, valid or not.
  int64_t next_index() const;
  // Records a checkpoint just persisted, deletes the ones no longer kept, writes the snapshot.
  void add(const std::filesystem::path& dir, const Json& metrics);
  std::optional<Checkpoint> latest() const;
  // Kept checkpoints, best first, with their metrics.
  std::vector<std::pair<Checkpoint, Json>> best() const;
  // Throws UsageError when the score attribute is not among `metrics`.
  void check_score_attribute(const Json& metrics) const;

 private:
  struct Entry {
    std::filesystem::path path;
    int64_t index;
    Json metrics;
  };
  bool better(const Entry& a, const Entry& b) const;
  void prune();
  void snapshot() const;

  std::filesystem::path run_dir_;
  CheckpointConfig config_;
  std::vector<Entry> entries_;  // by index
};

}  // namespace cohort::train

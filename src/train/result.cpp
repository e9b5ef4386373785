#include "cohort/train/result.h"

#include "cohort/error.h"
#include "train/checkpoint_manager.h"
#include "train/run_files.h"

namespace cohort {

Result Result::from_path(const std::filesystem::path& run_dir) {
  if (!std::filesystem::is_directory(run_dir)) {
    throw UsageError("Result::from_path: " + run_dir.string() + " is not a run directory");
  }
  Result result;
  result.path = std::filesystem::absolute(run_dir);
  result.metrics_history = read_jsonl(run_dir / kMetricsFile);
  if (!result.metrics_history.empty()) result.metrics = result.metrics_history.back();
  const auto checkpoints = train::CheckpointManager::from_snapshot(run_dir);
  result.checkpoint = checkpoints.latest();
  result.best_checkpoints = checkpoints.best();
  if (!std::filesystem::exists(run_dir / kResultFile)) {
    result.error =
        "the run did not finish: " + (run_dir / kResultFile).string() +
        " is missing (its driver was killed?); metrics and checkpoints are as far as it got";
    return result;
  }
  const Json saved = read_json(run_dir / kResultFile);
  if (saved.contains("error") && saved["error"].is_string())
    result.error = saved["error"].get<std::string>();
  result.workers = saved.value("workers", 0);
  if (saved.contains("config")) result.config = saved["config"];
  result.wall_seconds = saved.value("wall_seconds", 0.0);
  for (const auto& failure : saved.value("failures", Json::array()))
    result.failures.push_back(failure);
  for (const auto& resize : saved.value("resizes", Json::array())) result.resizes.push_back(resize);
  result.interrupted = saved.value("interrupted", false);
  return result;
}

}  // namespace cohort

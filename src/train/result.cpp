#include "cohort/train/result.h"

#include <fstream>

#include "cohort/error.h"
#include "train/run_files.h"

namespace cohort {

Result Result::from_path(const std::filesystem::path& run_dir) {
  if (!std::filesystem::is_directory(run_dir)) {
    throw UsageError("Result::from_path: " + run_dir.string() + " is not a run directory");
  }
  Result result;
  result.path = std::filesystem::absolute(run_dir);
  {
    std::ifstream in(run_dir / kMetricsFile);
    for (std::string line; std::getline(in, line);) {
      try {
        result.metrics_history.push_back(Json::parse(line));
      } catch (const std::exception&) {
        break;  // a line cut by a crash
      }
    }
  }
  if (!result.metrics_history.empty()) result.metrics = result.metrics_history.back();
  if (std::filesystem::exists(run_dir / kCheckpointManagerFile)) {
    const Json manager = read_json(run_dir / kCheckpointManagerFile);
    std::vector<std::pair<Checkpoint, Json>> kept;
    for (const auto& entry : manager.at("checkpoints")) {
      const std::filesystem::path path = entry.at("path").get<std::string>();
      if (std::filesystem::is_directory(path)) kept.emplace_back(Checkpoint::from_directory(path), entry.at("metrics"));
    }
    if (!kept.empty()) result.checkpoint = kept.back().first;
    // Best first, by the order the run was configured with.
    const auto attribute = manager.value("checkpoint_score_attribute", std::string{});
    const bool max = manager.value("checkpoint_score_order", std::string{"max"}) == "max";
    std::stable_sort(kept.begin(), kept.end(), [&](const auto& a, const auto& b) {
      if (!attribute.empty() && a.second.contains(attribute) && b.second.contains(attribute) &&
          a.second[attribute] != b.second[attribute]) {
        return max ? a.second[attribute].template get<double>() > b.second[attribute].template get<double>()
                   : a.second[attribute].template get<double>() < b.second[attribute].template get<double>();
      }
      return checkpoint_index(a.first.path()) > checkpoint_index(b.first.path());
    });
    result.best_checkpoints = std::move(kept);
  }
  if (!std::filesystem::exists(run_dir / kResultFile)) {
    result.error = "the run did not finish: " + (run_dir / kResultFile).string() +
                   " is missing (its driver was killed?); metrics and checkpoints are as far as it got";
    return result;
  }
  const Json saved = read_json(run_dir / kResultFile);
  if (saved.contains("error") && saved["error"].is_string()) result.error = saved["error"].get<std::string>();
  result.workers = saved.value("workers", 0);
  result.wall_seconds = saved.value("wall_seconds", 0.0);
  return result;
}

}  // namespace cohort

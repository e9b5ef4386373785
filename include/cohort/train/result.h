#pragma once
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "cohort/json.h"

namespace cohort {

// What a run produced (Ray Train's Result).
struct Result {
  // The last metrics rank 0 reported.
  Json metrics = Json::object();
  // Every report of rank 0, in order (also in metrics.jsonl).
  std::vector<Json> metrics_history;
  // The run directory: <storage_path>/<name>.
  std::filesystem::path path;
  // Set when the run failed: which rank, and why.
  std::optional<std::string> error;
  int workers = 0;
  double wall_seconds = 0;

  bool ok() const { return !error.has_value(); }
};

}  // namespace cohort

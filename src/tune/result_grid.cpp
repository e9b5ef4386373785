#include <cmath>

#include "cohort/error.h"
#include "cohort/tune/tuner.h"
#include "train/run_files.h"

namespace cohort::tune {

ResultGrid::ResultGrid(std::filesystem::path experiment_path, std::vector<TrialInfo> trials,
                       std::vector<Result> results, std::string metric, std::string mode)
    : path_(std::move(experiment_path)),
      trials_(std::move(trials)),
      results_(std::move(results)),
      metric_(std::move(metric)),
      mode_(std::move(mode)) {}

Result ResultGrid::get_best_result(std::string metric, std::string mode,
                                   const std::string& scope) const {
  if (metric.empty()) metric = metric_;
  if (mode.empty()) mode = mode_;
  if (metric.empty())
    throw UsageError("get_best_result: give a metric (TuneConfig.metric is not set either)");
  if (mode != "max" && mode != "min")
    throw UsageError("get_best_result: mode '" + mode + "' must be \"max\" or \"min\"");
  if (scope != "last" && scope != "all")
    throw UsageError("get_best_result: scope '" + scope + "' must be \"last\" or \"all\"");
  const double sign = mode == "max" ? 1 : -1;
  auto score = [&](const Json& record, double& out) {
    if (!record.contains(metric) || !record[metric].is_number()) return false;
    out = sign * record[metric].get<double>();
    return std::isfinite(out);
  };
  int best = -1;
  double best_score = 0;
  for (size_t i = 0; i < results_.size(); ++i) {
    double value = 0;
    bool found = false;
    if (scope == "last") {
      found = score(results_[i].metrics, value);
    } else {
      for (const auto& record : results_[i].metrics_history) {
        double v = 0;
        if (score(record, v) && (!found || v > value)) {
          value = v;
          found = true;
        }
      }
    }
    if (found && (best < 0 || value > best_score)) {
      best = static_cast<int>(i);
      best_score = value;
    }
  }
  if (best < 0) {
    throw UsageError("get_best_result: no trial of " + path_.string() + " reported the metric '" +
                     metric + "'");
  }
  return results_[static_cast<size_t>(best)];
}

int ResultGrid::num_errors() const {
  int n = 0;
  for (const auto& t : trials_) n += t.status == "ERROR";
  return n;
}

int ResultGrid::num_terminated() const {
  int n = 0;
  for (const auto& t : trials_) n += t.status == "TERMINATED";
  return n;
}

std::vector<std::string> ResultGrid::errors() const {
  std::vector<std::string> out;
  for (const auto& t : trials_) {
    if (t.error) out.push_back(t.name + ": " + *t.error);
  }
  return out;
}

std::vector<Json> ResultGrid::table() const {
  std::vector<Json> rows;
  for (const auto& t : trials_) {
    Json row{{"trial_name", t.name}, {"status", t.status}, {"stopped_early", t.stopped_early}};
    const Json flat = t.config.flatten();
    for (const auto& [key, value] : flat.items()) row["config" + key] = value;
    row["iterations"] = t.iterations;
    row["time_total_s"] = t.time_total_s;
    for (const auto& [key, value] : t.last_result.items()) {
      if (key != "trial_id" && key != "training_iteration" && key != "time_total_s")
        row[key] = value;
    }
    row["error"] = t.error ? Json(*t.error) : Json("");
    rows.push_back(std::move(row));
  }
  return rows;
}

void ResultGrid::write_csv(const std::filesystem::path& file) const {
  cohort::write_csv(file, table());
}

}  // namespace cohort::tune

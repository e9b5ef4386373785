// The Tuner's status table (as Ray Tune's): refreshed in place on a terminal, printed as plain
// lines otherwise.
#pragma once
#include <chrono>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "cohort/tune/tuner.h"

namespace cohort::tune {

struct StatusView {
  std::filesystem::path experiment_path;
  double running_for_s = 0;
  std::string scheduler;  // TrialScheduler::describe()
  int threads_used = 0;
  int threads_limit = 0;
  std::string metric;
  std::string mode;
  const std::vector<TrialInfo>* trials = nullptr;
  std::vector<std::string> parameters;      // searched parameter paths ("lr", "optim/momentum")
  std::vector<std::string> metric_columns;  // empty: metric and up to three others
  std::optional<int64_t> total_trials;
};

// Fields the Tuner or the Trainer add to every result, which say nothing about the model.
bool is_bookkeeping(const std::string& key);
// The value at a parameter path ("optim/momentum") of a trial config; null when absent.
Json parameter_value(const Json& config, const std::string& path);
// A cell: numbers with 4 significant digits, strings as they are.
std::string format_value(const Json& value);
// "lr=0.01, batch_size=64": the searched parameters of a trial config.
std::string describe_parameters(const Json& config, const std::vector<std::string>& parameters);
// Index of the trial with the best last `metric`; -1 when no trial reported it.
int best_trial(const std::vector<TrialInfo>& trials, const std::string& metric,
               const std::string& mode);

std::string render_status(const StatusView& view);

class StatusReporter {
 public:
  // verbose 0: nothing; 1: the table (in place on a terminal), events as lines otherwise.
  explicit StatusReporter(int verbose);
  // A line about one trial (started, stopped, errored, a result when not on a terminal).
  void event(const std::string& line);
  // A line that only plain output gets (each trial's results); a terminal has the table.
  void progress(const std::string& line);
  // Redraws the table: on a terminal at most once a second, otherwise every 30 s; `force` now.
  void refresh(const StatusView& view, bool force = false);

 private:
  void erase();
  int verbose_;
  bool terminal_;
  int drawn_lines_ = 0;
  std::string last_table_;
  std::chrono::steady_clock::time_point last_draw_{};
};

}  // namespace cohort::tune

// <run>/status.json: the live state of a run's workers, kept by its driver for dashboards
// (train/dashboard.h), rewritten atomically at most once a second.
#pragma once
#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include "cohort/json.h"
#include "cohort/runtime/gpu_usage.h"

namespace cohort::train {

class RunStatus {
 public:
  // `nvml`: where GPU usage comes from; null: the process's (runtime::Nvml::instance(), loaded
  // once a worker runs on a GPU).
  explicit RunStatus(std::filesystem::path run_dir, const runtime::Nvml* nvml = nullptr);

  // A worker group started: rank r is `pids[r]` on `devices[r]` ("cpu", "cuda:0").
  void on_group_start(const std::vector<int>& pids, const std::vector<std::string>& devices);
  void on_training();
  // Rank 0's progress (step, total, samples_per_s, loss).
  void on_progress(const Json& progress);
  // A committed report: its metrics and each rank's step time ("rank_step_time_ms").
  void on_report(const Json& message);
  void on_exit(int rank, bool ok);
  // Worker `rank` was started again as `pid` (live recovery's replacement): it starts up.
  void on_restart(int rank, int pid);

  // Writes status.json with the run's `state` ("running", "finished", "failed", "interrupted")
  // and its failures, unless it was written less than a second ago and `force` is false. A live
  // worker on a GPU also gets its GPU memory and utilisation (runtime::Nvml), where NVML is.
  void write(const std::string& state, const Json& failures, bool force = false);

 private:
  struct Worker {
    int pid = 0;
    std::string device;
    std::string state = "starting";
    Json step_time_ms;  // null until a report gives it
  };
  static bool alive(const Worker& w);
  std::filesystem::path file_;
  const runtime::Nvml* nvml_;
  std::vector<Worker> workers_;
  Json progress_ = Json::object();
  Json last_metrics_ = Json::object();
  std::chrono::steady_clock::time_point written_{};
};

}  // namespace cohort::train

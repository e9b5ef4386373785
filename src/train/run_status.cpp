#include "train/run_status.h"

#include <unistd.h>

#include <ctime>
#include <fstream>

#include "cohort/runtime/worker_info.h"
#include "cohort/train/dashboard.h"
#include "cohort/train/memory_estimate.h"
#include "train/run_files.h"

namespace cohort::train {

namespace {

// Resident memory of a process in MB; null when it is gone.
Json resident_mb(int pid) {
  const int64_t bytes = resident_bytes(pid);
  if (bytes == 0) return nullptr;
  return static_cast<double>(bytes) / (1024.0 * 1024.0);
}

}  // namespace

bool RunStatus::alive(const Worker& w) { return w.state == "running" || w.state == "starting"; }

RunStatus::RunStatus(std::filesystem::path run_dir, const runtime::Nvml* nvml)
    : file_(std::move(run_dir) / kStatusFile), nvml_(nvml) {}

void RunStatus::on_group_start(const std::vector<int>& pids,
                               const std::vector<std::string>& devices) {
  workers_.assign(pids.size(), Worker{});
  for (size_t r = 0; r < pids.size(); ++r) {
    workers_[r].pid = pids[r];
    workers_[r].device = r < devices.size() ? devices[r] : "cpu";
  }
}

void RunStatus::on_training() {
  for (auto& w : workers_)
    if (w.state == "starting") w.state = "running";
}

void RunStatus::on_progress(const Json& progress) {
  if (progress.is_object()) progress_ = progress;
}

void RunStatus::on_report(const Json& message) {
  last_metrics_ = message.value("metrics", Json::object());
  const Json times = message.value("rank_step_time_ms", Json::array());
  for (size_t r = 0; r < workers_.size() && r < times.size(); ++r)
    workers_[r].step_time_ms = times[r];
}

void RunStatus::on_exit(int rank, bool ok) {
  if (rank >= 0 && static_cast<size_t>(rank) < workers_.size())
    workers_[static_cast<size_t>(rank)].state = ok ? "finished" : "failed";
}

void RunStatus::on_restart(int rank, int pid) {
  if (rank < 0 || static_cast<size_t>(rank) >= workers_.size()) return;
  auto& worker = workers_[static_cast<size_t>(rank)];
  worker.pid = pid;
  worker.state = "starting";
  worker.step_time_ms = nullptr;
}

void RunStatus::write(const std::string& state, const Json& failures, bool force) {
  const auto now = std::chrono::steady_clock::now();
  if (!force && now - written_ < std::chrono::seconds(1)) return;
  written_ = now;
  static const std::string host = runtime::host_name();
  // GPU memory and utilisation (NVML, loaded only once some worker runs on a GPU).
  auto on_gpu = [](const Worker& w) { return alive(w) && w.device.rfind("cuda", 0) == 0; };
  std::vector<int> on_gpus;
  for (const auto& w : workers_)
    if (on_gpu(w)) on_gpus.push_back(w.pid);
  const auto gpu_usage =
      on_gpus.empty() ? std::map<int, runtime::GpuProcessUsage>{}
                      : (nvml_ != nullptr ? *nvml_ : runtime::Nvml::instance()).usage_of(on_gpus);
  Json workers = Json::array();
  for (size_t r = 0; r < workers_.size(); ++r) {
    const auto& w = workers_[r];
    workers.push_back({{"rank", r},
                       {"host", host},
                       {"pid", w.pid},
                       {"state", w.state},
                       {"device", w.device},
                       {"step", progress_.value("step", Json())},
                       {"step_time_ms", w.step_time_ms},
                       {"samples_per_s", progress_.value("samples_per_s", Json())},
                       {"ingest_wait_ms", last_metrics_.value("ingest_wait_ms", Json())},
                       {"memory_mb", alive(w) ? resident_mb(w.pid) : Json(nullptr)}});
    if (const auto gpu = gpu_usage.find(w.pid); on_gpu(w) && gpu != gpu_usage.end()) {
      workers.back()["gpu_memory_mb"] = gpu->second.memory_mb;
      workers.back()["gpu_utilization"] = gpu->second.utilization;
    }
  }
  const Json status{{"state", state},
                    {"updated", static_cast<double>(std::time(nullptr))},
                    {"driver", {{"pid", ::getpid()}, {"host", host}}},
                    {"progress", progress_},
                    {"workers", workers},
                    {"failures", failures}};
  try {
    write_atomically(file_, status.dump() + "\n");
  } catch (const std::exception&) {
    // A dashboard's view is not worth failing a run for; the next write tries again.
  }
}

}  // namespace cohort::train

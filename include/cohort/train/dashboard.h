/// \file
/// A live dashboard of runs (Ray's dashboard): an HTTP server over a storage path's run
/// directories and Tune experiments. Its page (charts from uPlot, compiled in: no network) shows
/// each run's workers (rank, host, pid, state, device, step, step time, samples/s, ingest wait,
/// memory; GPU memory and utilisation through NVML where a worker runs on a GPU), its loss and
/// accuracy curves, checkpoints, failures and restarts, and an experiment's
/// trials; it updates every second. `/metrics` serves the same figures in Prometheus's text format.
///
/// It reads only files: a run's driver keeps `<run>/status.json` current (its workers, updated
/// every second), beside metrics.jsonl, result.json and checkpoint_manager.json. So the same server
/// shows a run from its driver (RunConfig::dashboard) or from another process (`cohort dashboard`),
/// running or finished.
#pragma once
#include <filesystem>
#include <memory>
#include <string>

#include "cohort/train/config.h"

namespace cohort::train {

/// The live dashboard of a storage path's runs and experiments, served over HTTP while it lives:
/// the page, its JSON API and Prometheus' `/metrics`.
class Dashboard {
 public:
  /// Serves the runs under `storage_path` on options.host:options.port until destroyed. A port in
  /// use, or a host that is not an address of this machine, is a UsageError naming it and the fix.
  Dashboard(std::filesystem::path storage_path, const DashboardOptions& options);
  ~Dashboard();
  Dashboard(const Dashboard&) = delete;
  Dashboard& operator=(const Dashboard&) = delete;

  /// The port it serves on (the one chosen when options.port was 0).
  int port() const;
  /// "http://127.0.0.1:8265/"; off loopback with its token ("http://10.0.0.1:8265/?token=...").
  std::string url() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// The Prometheus text (exposition format 0.0.4) of the runs under `storage_path`: per run its
/// training iteration, loss, samples/s, ingest and communication wait, restarts, and per rank its
/// step time, memory and GPU memory and utilisation.
std::string prometheus_metrics(const std::filesystem::path& storage_path);

/// Where a run's driver keeps its live state for dashboards.
inline constexpr const char* kStatusFile = "status.json";

}  // namespace cohort::train

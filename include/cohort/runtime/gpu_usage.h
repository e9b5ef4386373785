/// \file
/// GPU memory and utilisation of this host's processes, through NVIDIA's management library (NVML)
/// loaded at run time from the driver's libnvidia-ml.so.1: no build dependency, and on a host
/// without an NVIDIA driver simply nothing to report.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace cohort::runtime {

/// What a process holds of the GPUs: memory and the busiest GPU's utilisation.
struct GpuProcessUsage {
  double memory_mb = 0;    ///< device memory the process holds, summed over the GPUs it uses
  double utilization = 0;  ///< percent of time a kernel ran over NVML's last sample period: the
                           // busiest of those GPUs
};

/// One loaded NVML. Thread-safe.
class Nvml {
 public:
  /// Loads `library` (a file name the dynamic loader searches, or a path) and initialises NVML.
  /// Never throws: a missing library, symbol or driver makes available() false and error() say
  /// why.
  explicit Nvml(const std::string& library = "libnvidia-ml.so.1");
  ~Nvml();
  Nvml(const Nvml&) = delete;
  Nvml& operator=(const Nvml&) = delete;

  /// Whether NVML loaded and initialised.
  bool available() const;
  /// Why not, when available() is false.
  const std::string& error() const;
  /// The usage of each of `pids` that holds memory on some GPU of this host (the others are left
  /// out): every device's running compute processes, matched by pid, so that no CUDA device index
  /// (which CUDA_VISIBLE_DEVICES renumbers) needs mapping. Empty when NVML is not available.
  std::map<int, GpuProcessUsage> usage_of(const std::vector<int>& pids) const;

  /// The process's NVML, loaded on first use from $COHORT_NVML_LIBRARY when set, else
  /// libnvidia-ml.so.1.
  static const Nvml& instance();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace cohort::runtime

#include "cohort/runtime/gpu_usage.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <optional>

#include "cohort/runtime/environment.h"

namespace cohort::runtime {

// NVML's C interface, the part used here, as nvml.h declares it (stable since the _v2 entry
// points; Debian ships no nvml.h outside non-free). A named namespace: GCC 13 crashes on a
// member of Nvml::Impl whose type lives in an unnamed one.
namespace nvml_abi {
using NvmlReturn = int;
using NvmlDevice = void*;
constexpr NvmlReturn kSuccess = 0;
constexpr NvmlReturn kInsufficientSize = 7;
constexpr unsigned long long kValueNotAvailable = ~0ULL;
struct NvmlProcessInfoV1 {  // nvmlProcessInfo_v1_t
  unsigned int pid;
  unsigned long long usedGpuMemory;
};
struct NvmlProcessInfo {  // nvmlProcessInfo_t (_v2 and _v3 of GetComputeRunningProcesses)
  unsigned int pid;
  unsigned long long usedGpuMemory;
  unsigned int gpuInstanceId;
  unsigned int computeInstanceId;
};
struct NvmlUtilization {  // nvmlUtilization_t
  unsigned int gpu;
  unsigned int memory;
};

}  // namespace nvml_abi

using namespace nvml_abi;

struct Nvml::Impl {
  void* handle = nullptr;
  std::string error;
  mutable std::mutex mutex;  // NVML is thread-safe; this keeps one enumeration at a time
  NvmlReturn (*init)() = nullptr;
  NvmlReturn (*shutdown)() = nullptr;
  NvmlReturn (*device_count)(unsigned int*) = nullptr;
  NvmlReturn (*device_by_index)(unsigned int, NvmlDevice*) = nullptr;
  NvmlReturn (*utilization)(NvmlDevice, NvmlUtilization*) = nullptr;
  // The newest of GetComputeRunningProcesses_v3, _v2 (both of NvmlProcessInfo) and the first
  // (NvmlProcessInfoV1) that the library has.
  NvmlReturn (*processes)(NvmlDevice, unsigned int*, NvmlProcessInfo*) = nullptr;
  NvmlReturn (*processes_v1)(NvmlDevice, unsigned int*, NvmlProcessInfoV1*) = nullptr;
  bool initialised = false;

  template <typename F>
  bool find(F& f, const char* name) {
    f = reinterpret_cast<F>(::dlsym(handle, name));
    return f != nullptr;
  }

  // Every process on `device` as (pid, bytes), growing the buffer when NVML says it is short.
  template <typename Info, typename Call>
  static std::vector<std::pair<int, unsigned long long>> list(Call call, NvmlDevice device) {
    std::vector<Info> infos(32);
    for (int attempt = 0; attempt < 4; ++attempt) {
      auto count = static_cast<unsigned int>(infos.size());
      const NvmlReturn rc = call(device, &count, infos.data());
      if (rc == kInsufficientSize) {
        infos.resize(static_cast<size_t>(count) + 16);  // processes may start meanwhile
        continue;
      }
      std::vector<std::pair<int, unsigned long long>> out;
      if (rc != kSuccess) return out;
      for (unsigned int i = 0; i < count && i < infos.size(); ++i)
        out.emplace_back(static_cast<int>(infos[i].pid), infos[i].usedGpuMemory);
      return out;
    }
    return {};
  }
};

Nvml::Nvml(const std::string& library) : impl_(std::make_unique<Impl>()) {
  auto& s = *impl_;
  s.handle = ::dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (s.handle == nullptr) {
    const char* why = ::dlerror();
    s.error = "cannot load " + library + ": " + (why != nullptr ? why : "unknown error") +
              " (no NVIDIA driver on this host?)";
    return;
  }
  const bool found = s.find(s.init, "nvmlInit_v2") && s.find(s.shutdown, "nvmlShutdown") &&
                     s.find(s.device_count, "nvmlDeviceGetCount_v2") &&
                     s.find(s.device_by_index, "nvmlDeviceGetHandleByIndex_v2") &&
                     s.find(s.utilization, "nvmlDeviceGetUtilizationRates") &&
                     (s.find(s.processes, "nvmlDeviceGetComputeRunningProcesses_v3") ||
                      s.find(s.processes, "nvmlDeviceGetComputeRunningProcesses_v2") ||
                      s.find(s.processes_v1, "nvmlDeviceGetComputeRunningProcesses"));
  if (!found) {
    s.error = library + " lacks an NVML function cohort uses: is it NVIDIA's libnvidia-ml?";
    return;
  }
  if (const NvmlReturn rc = s.init(); rc != kSuccess) {
    s.error = "nvmlInit_v2 failed with NVML error " + std::to_string(rc) +
              " (is the NVIDIA driver loaded?)";
    return;
  }
  s.initialised = true;
}

Nvml::~Nvml() {
  if (impl_->initialised) impl_->shutdown();
  if (impl_->handle != nullptr) ::dlclose(impl_->handle);
}

bool Nvml::available() const { return impl_->initialised; }
const std::string& Nvml::error() const { return impl_->error; }

std::map<int, GpuProcessUsage> Nvml::usage_of(const std::vector<int>& pids) const {
  std::map<int, GpuProcessUsage> out;
  const auto& s = *impl_;
  if (!s.initialised || pids.empty()) return out;
  std::lock_guard lock(s.mutex);
  unsigned int devices = 0;
  if (s.device_count(&devices) != kSuccess) return out;
  for (unsigned int d = 0; d < devices; ++d) {
    NvmlDevice device = nullptr;
    if (s.device_by_index(d, &device) != kSuccess) continue;
    const auto processes = s.processes != nullptr
                               ? Impl::list<NvmlProcessInfo>(s.processes, device)
                               : Impl::list<NvmlProcessInfoV1>(s.processes_v1, device);
    std::optional<double> busy;  // read once per device, where one of `pids` runs
    for (const auto& [pid, bytes] : processes) {
      if (std::find(pids.begin(), pids.end(), pid) == pids.end()) continue;
      if (!busy) {
        NvmlUtilization rates{};
        busy = s.utilization(device, &rates) == kSuccess ? rates.gpu : 0.0;
      }
      auto& usage = out[pid];
      if (bytes != kValueNotAvailable)
        usage.memory_mb += static_cast<double>(bytes) / (1024.0 * 1024.0);
      usage.utilization = std::max(usage.utilization, *busy);
    }
  }
  return out;
}

const Nvml& Nvml::instance() {
  static const Nvml nvml([] {
    const char* library = std::getenv(kNvmlLibraryVar);
    return std::string(library != nullptr && *library != '\0' ? library : "libnvidia-ml.so.1");
  }());
  return nvml;
}

}  // namespace cohort::runtime

// A stand-in for NVIDIA's libnvidia-ml.so.1 with NVML's C interface (the functions
// runtime::Nvml uses), for hosts without a GPU: two devices, the calling process on both.
//   device 0: the caller (1536 MiB), pid 1 (memory not available); utilisation 70 %
//   device 1: 40 other processes (more than a first buffer holds), then the caller (512 MiB);
//             utilisation 35 %
#include <unistd.h>

#include <cstring>

namespace {

struct ProcessInfo {
  unsigned int pid;
  unsigned long long usedGpuMemory;
  unsigned int gpuInstanceId;
  unsigned int computeInstanceId;
};
struct Utilization {
  unsigned int gpu;
  unsigned int memory;
};
constexpr unsigned long long kMiB = 1024ULL * 1024ULL;
int devices[2];  // the handles are these addresses
bool initialised = false;

}  // namespace

extern "C" {

int nvmlInit_v2() {
  initialised = true;
  return 0;
}
int nvmlShutdown() {
  initialised = false;
  return 0;
}
int nvmlDeviceGetCount_v2(unsigned int* count) {
  if (!initialised) return 1;  // NVML_ERROR_UNINITIALIZED
  *count = 2;
  return 0;
}
int nvmlDeviceGetHandleByIndex_v2(unsigned int index, void** device) {
  if (index >= 2) return 2;  // NVML_ERROR_INVALID_ARGUMENT
  *device = &devices[index];
  return 0;
}
int nvmlDeviceGetUtilizationRates(void* device, Utilization* rates) {
  rates->gpu = device == &devices[0] ? 70 : 35;
  rates->memory = 0;
  return 0;
}
int nvmlDeviceGetComputeRunningProcesses_v3(void* device, unsigned int* count, ProcessInfo* infos) {
  ProcessInfo all[41];
  unsigned int n = 0;
  const auto self = static_cast<unsigned int>(::getpid());
  if (device == &devices[0]) {
    all[n++] = {self, 1536 * kMiB, 0, 0};
    all[n++] = {1, ~0ULL, 0, 0};
  } else {
    for (unsigned int i = 0; i < 40; ++i) all[n++] = {100000 + i, 64 * kMiB, 0, 0};
    all[n++] = {self, 512 * kMiB, 0, 0};
  }
  if (*count < n) {
    *count = n;
    return 7;  // NVML_ERROR_INSUFFICIENT_SIZE
  }
  std::memcpy(infos, all, n * sizeof(ProcessInfo));
  *count = n;
  return 0;
}

}  // extern "C"

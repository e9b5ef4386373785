#include "cohort/runtime/gpus.h"

#include <torch/cuda.h>

#include <cstdlib>
#include <sstream>

#include "cohort/error.h"

namespace cohort::runtime {

std::vector<std::string> visible_gpus() {
  std::vector<std::string> gpus;
  if (const char* listed = std::getenv("CUDA_VISIBLE_DEVICES")) {
    std::stringstream in(listed);
    std::string entry;
    while (std::getline(in, entry, ',')) {
      // CUDA stops at the first entry that names no device ("-1" hides every GPU).
      if (entry.empty() || entry[0] == '-') break;
      gpus.push_back(entry);
    }
    return gpus;
  }
  const int count = torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0;
  for (int i = 0; i < count; ++i) gpus.push_back(std::to_string(i));
  return gpus;
}

int check_gpu_request(bool use_gpu, int gpus_per_worker, int local_workers,
                      const std::vector<std::string>& visible) {
  if (gpus_per_worker < 0) {
    throw UsageError("resources_per_worker.gpus = " + std::to_string(gpus_per_worker) +
                     " is negative: give 0 or more GPUs per worker");
  }
  if (!use_gpu) {
    if (gpus_per_worker > 0) {
      throw UsageError("resources_per_worker.gpus = " + std::to_string(gpus_per_worker) +
                       " without use_gpu: set use_gpu (--use-gpu) to train on GPUs, or give 0");
    }
    return 0;
  }
  const int per_worker = gpus_per_worker == 0 ? 1 : gpus_per_worker;
  if (!torch::cuda::is_available()) {
    throw UsageError(
        "use_gpu is set but this libtorch sees no CUDA device (" +
        std::string(visible.empty() && std::getenv("CUDA_VISIBLE_DEVICES")
                        ? "CUDA_VISIBLE_DEVICES hides them"
                        : "a CPU build, or no GPU on this host") +
        "): unset use_gpu (drop --use-gpu), or run a CUDA build of cohort on a GPU host");
  }
  const auto needed = static_cast<size_t>(per_worker) * static_cast<size_t>(local_workers);
  if (needed > visible.size()) {
    std::string listed;
    for (const auto& g : visible) listed += (listed.empty() ? "" : ",") + g;
    throw UsageError(
        std::to_string(local_workers) + " workers x " + std::to_string(per_worker) + " GPUs need " +
        std::to_string(needed) + " GPUs, but this node has " + std::to_string(visible.size()) +
        " (" + (listed.empty() ? "none" : listed) +
        "): lower the workers per node or resources_per_worker.gpus (--gpus-per-worker)");
  }
  return per_worker;
}

std::string gpus_of_slot(const std::vector<std::string>& visible, int slot, int per_worker) {
  std::string out;
  for (int i = 0; i < per_worker; ++i) {
    const auto index = static_cast<size_t>(slot * per_worker + i);
    if (index >= visible.size()) {
      throw UsageError("worker slot " + std::to_string(slot) + " needs GPU #" +
                       std::to_string(index) + " but the node has " +
                       std::to_string(visible.size()) + " GPUs");
    }
    out += (out.empty() ? "" : ",") + visible[index];
  }
  return out;
}

int device_index_of_local_rank(int local_rank, int per_worker, int visible_count) {
  if (visible_count == per_worker) return 0;
  const int index = local_rank * per_worker;
  if (index + per_worker > visible_count) {
    throw UsageError(
        "local rank " + std::to_string(local_rank) + " with " + std::to_string(per_worker) +
        " GPUs per worker needs GPUs " + std::to_string(index) + "-" +
        std::to_string(index + per_worker - 1) + " but this node shows " +
        std::to_string(visible_count) +
        ": start fewer processes per node, or give each its own GPUs (CUDA_VISIBLE_DEVICES)");
  }
  return index;
}

}  // namespace cohort::runtime

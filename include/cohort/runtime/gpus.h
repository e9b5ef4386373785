#pragma once
#include <string>
#include <vector>

namespace cohort::runtime {

/// The GPUs of this node that its workers share out: CUDA_VISIBLE_DEVICES's entries when it is
/// set, else "0" .. "n-1" for the n devices libtorch sees (none in a CPU build).
std::vector<std::string> visible_gpus();

/// Checks a GPU request against this node before any worker starts: use_gpu needs a CUDA
/// libtorch and a device, and `local_workers` x `gpus_per_worker` must fit in `visible`.
/// UsageError naming the value and the fix otherwise. Returns the GPUs per worker (use_gpu with 0
/// asks for 1, as Ray's use_gpu does).
int check_gpu_request(bool use_gpu, int gpus_per_worker, int local_workers,
                      const std::vector<std::string>& visible);

/// The CUDA_VISIBLE_DEVICES of the worker in local slot `slot`: its `per_worker` GPUs of
/// `visible`, in order, so that it sees them as devices 0 .. per_worker-1.
std::string gpus_of_slot(const std::vector<std::string>& visible, int slot, int per_worker);

/// The CUDA device index a rank uses: 0 when it sees only its own GPUs (the driver's workers,
/// or a launcher that binds GPUs per task), else its local rank's first GPU among the node's.
int device_index_of_local_rank(int local_rank, int per_worker, int visible_count);

}  // namespace cohort::runtime

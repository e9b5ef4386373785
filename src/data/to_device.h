// Moves a batch's tensor to the device it is trained on. Private to data/.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

namespace cohort::data {

// A host tensor bound for a GPU is pinned first, so that the copy is asynchronous (it overlaps
// the step running on the device) rather than staged through pageable memory.
inline at::Tensor to_device(const at::Tensor& tensor, c10::Device device) {
  if (tensor.device() == device) return tensor;
  if (device.is_cuda() && tensor.is_cpu() && !tensor.is_pinned()) {
    return tensor.pin_memory().to(device, /*non_blocking=*/true);
  }
  return tensor.to(device, /*non_blocking=*/true);
}

}  // namespace cohort::data

#include "cohort/optim/precision.h"

#include <ATen/autocast_mode.h>
#include <torch/version.h>

#include "cohort/error.h"

namespace cohort::optim {
namespace {

// libtorch 2.x keys autocast's state by device type; 1.13 has one function pair per device.
bool autocast_enabled(c10::DeviceType type) {
#if TORCH_VERSION_MAJOR >= 2
  return at::autocast::is_autocast_enabled(type);
#else
  return type == c10::DeviceType::CPU ? at::autocast::is_cpu_enabled() : at::autocast::is_enabled();
#endif
}

void set_autocast_enabled(c10::DeviceType type, bool enabled) {
#if TORCH_VERSION_MAJOR >= 2
  at::autocast::set_autocast_enabled(type, enabled);
#else
  if (type == c10::DeviceType::CPU) {
    at::autocast::set_cpu_enabled(enabled);
  } else {
    at::autocast::set_enabled(enabled);
  }
#endif
}

c10::ScalarType autocast_dtype(c10::DeviceType type) {
#if TORCH_VERSION_MAJOR >= 2
  return at::autocast::get_autocast_dtype(type);
#else
  return type == c10::DeviceType::CPU ? at::autocast::get_autocast_cpu_dtype()
                                      : at::autocast::get_autocast_gpu_dtype();
#endif
}

void set_autocast_dtype(c10::DeviceType type, c10::ScalarType dtype) {
#if TORCH_VERSION_MAJOR >= 2
  at::autocast::set_autocast_dtype(type, dtype);
#else
  if (type == c10::DeviceType::CPU) {
    at::autocast::set_autocast_cpu_dtype(dtype);
  } else {
    at::autocast::set_autocast_gpu_dtype(dtype);
  }
#endif
}

}  // namespace

AutocastGuard::AutocastGuard(Precision precision, const c10::Device& device) {
  if (precision == Precision::kFp32) return;
  check_precision_supported(precision, device);
  device_type_ = device.type();
  previous_enabled_ = autocast_enabled(device_type_);
  previous_dtype_ = autocast_dtype(device_type_);
  set_autocast_enabled(device_type_, true);
  set_autocast_dtype(device_type_, scalar_type_of(precision));
  at::autocast::increment_nesting();
  active_ = true;
}

AutocastGuard::~AutocastGuard() {
  if (!active_) return;
  // The outermost guard drops the casts autocast cached for this forward (as Python's exit).
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  set_autocast_enabled(device_type_, previous_enabled_);
  set_autocast_dtype(device_type_, previous_dtype_);
}

namespace {

void apply(const AutocastState& s) {
  set_autocast_enabled(c10::DeviceType::CPU, s.cpu_enabled);
  set_autocast_dtype(c10::DeviceType::CPU, s.cpu_dtype);
  set_autocast_enabled(c10::DeviceType::CUDA, s.cuda_enabled);
  set_autocast_dtype(c10::DeviceType::CUDA, s.cuda_dtype);
}

}  // namespace

AutocastState AutocastState::current() {
  return {.cpu_enabled = autocast_enabled(c10::DeviceType::CPU),
          .cpu_dtype = autocast_dtype(c10::DeviceType::CPU),
          .cuda_enabled = autocast_enabled(c10::DeviceType::CUDA),
          .cuda_dtype = autocast_dtype(c10::DeviceType::CUDA)};
}

AutocastStateGuard::AutocastStateGuard(const AutocastState& state)
    : previous_(AutocastState::current()) {
  apply(state);
  if (state.cpu_enabled || state.cuda_enabled) {
    at::autocast::increment_nesting();
    nested_ = true;
  }
}

AutocastStateGuard::~AutocastStateGuard() {
  if (nested_ && at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  apply(previous_);
}

}  // namespace cohort::optim

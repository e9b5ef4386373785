#include "cohort/optim/precision.h"

#include <ATen/autocast_mode.h>
#include <torch/version.h>

#include <sstream>

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

Precision precision_from_string(const std::string& name) {
  if (name == "fp32" || name == "float32") return Precision::kFp32;
  if (name == "bf16" || name == "bfloat16") return Precision::kBf16;
  if (name == "fp16" || name == "float16") return Precision::kFp16;
  throw UsageError("unknown precision '" + name + "': choose fp32, bf16 or fp16");
}

std::string to_string(Precision precision) {
  switch (precision) {
    case Precision::kBf16:
      return "bf16";
    case Precision::kFp16:
      return "fp16";
    case Precision::kFp32:
      break;
  }
  return "fp32";
}

c10::ScalarType scalar_type_of(Precision precision) {
  switch (precision) {
    case Precision::kBf16:
      return c10::ScalarType::BFloat16;
    case Precision::kFp16:
      return c10::ScalarType::Half;
    case Precision::kFp32:
      break;
  }
  return c10::ScalarType::Float;
}

void check_precision_supported(Precision precision, const c10::Device& device) {
  if (precision == Precision::kFp16 && !device.is_cuda()) {
    throw UsageError(
        "precision fp16 needs a GPU: autocast on " + device.str() +
        " has no float16. Use bf16 instead (precision = \"bf16\", --precision bf16), which needs "
        "no loss scaling, or train on a GPU (use_gpu, --use-gpu)");
  }
  if (precision != Precision::kFp32 && !device.is_cpu() && !device.is_cuda()) {
    throw UsageError("precision " + to_string(precision) + " is not supported on " + device.str() +
                     ": autocast serves CPU and CUDA devices; use fp32");
  }
}

void LossScalerOptions::validate() const {
  if (!(initial_scale > 0))
    throw UsageError("loss scaler initial_scale " + format_number(initial_scale) + " must be > 0");
  if (growth_interval < 1)
    throw UsageError("loss scaler growth_interval " + std::to_string(growth_interval) +
                     " must be >= 1");
  if (!(growth_factor > 1))
    throw UsageError("loss scaler growth_factor " + format_number(growth_factor) + " must be > 1");
  if (!(backoff_factor > 0 && backoff_factor < 1))
    throw UsageError("loss scaler backoff_factor " + format_number(backoff_factor) +
                     " must be in (0, 1)");
  if (hysteresis < 1)
    throw UsageError("loss scaler hysteresis " + std::to_string(hysteresis) + " must be >= 1");
  if (!(min_scale > 0))
    throw UsageError("loss scaler min_scale " + format_number(min_scale) + " must be > 0");
  if (min_scale > initial_scale)
    throw UsageError("loss scaler min_scale " + format_number(min_scale) +
                     " must not exceed initial_scale " + format_number(initial_scale));
}

void to_json(Json& j, const LossScalerOptions& o) {
  j = Json{{"initial_scale", o.initial_scale}, {"growth_interval", o.growth_interval},
           {"growth_factor", o.growth_factor}, {"backoff_factor", o.backoff_factor},
           {"hysteresis", o.hysteresis},       {"min_scale", o.min_scale}};
}

void from_json(const Json& j, LossScalerOptions& o) {
  const LossScalerOptions d;
  o = {.initial_scale = json_field(j, "initial_scale", d.initial_scale),
       .growth_interval = json_field(j, "growth_interval", d.growth_interval),
       .growth_factor = json_field(j, "growth_factor", d.growth_factor),
       .backoff_factor = json_field(j, "backoff_factor", d.backoff_factor),
       .hysteresis = json_field(j, "hysteresis", d.hysteresis),
       .min_scale = json_field(j, "min_scale", d.min_scale)};
}

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

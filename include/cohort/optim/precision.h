#pragma once
#include <cstdint>
#include <string>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include "cohort/json.h"

namespace cohort::optim {

/// The numerics of a training step. kFp32: everything in float32. kBf16 / kFp16: the forward runs
/// under autocast (matrix products and convolutions in the low precision, reductions and losses in
/// float32) while parameters, gradients and optimizer state stay float32. fp16 needs a loss scaler
/// (LossScaler) and a GPU: CPU autocast has no float16.
enum class Precision { kFp32, kBf16, kFp16 };

/// "fp32", "bf16" or "fp16" (also "float32", "bfloat16", "float16"); UsageError listing them.
Precision precision_from_string(const std::string& name);
/// "fp32", "bf16" or "fp16".
std::string to_string(Precision precision);
/// The autocast dtype: kFloat for kFp32.
c10::ScalarType scalar_type_of(Precision precision);

/// UsageError when `device` cannot train at `precision`: fp16 on a CPU names bf16 as the fix.
void check_precision_supported(Precision precision, const c10::Device& device);

/// Dynamic loss scaling for fp16 training (DeepSpeed's defaults and names).
struct LossScalerOptions {
  /// The first scale: 2^16 (DeepSpeed: 2^initial_scale_power).
  double initial_scale = 65536.0;
  /// After growth_interval steps in a row without an overflow the scale is multiplied by
  /// growth_factor (DeepSpeed's loss_scale_window).
  int64_t growth_interval = 1000;
  double growth_factor = 2.0;  ///< the factor the scale grows by
  /// An overflow skips the step; the scale is multiplied by backoff_factor once `hysteresis`
  /// overflows have come since the last growth (hysteresis 1: at every overflow).
  double backoff_factor = 0.5;
  int hysteresis = 2;  ///< overflows before the scale backs off
  /// The scale never drops below this.
  double min_scale = 1.0;

  /// UsageError naming the first option out of range.
  void validate() const;
  /// Every option equal.
  bool operator==(const LossScalerOptions&) const = default;
};
/// The options as JSON by their names (a worker's spec, a plan's config) and back: a missing key
/// keeps its default, a value of the wrong type is a UsageError naming it.
void to_json(Json& json, const LossScalerOptions& options);
/// LossScalerOptions from JSON (see to_json).
void from_json(const Json& json, LossScalerOptions& options);

/// Autocast for the forward pass while it lives (PyTorch's torch.autocast): operations on
/// `device`'s type run in `precision` where autocast's lists say so. Nests; a no-op for kFp32.
/// Run backward after the guard ends, as in PyTorch.
class AutocastGuard {
 public:
  /// Starts autocast on `device`'s type at `precision`.
  AutocastGuard(Precision precision, const c10::Device& device);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  bool active_ = false;
  c10::DeviceType device_type_ = c10::DeviceType::CPU;
  bool previous_enabled_ = false;
  c10::ScalarType previous_dtype_ = c10::ScalarType::Float;
};

/// Autocast's settings of the calling thread for the CPU and for CUDA: whether each is on and
/// its type. Captured where a forward runs, applied where it runs again (a checkpointed layer's
/// recomputation in backward, on an autograd thread that has autocast off).
struct AutocastState {
  bool cpu_enabled = false;                               ///< CPU autocast on
  c10::ScalarType cpu_dtype = c10::ScalarType::BFloat16;  ///< its lower-precision type
  bool cuda_enabled = false;                              ///< CUDA autocast on
  c10::ScalarType cuda_dtype = c10::ScalarType::Half;     ///< its lower-precision type
  /// The calling thread's settings.
  static AutocastState current();
};

/// Applies an AutocastState to the calling thread while it lives, then puts the thread's own
/// back; autocast's cache of cast weights is dropped when the outermost autocast scope ends, as
/// AutocastGuard does.
class AutocastStateGuard {
 public:
  /// Applies `state`.
  explicit AutocastStateGuard(const AutocastState& state);
  ~AutocastStateGuard();
  AutocastStateGuard(const AutocastStateGuard&) = delete;
  AutocastStateGuard& operator=(const AutocastStateGuard&) = delete;

 private:
  AutocastState previous_;
  bool nested_ = false;
};

}  // namespace cohort::optim

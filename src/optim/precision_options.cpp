// Precision's names and the loss scaler's options: what a plan, a worker's spec and DeepSpeed JSON
// read, without libtorch's tensor headers (the fuzz targets compile it); autocast is precision.cpp.
#include "cohort/optim/precision.h"

#include "cohort/error.h"

namespace cohort::optim {

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

}  // namespace cohort::optim

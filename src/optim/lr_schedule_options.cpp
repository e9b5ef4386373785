#include "cohort/optim/lr_schedule_options.h"

#include <algorithm>
#include <cmath>

#include "cohort/error.h"

namespace cohort::optim {

void LrScheduleOptions::validate() const {
  if (warmup_steps < 0)
    throw UsageError("lr schedule warmup_steps " + std::to_string(warmup_steps) + " must be >= 0");
  if (warmup_type != "linear" && warmup_type != "log")
    throw UsageError("unknown lr warmup type '" + warmup_type + "': choose linear or log");
  if (!(warmup_start_ratio >= 0 && warmup_start_ratio <= 1))
    throw UsageError("lr schedule warmup_start_ratio " + format_number(warmup_start_ratio) +
                     " must be in [0, 1]");
  if (decay != "none" && decay != "cosine" && decay != "linear" && decay != "step")
    throw UsageError("unknown lr decay '" + decay + "': choose none, cosine, linear or step");
  if ((decay == "cosine" || decay == "linear") && total_steps <= warmup_steps)
    throw UsageError("lr decay " + decay + " needs total_steps (" + std::to_string(total_steps) +
                     ") greater than warmup_steps (" + std::to_string(warmup_steps) + ")");
  if (decay == "step" && step_size < 1)
    throw UsageError("lr decay step needs step_size >= 1, got " + std::to_string(step_size));
  if (decay == "step" && !(gamma > 0 && gamma <= 1))
    throw UsageError("lr decay step gamma " + format_number(gamma) + " must be in (0, 1]");
  if (!(min_lr_ratio >= 0 && min_lr_ratio <= 1))
    throw UsageError("lr schedule min_lr_ratio " + format_number(min_lr_ratio) +
                     " must be in [0, 1]");
}

double LrScheduleOptions::factor(int64_t step) const {
  if (step < warmup_steps) {
    const double way = warmup_type == "log"
                           ? std::log(static_cast<double>(step + 2)) /
                                 std::log(static_cast<double>(warmup_steps + 1))
                           : static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
    return warmup_start_ratio + (1.0 - warmup_start_ratio) * way;
  }
  const double after = static_cast<double>(step - warmup_steps);
  if (decay == "step") return std::pow(gamma, std::floor(after / static_cast<double>(step_size)));
  if (decay == "none") return 1.0;
  const double progress =
      std::clamp(after / static_cast<double>(total_steps - warmup_steps), 0.0, 1.0);
  const double shape = decay == "cosine" ? 0.5 * (1.0 + std::cos(M_PI * progress)) : 1.0 - progress;
  return min_lr_ratio + (1.0 - min_lr_ratio) * shape;
}

void to_json(Json& j, const LrScheduleOptions& o) {
  j = Json{{"warmup_steps", o.warmup_steps},
           {"warmup_type", o.warmup_type},
           {"warmup_start_ratio", o.warmup_start_ratio},
           {"decay", o.decay},
           {"total_steps", o.total_steps},
           {"step_size", o.step_size},
           {"gamma", o.gamma},
           {"min_lr_ratio", o.min_lr_ratio}};
}

void from_json(const Json& j, LrScheduleOptions& o) {
  const LrScheduleOptions d;
  o.warmup_steps = json_field(j, "warmup_steps", d.warmup_steps);
  o.warmup_type = json_field(j, "warmup_type", d.warmup_type);
  o.warmup_start_ratio = json_field(j, "warmup_start_ratio", d.warmup_start_ratio);
  o.decay = json_field(j, "decay", d.decay);
  o.total_steps = json_field(j, "total_steps", d.total_steps);
  o.step_size = json_field(j, "step_size", d.step_size);
  o.gamma = json_field(j, "gamma", d.gamma);
  o.min_lr_ratio = json_field(j, "min_lr_ratio", d.min_lr_ratio);
}

}  // namespace cohort::optim

/// \file
/// The options of a learning-rate schedule, without libtorch (DeepSpeed JSON, plans and their
/// fuzz targets read them); optim::LrScheduler applies them to an optimizer.
#pragma once
#include <cstdint>
#include <string>

#include "cohort/json.h"

namespace cohort::optim {

/// A learning-rate schedule: linear warmup, then a decay, as a factor of each param group's lr.
struct LrScheduleOptions {
  /// The first warmup_steps steps ramp up to the full lr from warmup_start_ratio of it:
  /// "linear" (step s uses (s+1)/warmup of the way) or "log" (log(s+2)/log(warmup+1) of it,
  /// DeepSpeed's WarmupLR default).
  int64_t warmup_steps = 0;
  std::string warmup_type = "linear";  ///< "linear" or "log"
  double warmup_start_ratio = 0.0;     ///< the warmup's first factor
  /// After the warmup: "none" (constant), "cosine" or "linear" (down to min_lr_ratio at
  /// total_steps, then held), or "step" (times gamma every step_size steps).
  std::string decay = "none";
  /// The step where cosine and linear decay end; needed by them.
  int64_t total_steps = 0;
  int64_t step_size = 0;      ///< "step": needed by it
  double gamma = 0.1;         ///< "step"
  double min_lr_ratio = 0.0;  ///< the factor cosine and linear decay end at

  /// UsageError naming the first option out of range.
  void validate() const;
  /// The factor of the lr used by step `step` (0: the first).
  double factor(int64_t step) const;
};

/// The options as JSON (e.g. a Trainer's train_loop_config, for the workers) and back; a missing
/// key keeps its default, a value of the wrong type is a UsageError naming it.
void to_json(Json& json, const LrScheduleOptions& options);
/// LrScheduleOptions from JSON (see to_json).
void from_json(const Json& json, LrScheduleOptions& options);

}  // namespace cohort::optim

#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <torch/optim/optimizer.h>

#include "cohort/optim/state_dict.h"

namespace cohort::optim {

/// The name of the learning-rate schedule's part in a checkpoint (train::save_state's files).
inline constexpr const char* kLrSchedulePart = "lr_schedule";

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

/// Sets every param group's lr by the schedule, step by step (PyTorch's LambdaLR over the
/// options' factor). The factor is applied as a ratio to the lr the group has, so a change made
/// in between (train::linear_lr_scaling after an elastic restart) is kept.
///
///   LrScheduler schedule(optimizer, {.warmup_steps = 100, .decay = "cosine", .total_steps = N});
///   ... optimizer.step(); schedule.step();
///
/// Resuming: construct it after loading the checkpoint (whose lr already has the factor) with
/// the number of steps done: it then leaves the lr as loaded. Or load its own state (a Stateful
/// part of values only: the steps done and each group's lr before the factor; checkpoints keep it
/// as part kLrSchedulePart).
class LrScheduler : public Stateful {
 public:
  /// The schedule of `options` over `optimizer`'s param groups, `steps_done` steps in.
  LrScheduler(torch::optim::Optimizer& optimizer, LrScheduleOptions options,
              int64_t steps_done = 0);
  /// After each optimizer step: moves to the next step's lr.
  void step();
  /// Steps taken so far.
  int64_t steps_done() const { return steps_done_; }
  /// Every param group's current lr.
  std::vector<double> get_last_lr() const;

  /// "steps_done" and "base_lrs" (each group's lr before the factor), replicated: one rank
  /// writes them.
  StateDict state_dict() const override;
  /// UsageError naming what differs when `values` are not a schedule's state of as many param
  /// groups.
  void check_state(const Json& values) const override;
  /// Goes on from `state`'s step; the optimizer's lr is left as it is (loaded with its state).
  void load_state_dict(const StateDict& state) override;

 private:
  torch::optim::Optimizer& optimizer_;
  LrScheduleOptions options_;
  int64_t steps_done_;
  std::vector<double> base_lrs_;  ///< lr / factor, for a factor that reached 0
};

}  // namespace cohort::optim

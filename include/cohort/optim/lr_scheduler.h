#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <torch/optim/optimizer.h>

#include "cohort/optim/lr_schedule_options.h"
#include "cohort/optim/state_dict.h"

namespace cohort::optim {

/// The name of the learning-rate schedule's part in a checkpoint (train::save_state's files).
inline constexpr const char* kLrSchedulePart = "lr_schedule";

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

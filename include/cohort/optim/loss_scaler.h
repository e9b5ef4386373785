#pragma once
#include <cstdint>
#include <optional>

#include <torch/optim/optimizer.h>

#include "cohort/comm/process_group.h"
#include "cohort/json.h"
#include "cohort/optim/precision.h"
#include "cohort/optim/state_dict.h"

namespace cohort::optim {

/// The name of the loss scaler's part in a checkpoint (train::save_state's files).
inline constexpr const char* kLossScalerPart = "loss_scaler";

/// Scales the loss before backward so that small fp16 gradients do not flush to zero, unscales the
/// gradients before the optimizer step, and skips a step whose gradients overflowed (inf or NaN
/// on any rank: with a process group every rank agrees, so all skip alike) - PyTorch's
/// GradScaler and DeepSpeed's DynamicLossScaler in one:
///
///   scaler.scale(loss).backward();
///   scaler.step(optimizer);   // unscales; steps unless a gradient overflowed
///   scaler.update();          // adjusts the scale
///
/// A disabled scaler (fp32, bf16) passes everything through: scale(loss) is loss, step() steps.
///
/// Its state (the scale and its counters, the same on every rank) is a Stateful part of values
/// only, which checkpoints keep as part kLossScalerPart.
class LossScaler : public Stateful {
 public:
  /// A scaler with `options` that agrees on overflows over `group` (every rank skips a step
  /// together); `enabled` false passes everything through.
  explicit LossScaler(LossScalerOptions options = {},
                      std::optional<comm::ProcessGroup> group = std::nullopt, bool enabled = true);

  /// Whether it scales (fp16).
  bool enabled() const { return enabled_; }
  /// loss times the current scale.
  at::Tensor scale(const at::Tensor& loss) const;
  /// Divides the optimizer's gradients by the scale (at most once per step) and returns whether
  /// any was inf or NaN on any rank. Call it before clipping gradients.
  bool unscale(torch::optim::Optimizer& optimizer);
  /// unscale() if not done, then optimizer.step() unless a gradient overflowed. Returns whether
  /// the optimizer stepped.
  bool step(torch::optim::Optimizer& optimizer);
  /// Adjusts the scale after step(): back off on an overflow (per hysteresis), grow after
  /// growth_interval clean steps.
  void update();

  /// The current scale.
  double get_scale() const { return scale_; }
  /// Steps skipped because of an overflow, since the start (checkpointed).
  int64_t skipped_steps() const { return skipped_steps_; }
  /// The options it was made with.
  const LossScalerOptions& options() const { return options_; }

  /// The scale and its counters as values (no tensors), replicated: one rank writes them.
  StateDict state_dict() const override;
  /// UsageError naming what is missing or out of range when `values` are not a scaler's state.
  void check_state(const Json& values) const override;
  /// Takes the scale and counters of `state`'s values (checked as check_state does).
  void load_state_dict(const StateDict& state) override;

 private:
  LossScalerOptions options_;
  std::optional<comm::ProcessGroup> group_;
  bool enabled_;
  double scale_;
  int64_t clean_steps_ = 0;
  int hysteresis_left_;
  int64_t skipped_steps_ = 0;
  bool unscaled_ = false;
  bool found_inf_ = false;
};

}  // namespace cohort::optim

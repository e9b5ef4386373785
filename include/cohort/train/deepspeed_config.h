#pragma once
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "cohort/json.h"
#include "cohort/optim/lr_schedule_options.h"
#include "cohort/optim/precision.h"
#include "cohort/parallel/activation_checkpointing_policy.h"
#include "cohort/parallel/zero_options.h"

namespace cohort::train {

/// DeepSpeed's JSON configuration (ds_config.json), the keys that describe training:
///
///   train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps
///     train_batch_size == micro x accumulation x world size; any two give the third.
///   optimizer {type: Adam | AdamW | SGD, params: {lr, betas, eps, weight_decay, momentum,
///     nesterov}}   (Adam's "adam_w_mode": true is AdamW)
///   scheduler {type: WarmupLR | WarmupDecayLR, params: {warmup_min_lr, warmup_max_lr,
///     warmup_num_steps, warmup_type: log | linear, total_num_steps (WarmupDecayLR)}}
///   fp16 {enabled, loss_scale (0: dynamic), initial_scale_power, loss_scale_window,
///     hysteresis, min_loss_scale}
///   bf16 {enabled}
///   gradient_clipping
///   zero_optimization {stage, reduce_bucket_size, allgather_bucket_size, overlap_comm,
///     contiguous_gradients, stage3_prefetch_bucket_size, stage3_max_live_parameters,
///     stage3_param_persistence_threshold, mics_shard_size (sharding groups, HSDP),
///     offload_optimizer {device: none | cpu | nvme, nvme_path, pin_memory}, cpu_offload}
///   activation_checkpointing {partition_activations, cpu_checkpointing,
///     contiguous_memory_optimization, number_checkpoints, synchronize_checkpoint_boundary,
///     profile}   the block's presence checkpoints every unit of the model (every:1); its keys
///     set to true name what cohort cannot honour, listed in `unknown_keys` for the same warning
///
/// Keys that only tune DeepSpeed's own machinery and change nothing here (e.g.
/// steps_per_print, wall_clock_breakdown, zero_optimization.contiguous_gradients) are accepted;
/// unknown keys are listed in `unknown_keys`, for one warning. A value of the wrong type or out of
/// range is a UsageError naming the file and the key (exit code 2 in the CLI).
struct DeepSpeedConfig {
  int64_t train_batch_size = 0;  ///< train_batch_size: micro-batch x accumulation x data-parallel
                                 ///< workers (checked when given)
  int64_t micro_batch_size = 0;  ///< train_micro_batch_size_per_gpu
  int64_t gradient_accumulation_steps = 1;  ///< gradient_accumulation_steps

  /// "sgd", "adam" or "adamw", and its hyperparameters; unset: the optimizer's default.
  std::optional<std::string> optimizer;
  std::optional<double> lr;                        ///< optimizer.params.lr
  std::optional<std::pair<double, double>> betas;  ///< optimizer.params.betas (Adam, AdamW)
  std::optional<double> eps;                       ///< optimizer.params.eps (Adam, AdamW)
  std::optional<double> weight_decay;              ///< optimizer.params.weight_decay
  std::optional<double> momentum;                  ///< optimizer.params.momentum (SGD)
  bool nesterov = false;                           ///< optimizer.params.nesterov (SGD)

  /// The learning-rate schedule (lr is then the warmup's maximum), when a scheduler is given.
  std::optional<optim::LrScheduleOptions> schedule;

  std::string precision = "fp32";        ///< "fp16" or "bf16" when enabled
  optim::LossScalerOptions loss_scaler;  ///< fp16's loss_scale, initial_scale_power,
                                         ///< loss_scale_window, hysteresis, min_loss_scale
  double gradient_clipping = 0;          ///< gradient_clipping (0: none)
  parallel::ZeroOptions zero;  ///< zero_optimization: the stage, bucket sizes, overlap, stage 3's
                               ///< prefetch and persistence

  /// zero_optimization.offload_optimizer (or cpu_offload) as --offload-optimizer's text: none,
  /// cpu, or disk:NVME_PATH for device nvme.
  std::string offload_optimizer = "none";
  /// activation_checkpointing: every:1 when the block is there, else none.
  parallel::ActivationCheckpointing activation_checkpointing;

  /// Keys cohort does not know, and keys it cannot honour (" (not honoured)" after their name),
  /// for one warning.
  std::vector<std::string> unknown_keys;

  /// `source` names the file in messages.
  static DeepSpeedConfig from_json(const Json& config, int world_size,
                                   const std::string& source = "deepspeed config");
  /// Reads `file` (JSON); UsageError naming the file and key of a bad value.
  static DeepSpeedConfig load(const std::filesystem::path& file, int world_size);
};

}  // namespace cohort::train

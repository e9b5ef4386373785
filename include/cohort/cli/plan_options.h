/// \file
/// The flags of a train::Plan for a user's own program: one call gives it cohort train's
/// --zero-stage, --sync, --pp, --tp, --schedule, --micro-batches, --gradient-accumulation-steps,
/// --gradient-clipping, --activation-checkpointing, --cuda-graph and --precision, with their help
/// and defaults:
///
///   CLI::App app("my trainer");
///   cohort::cli::PlanOptions plan_options;
///   cohort::cli::add_plan_options(&app, plan_options);
///   CLI11_PARSE(app, argc, argv);
///   const cohort::train::Plan plan = plan_options.plan();   // UsageError naming a bad flag
///
/// add_optimizer_options does the same for the optimizer. A DeepSpeed JSON config sets the same
/// options and the optimizer's (load_deepspeed_config), and --config FILE all of a program's
/// (<cohort/cli/config_file.h>).
///
/// Needs CLI11 (Debian's libcli11-dev); the rest of cohort does not include this header.
#pragma once
#include <optional>
#include <string>

#include <CLI/CLI.hpp>

#include "cohort/json.h"
#include "cohort/optim/optimizer_options.h"
#include "cohort/optim/precision.h"
#include "cohort/parallel/sync_mode.h"
#include "cohort/parallel/zero_options.h"
#include "cohort/train/deepspeed_config.h"
#include "cohort/train/plan.h"

namespace cohort::cli {

/// The plan as flags give it: what train::Plan holds, with the sync mode, the schedule and the
/// precision by name and DiLoCo's outer optimizer apart.
struct PlanOptions {
  int pp = 1;             ///< pipeline stages (--pp)
  int tp = 1;             ///< tensor-parallel degree (--tp)
  int micro_batches = 0;  ///< per batch; 0: 2 x pp (1 without a pipeline)
  std::string schedule =
      "1f1b";  ///< the pipeline schedule (--schedule): gpipe, 1f1b, interleaved, zero-bubble
  parallel::ZeroOptions zero;  ///< stage 0: DDP
  /// ddp, local-sgd:H, diloco:H or async-ps:K (parallel::parse_sync_mode); DiLoCo's outer
  /// optimizer, unset: parallel::DiLoCo's defaults.
  std::string sync = "ddp";
  std::optional<double> outer_lr;        ///< DiLoCo's outer learning rate (--outer-lr)
  std::optional<double> outer_momentum;  ///< DiLoCo's outer momentum (--outer-momentum)
  bool nesterov = true;                  ///< DiLoCo's Nesterov momentum (--outer-nesterov)
  int64_t gradient_accumulation_steps =
      1;  ///< micro-batches per optimizer step (--gradient-accumulation-steps)
  double gradient_clipping =
      0;                    ///< the global gradient norm's limit (--gradient-clipping; 0: none)
  bool cuda_graph = false;  ///< each step one CUDA graph (--cuda-graph)
  std::string precision = "fp32";  ///< fp32, bf16 or fp16 (--precision)
  /// Which units recompute their forward in backward (--activation-checkpointing): none,
  /// every:K or layers:NAMES (parallel::parse_activation_checkpointing).
  std::string activation_checkpointing = "none";
  /// Where the optimizer state lives (--offload-optimizer): none, cpu or disk:PATH
  /// (train::parse_optimizer_offload).
  std::string offload_optimizer = "none";
  /// fp16's loss scaling: no flags; DeepSpeed JSON's "fp16" section or a config file sets it.
  optim::LossScalerOptions loss_scaler;

  /// The sync mode of --sync with DiLoCo's outer options; UsageError naming a bad value.
  parallel::SyncMode sync_mode() const;
  /// The plan of these flags, checked for `world_size` workers (0: the degrees alone) by
  /// train::Plan::validate.
  train::Plan plan(int world_size = 0) const;
};

/// The options as JSON (e.g. a Trainer's train_loop_config, for the workers) and back; a missing
/// key keeps its default, a value of the wrong type is a UsageError naming it.
void to_json(Json& json, const PlanOptions& options);
/// PlanOptions from JSON (see to_json).
void from_json(const Json& json, PlanOptions& options);

/// DeepSpeed's JSON config (e.g. a program's --deepspeed FILE) for a plan of flags: loads `file`
/// for `world_size` workers (train::DeepSpeedConfig::load), puts its plan into `options` (ZeRO,
/// fp16 or bf16 with its loss scaling, gradient clipping and accumulation, and the optimizer
/// offload and activation checkpointing where `options` choose none), says in one warning on
/// stderr which keys cohort ignores or cannot honour, and returns the config for what is the
/// program's own (the batch size, the optimizer, its learning rate and schedule). UsageError
/// naming the file and key of a bad value.
train::DeepSpeedConfig load_deepspeed_config(const std::string& file, int world_size,
                                             PlanOptions& options);

/// The same, also putting the file's optimizer section into `optimizer`: its algorithm and each
/// hyperparameter it gives.
train::DeepSpeedConfig load_deepspeed_config(const std::string& file, int world_size,
                                             PlanOptions& options,
                                             optim::OptimizerOptions& optimizer);
/// Adds the optimizer's flags to `cmd`, in the group "Training": --optimizer, --lr, --momentum,
/// --sgd-nesterov, --weight-decay and --flat-optimizer/--no-flat-optimizer (optim::make_optimizer
/// builds it).
void add_optimizer_options(CLI::App* cmd, optim::OptimizerOptions& options);
/// Adds the plan's flags to `cmd`: the precision, accumulation, clipping and capture in the group
/// "Training", the rest in "Parallelism and synchronisation".
void add_plan_options(CLI::App* cmd, PlanOptions& options);

}  // namespace cohort::cli

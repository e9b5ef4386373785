/// \file
/// The flags of a program's training loop: one call gives it cohort train's --epochs,
/// --batch-size, --max-steps, --seed, --warmup-steps and --lr-decay, with their help and
/// defaults (set the fields before the call for other defaults); then the loop's options and its
/// learning-rate schedule come from the same options on every worker:
///
///   cohort::cli::LoopOptions loop_options{.epochs = 2, .batch_size = 32};
///   cohort::cli::add_loop_options(&app, loop_options);
///   CLI11_PARSE(app, argc, argv);
///   loop_options.validate();                 // UsageError naming the flag and the fix
///   cohort::Trainer trainer(loop, scaling, run, {{"loop", loop_options}, ...}, datasets);
///   // in the loop, on every worker:
///   const auto options = config["loop"].get<cohort::cli::LoopOptions>();
///   cohort::train::EpochLoopOptions loop;
///   options.apply(loop);                     // epochs, batch size, max steps
///   auto schedule = options.lr_schedule(loop.epochs * steps_per_epoch);
///
/// Needs CLI11 (Debian's libcli11-dev), as <cohort/cli/plan_options.h>.
#pragma once
#include <cstdint>
#include <optional>
#include <string>

#include <CLI/CLI.hpp>

#include "cohort/json.h"
#include "cohort/optim/lr_schedule_options.h"
#include "cohort/train/epoch_loop.h"

namespace cohort::cli {

/// A training loop's options as flags give them.
struct LoopOptions {
  int epochs = 5;           ///< --epochs: passes over the training set
  int64_t batch_size = 64;  ///< --batch-size: rows per step per data-parallel replica
  /// --max-steps: stop after this many optimizer steps in all (0: no limit), with a checkpoint a
  /// longer run resumes from; the schedule still spans every epoch.
  int64_t max_steps = 0;
  uint64_t seed = 0;              ///< --seed: of the weights and the data order
  int64_t warmup_steps = 0;       ///< --warmup-steps: a linear lr warmup over this many steps
  std::string lr_decay = "none";  ///< --lr-decay: after the warmup, none, cosine or linear
  /// A DeepSpeed config's scheduler (train::DeepSpeedConfig::schedule): replaces --warmup-steps
  /// and --lr-decay, with its own step counts.
  std::optional<optim::LrScheduleOptions> schedule;

  /// UsageError naming the flag, its value and the fix.
  void validate() const;
  /// The learning-rate schedule of a run of `total_steps` optimizer steps: the DeepSpeed
  /// scheduler, or the warmup then the decay to 0 at total_steps (none in a run no longer than
  /// its warmup).
  optim::LrScheduleOptions lr_schedule(int64_t total_steps) const;
  /// Puts the epochs, the batch size and the step limit into `loop`.
  void apply(train::EpochLoopOptions& loop) const;
};

/// The options as JSON (e.g. in a Trainer's train_loop_config, for the workers) and back, a key
/// per field (the schedule's as "lr_schedule", when there is one); a missing key keeps its
/// default, a value of the wrong type is a UsageError naming it.
void to_json(Json& json, const LoopOptions& options);
/// LoopOptions from JSON (see to_json).
void from_json(const Json& json, LoopOptions& options);

/// Adds the loop's flags to `cmd`, in the group "Training".
void add_loop_options(CLI::App* cmd, LoopOptions& options);

}  // namespace cohort::cli

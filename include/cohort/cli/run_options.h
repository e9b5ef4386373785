/// \file
/// The flags of a run (its folder, checkpoints, snapshots, recovery, output) for a user's own
/// program: one call gives it cohort train's --storage-path, --name, --resume, --max-failures,
/// --recovery, --replace-lost, --heartbeat-timeout, --num-to-keep, --checkpoint-every-steps,
/// --async-checkpoint, --checkpoint-when-busy, --snapshot-every-steps, --snapshot-dir, --rdzv,
/// --umask, --quiet, --tensorboard, --tensorboard-histograms, --log-every-steps, --dashboard,
/// --dashboard-host and --profile-steps, with their help and defaults:
///
///   cohort::cli::RunOptions run_options;
///   cohort::cli::add_run_options(&app, run_options);
///   CLI11_PARSE(app, argc, argv);
///   cohort::RunConfig run = run_options.run_config();          // UsageError naming a bad flag
///   // in the loop, on every worker (the options in its config: {"run", run_options}):
///   cohort::train::EpochLoopOptions loop{.epochs = 5};
///   config["run"].get<cohort::cli::RunOptions>().apply(loop);  // checkpoints and snapshots
///
/// Needs CLI11 (Debian's libcli11-dev), as <cohort/cli/plan_options.h>.
#pragma once
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include <CLI/CLI.hpp>

#include "cohort/json.h"
#include "cohort/timeouts.h"
#include "cohort/train/config.h"
#include "cohort/train/epoch_loop.h"

namespace cohort::cli {

/// A run's options as flags give them: what RunConfig holds, and the loop's checkpoint and
/// snapshot cadence (train::EpochLoopOptions), with durations in seconds and bits in octal.
struct RunOptions {
  std::string storage_path = "./cohort_results";  ///< --storage-path: where run folders go
  std::string name;      ///< --name: the run folder's name (empty: cohort_<date>_<time>)
  bool resume = true;    ///< --resume: from the run's latest checkpoint
  int max_failures = 0;  ///< --max-failures (-1: unlimited)
  std::string recovery = "restart";  ///< --recovery: restart or live
  bool replace_lost = true;          ///< --replace-lost (FailureConfig::replace_lost)
  /// --heartbeat-timeout, in seconds (FailureConfig::heartbeat_timeout).
  double heartbeat_timeout_s = std::chrono::duration<double>(kDefaultHeartbeatTimeout).count();
  int num_to_keep = 2;  ///< --num-to-keep: checkpoints kept besides the latest (0: all)
  /// --checkpoint-every-steps: also every N optimizer steps; unset: at epoch ends only.
  std::optional<int64_t> checkpoint_every_steps;
  bool async_checkpoint = false;              ///< --async-checkpoint (SaveOptions::async)
  std::string checkpoint_when_busy = "wait";  ///< --checkpoint-when-busy: wait or skip
  /// --snapshot-every-steps: an in-memory snapshot every N optimizer steps; unset: none.
  std::optional<int64_t> snapshot_every_steps;
  std::string snapshot_dir = RunConfig{}.snapshot_path.string();  ///< --snapshot-dir
  std::string rdzv;                     ///< --rdzv etcd://HOST:PORT (RunConfig::rendezvous)
  std::string umask = "077";            ///< --umask, in octal (RunConfig::umask)
  bool quiet = false;                   ///< --quiet: no progress bar or report lines
  bool tensorboard = true;              ///< --tensorboard: event files in the run's tensorboard/
  bool tensorboard_histograms = false;  ///< --tensorboard-histograms
  std::string profile_steps;            ///< --profile-steps "A-B" or "N"; empty: none
  int64_t log_every_steps = RunConfig{}.log_every_steps;  ///< --log-every-steps
  /// --dashboard [PORT] (empty: the default port); unset: no dashboard.
  std::optional<std::string> dashboard;
  std::string dashboard_host = DashboardOptions{}.host;  ///< --dashboard-host

  /// The RunConfig of these flags; UsageError naming a bad flag's value and the fix (an unknown
  /// --recovery or --checkpoint-when-busy, skip without --async-checkpoint, snapshots without a
  /// folder, a bad --umask, --dashboard port, --profile-steps range or one past `max_steps` (0: no
  /// limit), and what check_configs refuses, by its flag).
  RunConfig run_config(int64_t max_steps = 0) const;
  /// Puts the checkpoint and snapshot cadence and the asynchronous saves into `loop`.
  void apply(train::EpochLoopOptions& loop) const;
};

/// The options as JSON (e.g. in a Trainer's train_loop_config, for the workers' loop options) and
/// back, a key per field; a missing key keeps its default, a value of the wrong type is a
/// UsageError naming it.
void to_json(Json& json, const RunOptions& options);
/// RunOptions from JSON (see to_json).
void from_json(const Json& json, RunOptions& options);

/// The flag names of RunConfig's fields, for check_configs (`cohort train` adds the Trainer's).
extern const OptionNames kRunFlagNames;

/// Adds the run's flags to `cmd`: the folder, checkpoints and recovery in the group "Run directory
/// and recovery", the output in "Output and observability".
void add_run_options(CLI::App* cmd, RunOptions& options);

}  // namespace cohort::cli

/// \file
/// The flags of a program's workers (Ray's ScalingConfig): one call gives it cohort train's
/// --workers, --min-workers, --threads, --use-gpu, --gpus-per-worker, --backend and
/// --parameter-servers, with their help and defaults:
///
///   cohort::cli::ScalingOptions scaling_options{.workers = 4};   // the program's default
///   cohort::cli::add_scaling_options(&app, scaling_options);
///   CLI11_PARSE(app, argc, argv);
///   const auto plan = plan_options.plan(scaling_options.workers);
///   cohort::ScalingConfig scaling = scaling_options.scaling_config(plan);  // UsageError by flag
///
/// Needs CLI11 (Debian's libcli11-dev), as <cohort/cli/plan_options.h>.
#pragma once
#include <string>

#include <CLI/CLI.hpp>

#include "cohort/train/config.h"
#include "cohort/train/plan.h"

namespace cohort::cli {

/// The workers as flags give them: what ScalingConfig holds besides the plan's mesh.
struct ScalingOptions {
  int workers = ScalingConfig{}.num_workers;  ///< --workers: worker processes
  /// --min-workers: elastic, the fewest a restarted group may have; 0: always --workers.
  int min_workers = 0;
  int threads = 1;                                ///< --threads: CPU threads per worker
  bool use_gpu = false;                           ///< --use-gpu: each worker gets its own GPU(s)
  int gpus_per_worker = 0;                        ///< --gpus-per-worker, with --use-gpu; 0: 1
  std::string backend = ScalingConfig{}.backend;  ///< --backend: auto, gloo or nccl
  /// --parameter-servers: with --sync async-ps:K, servers in the first workers; 0: one.
  int parameter_servers = 0;

  /// The ScalingConfig of these flags for `plan` (its pipeline and tensor-parallel degrees are the
  /// mesh), checked as the Trainer will and against the plan: a UsageError naming the flags and
  /// the fix (GPUs without --use-gpu, --parameter-servers without --sync async-ps, --cuda-graph
  /// without a GPU or with Gloo, a precision the CPU cannot run, and what check_configs refuses of
  /// ScalingConfig, by its flag).
  ScalingConfig scaling_config(const train::Plan& plan) const;
};

/// The flag names of ScalingConfig's fields, for check_configs (with kRunFlagNames for a
/// RunConfig's).
extern const OptionNames kScalingFlagNames;

/// Adds the workers' flags to `cmd`, in the group "Workers and devices".
void add_scaling_options(CLI::App* cmd, ScalingOptions& options);

}  // namespace cohort::cli

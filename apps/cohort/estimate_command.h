// `cohort estimate`: the memory each worker of a `cohort train` job needs, item by item, before
// any worker starts (train::estimate_memory, with the activations measured on the model).
#pragma once
#include <CLI/CLI.hpp>

#include "training_job.h"

namespace cohort::cli {

// Adds `cohort estimate` with the flags of `cohort train` (--memory-budget among them).
CLI::App* add_estimate_command(CLI::App& app, TrainOptions& options);

// Prints the estimate; exit code 2 (a UsageError) for bad options or an estimate over
// --memory-budget.
int run_estimate_command(TrainOptions options);

}  // namespace cohort::cli

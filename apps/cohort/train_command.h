#pragma once
#include <CLI/CLI.hpp>

#include "training_job.h"

namespace cohort::cli {

// Adds `cohort train` and its flags to `app`; the options are filled when it parses.
CLI::App* add_train_command(CLI::App& app, TrainOptions& options);

// Checks the options and the data before any worker starts (UsageError on bad input), then runs
// the job. Returns the process exit code.
// workers_given: --workers was on the command line (else, under a launcher, its world size).
int run_train_command(TrainOptions options, const CLI::App& cmd);

}  // namespace cohort::cli

#pragma once
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "training_job.h"

namespace cohort::cli {

struct TuneOptions {
  TrainOptions job;                 // every trial's base configuration
  std::vector<std::string> params;  // NAME=DOMAIN, e.g. lr=loguniform:1e-4:1e-1
  int samples = 1;
  std::string scheduler = "fifo";
  int max_concurrent = 0;
  std::string metric = "test_accuracy";
  std::string mode = "max";
  double grace_period = 1;
  double reduction_factor = 4;
  int cpus = 0;
  double time_budget = 0;
  uint64_t search_seed = 0;
};

// Adds `cohort tune` and its flags to `app`.
CLI::App* add_tune_command(CLI::App& app, TuneOptions& options);

// Searches the hyperparameters of the training job; continues the experiment of the same
// --storage-path and --name when there is one (unless --no-resume). Returns the exit code.
int run_tune_command(TuneOptions options, const CLI::App& cmd);

}  // namespace cohort::cli

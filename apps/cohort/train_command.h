#pragma once
#include <string>

#include <CLI/CLI.hpp>

#include "cohort/json.h"

namespace cohort::cli {

struct TrainOptions {
  std::string model = "cnn";
  std::string dataset = "fashion-mnist";
  std::string data_dir;
  int workers = 2;
  int min_workers = 0;  // elastic: the fewest workers a restarted group may have; 0: fixed size
  int threads = 1;
  int epochs = 5;
  int64_t batch_size = 64;
  std::string optimizer = "sgd";
  double lr = 0;  // 0: the optimizer's default
  double momentum = 0.9;
  uint64_t seed = 0;
  int64_t max_steps = 0;  // 0: no limit
  std::string storage_path = "./cohort_results";
  std::string name;
  bool resume = true;
  int max_failures = 0;
  int num_to_keep = 2;  // checkpoints kept besides the latest, by test accuracy
  bool quiet = false;
};

// Adds `cohort train` and its flags to `app`; the options are filled when it parses.
CLI::App* add_train_command(CLI::App& app, TrainOptions& options);

// Checks the options and the data before any worker starts (UsageError on bad input), then runs
// the job. Returns the process exit code.
// workers_given: --workers was on the command line (else, under a launcher, its world size).
int run_train_command(TrainOptions options, bool workers_given);

}  // namespace cohort::cli

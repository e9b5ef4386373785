// `cohort dashboard STORAGE_PATH`: the live dashboard of the runs and experiments under a storage
// path, running or finished, until Ctrl-C.
#pragma once
#include <string>

#include <CLI/CLI.hpp>

#include "cohort/train/config.h"

namespace cohort::cli {

struct DashboardCommandOptions {
  std::string storage_path = "./cohort_results";
  DashboardOptions server;
};

CLI::App* add_dashboard_command(CLI::App& app, DashboardCommandOptions& options);
int run_dashboard_command(const DashboardCommandOptions& options);

}  // namespace cohort::cli

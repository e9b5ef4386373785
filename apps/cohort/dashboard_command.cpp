#include "dashboard_command.h"

#include <csignal>
#include <filesystem>
#include <iostream>

#include "cohort/error.h"
#include "cohort/train/dashboard.h"

namespace cohort::cli {

CLI::App* add_dashboard_command(CLI::App& app, DashboardCommandOptions& o) {
  auto* cmd = app.add_subcommand(
      "dashboard",
      "Serve a live dashboard of the runs and Tune experiments under a storage path (workers, "
      "curves, checkpoints, failures, trials; /metrics for Prometheus) until Ctrl-C");
  cmd->add_option("storage_path", o.storage_path, "the --storage-path of the runs")
      ->capture_default_str();
  cmd->add_option("--port", o.server.port, "the port (0: a free one)")->capture_default_str();
  cmd->add_option("--host", o.server.host,
                  "the address to listen on (0.0.0.0: every interface, for other hosts)")
      ->capture_default_str();
  return cmd;
}

int run_dashboard_command(const DashboardCommandOptions& o) {
  if (!std::filesystem::is_directory(o.storage_path)) {
    throw UsageError("storage path " + o.storage_path +
                     " is not a folder: give the --storage-path of your runs");
  }
  // Ctrl-C and SIGTERM end the wait below, not the process, so the server stops cleanly.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);  // before the server's threads start
  train::Dashboard dashboard(o.storage_path, o.server);
  std::cout << "dashboard of " << std::filesystem::absolute(o.storage_path).string() << " at "
            << dashboard.url() << " (metrics at " << dashboard.url() << "metrics; Ctrl-C stops)"
            << std::endl;
  int received = 0;
  sigwait(&signals, &received);
  return 0;
}

}  // namespace cohort::cli

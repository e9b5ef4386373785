// `cohort launch`: starts one node's workers of a multi-node job (runtime::launch_node).
#pragma once
#include <CLI/CLI.hpp>

#include "cohort/runtime/node_launcher.h"

namespace cohort::cli {

struct LaunchOptions {
  runtime::NodeLaunchOptions node;
  std::string master = "127.0.0.1:29500";
  std::string rdzv;  // "etcd://HOST:PORT"; empty: node 0's launcher serves the rendezvous
  double rendezvous_timeout_s = 60;
  double heartbeat_timeout_s = 5;
};

CLI::App* add_launch_command(CLI::App& app, LaunchOptions& options);
int run_launch_command(LaunchOptions options);

}  // namespace cohort::cli

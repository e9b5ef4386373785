// `cohort --version` and `cohort env`: what this build is, and what cohort sees of the machine
// and the environment (versions, devices, the launch mode and rank it would take, the address
// the data plane would bind), the first thing to paste into a setup or hang report.
#pragma once
#include <string>

#include <CLI/CLI.hpp>

namespace cohort::cli {

// "cohort 0.1.0 (git 1a2b3c4), libtorch 1.13.0, CUDA off, NCCL off".
std::string version_line();

CLI::App* add_env_command(CLI::App& app);
// Prints the report; exit code 2 when the launcher's variables contradict each other (each named),
// 0 otherwise (warnings, such as a MASTER_ADDR that does not resolve, are printed as such).
int run_env_command();

}  // namespace cohort::cli

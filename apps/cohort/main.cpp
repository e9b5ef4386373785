// cohort: the command-line tool. A plain user of the public API.
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <string>

#include <CLI/CLI.hpp>

#include "checkpoint_command.h"
#include "cohort/cli/config_file.h"
#include "cohort/error.h"
#include "completion_command.h"
#include "dashboard_command.h"
#include "env_command.h"
#include "estimate_command.h"
#include "launch_command.h"
#include "train_command.h"
#include "tune_command.h"

namespace {

// CLI11 reads "nan" and "inf" into a double as numbers; no option of cohort means either. Every
// floating-point option given (of `app` and its subcommands) must be finite: UsageError naming it.
void reject_non_finite(const CLI::App& app) {
  for (const auto* option : app.get_options()) {
    if (option->count() == 0 || option->get_type_name() != "FLOAT") continue;
    for (const auto& text : option->results()) {
      char* end = nullptr;
      const double value = std::strtod(text.c_str(), &end);
      if (end != text.c_str() && !std::isfinite(value)) {
        throw cohort::UsageError(
            option->get_name() + " " + text + " is not a finite number: give a number such as " +
            (option->get_default_str().empty() ? std::string("0.1") : option->get_default_str()));
      }
    }
  }
  for (const auto* sub : app.get_subcommands()) reject_non_finite(*sub);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"cohort: distributed training for libtorch"};
  app.set_version_flag(
      "--version", cohort::cli::version_line(),
      "Print the version, the git revision and the libtorch, CUDA and NCCL it has");
  app.require_subcommand(1);
  app.footer(
      "Examples:\n"
      "  cohort train --model cnn --workers 2 --epochs 5        train on Fashion-MNIST\n"
      "  cohort train --config run.json --lr 0.05                options from a file, one changed\n"
      "  cohort train --model vit --workers 8 --pp 2 --tp 2      a data x pipeline x tensor mesh\n"
      "  cohort tune --param lr=loguniform:1e-4:1e-1 --samples 8 --scheduler asha\n"
      "  cohort dashboard ./cohort_results                       the runs' live dashboard\n"
      "  cohort checkpoint consolidate RUN/checkpoint_000004 -o model.safetensors\n"
      "  cohort estimate --model resnet18 --workers 4 --zero-stage 2   memory per worker\n"
      "  cohort env                                            what cohort sees of this machine\n"
      "  cohort launch --nnodes 2 --node-rank 0 --master host0:29500 --nproc-per-node 2 -- \\\n"
      "      cohort train --workers 4                             one node of a two-node job\n"
      "\n"
      "`cohort SUBCOMMAND --help` lists a subcommand's options by group; "
      "`source <(cohort completion bash)` completes them.");
  cohort::cli::TrainOptions train;
  auto* train_cmd = cohort::cli::add_train_command(app, train);
  cohort::cli::TuneOptions tune;
  auto* tune_cmd = cohort::cli::add_tune_command(app, tune);
  cohort::cli::LaunchOptions launch;
  auto* launch_cmd = cohort::cli::add_launch_command(app, launch);
  cohort::cli::DashboardCommandOptions dashboard;
  auto* dashboard_cmd = cohort::cli::add_dashboard_command(app, dashboard);
  cohort::cli::CheckpointCommandOptions checkpoint;
  auto* checkpoint_cmd = cohort::cli::add_checkpoint_command(app, checkpoint);
  std::string shell;
  auto* completion_cmd = cohort::cli::add_completion_command(app, shell);
  auto* env_cmd = cohort::cli::add_env_command(app);
  cohort::cli::TrainOptions estimate;
  auto* estimate_cmd = cohort::cli::add_estimate_command(app, estimate);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << "error: " << e.what() << " (see `cohort --help` or `cohort train --help`)\n";
    return 2;
  }
  try {
    if (train_cmd->parsed()) cohort::cli::apply_config_file(train_cmd, train.config_file);
    if (tune_cmd->parsed()) cohort::cli::apply_config_file(tune_cmd, tune.job.config_file);
    reject_non_finite(app);
    if (train_cmd->parsed()) return cohort::cli::run_train_command(train, *train_cmd);
    if (tune_cmd->parsed()) return cohort::cli::run_tune_command(tune, *tune_cmd);
    if (launch_cmd->parsed()) return cohort::cli::run_launch_command(launch);
    if (dashboard_cmd->parsed()) return cohort::cli::run_dashboard_command(dashboard);
    if (checkpoint_cmd->parsed()) return cohort::cli::run_checkpoint_command(checkpoint);
    if (completion_cmd->parsed()) return cohort::cli::run_completion_command(app, shell);
    if (env_cmd->parsed()) return cohort::cli::run_env_command();
    if (estimate_cmd->parsed()) {
      cohort::cli::apply_config_file(estimate_cmd, estimate.config_file);
      return cohort::cli::run_estimate_command(estimate);
    }
  } catch (const cohort::UsageError& e) {
    std::cerr << "error: " << e.what() << '\n';
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << '\n';
    return 1;
  }
  return 2;
}

#include "checkpoint_command.h"

#include <chrono>
#include <filesystem>
#include <iomanip>
#include <iostream>

#include "cohort/train/checkpoint.h"

namespace cohort::cli {

CLI::App* add_checkpoint_command(CLI::App& app, CheckpointCommandOptions& o) {
  auto* cmd = app.add_subcommand("checkpoint", "Work with a run's checkpoints");
  cmd->require_subcommand(1);
  auto* consolidate = cmd->add_subcommand(
      "consolidate",
      "Write a checkpoint's model (DDP, ZeRO at any stage and world size, local SGD, the "
      "parameter server, or a pipeline's stage files) as one safetensors file, one tensor at a "
      "time; the checkpoint is verified against its manifest first");
  consolidate->add_option("checkpoint", o.checkpoint, "the checkpoint folder, RUN/checkpoint_N")
      ->required();
  consolidate->add_option("-o,--output", o.output, "the safetensors file to write")
      ->capture_default_str();
  consolidate->footer(
      "Example:\n"
      "  cohort checkpoint consolidate cohort_results/run/checkpoint_000004 -o model.safetensors");
  return cmd;
}

int run_checkpoint_command(const CheckpointCommandOptions& o) {
  const auto start = std::chrono::steady_clock::now();
  const auto tensors =
      train::consolidate_checkpoint(Checkpoint::from_directory(o.checkpoint), o.output);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << "wrote " << tensors << " tensors (" << std::filesystem::file_size(o.output) / 1e6
            << " MB) of " << o.checkpoint << " to " << o.output << " in " << std::fixed
            << std::setprecision(2) << seconds << " s" << std::endl;
  return 0;
}

}  // namespace cohort::cli

// `cohort checkpoint consolidate CHECKPOINT -o FILE`: any checkpoint's model as one safetensors
// file.
#pragma once
#include <string>

#include <CLI/CLI.hpp>

namespace cohort::cli {

struct CheckpointCommandOptions {
  std::string checkpoint;
  std::string output = "model.safetensors";
};

CLI::App* add_checkpoint_command(CLI::App& app, CheckpointCommandOptions& options);
int run_checkpoint_command(const CheckpointCommandOptions& options);

}  // namespace cohort::cli

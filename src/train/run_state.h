// save_checkpoint in its two halves, for the mesh checkpoint, which keeps each (pp, tp)
// position's model and optimizer in a folder of its own and the run's state once at the top.
#pragma once
#include <filesystem>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

namespace cohort::train::detail {

// save_checkpoint's model and optimizer files (every engine's), without the run's state.
void save_model_and_optimizer(const std::filesystem::path& dir, const torch::nn::Module& module,
                              const torch::optim::Optimizer& optimizer);
// The run's state beside its model and optimizer that restore_run_state reads back: the
// session's loss scaler with fp16 (part optim::kLossScalerPart), written by world rank 0.
void save_run_state(const std::filesystem::path& dir);

}  // namespace cohort::train::detail

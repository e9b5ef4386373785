// A small classifier and its batches for the data-parallel engines' tests: the same weights on
// every rank and run, a different batch per rank and step.
#pragma once
#include <torch/torch.h>

#include <mutex>
#include <utility>
#include <vector>

#include "support/local_group.h"

namespace cohort::testing {

inline torch::nn::Sequential make_net() {
  std::lock_guard lock(generator_mutex());
  torch::manual_seed(5);
  return torch::nn::Sequential(torch::nn::Linear(9, 17), torch::nn::ReLU(),
                               torch::nn::Linear(17, 4));
}

// Rank r's batch of step s: different on every rank, the same on every run.
inline std::pair<torch::Tensor, torch::Tensor> batch(int rank, int step) {
  std::lock_guard lock(generator_mutex());
  torch::manual_seed(300 + 10 * rank + step);
  return {torch::randn({8, 9}), torch::randint(0, 4, {8})};
}

inline void train_step(torch::nn::Sequential& net, torch::optim::Optimizer& optimizer, int rank,
                       int step) {
  optimizer.zero_grad();
  auto [x, y] = batch(rank, step);
  torch::nn::functional::cross_entropy(net->forward(x), y).backward();
  optimizer.step();
}

inline std::vector<torch::Tensor> parameters_of(const torch::nn::Module& net) {
  std::vector<torch::Tensor> out;
  for (const auto& p : net.parameters()) out.push_back(p.detach().clone());
  return out;
}
inline std::vector<torch::Tensor> parameters_of(const torch::nn::Sequential& net) {
  return parameters_of(*net);
}

}  // namespace cohort::testing

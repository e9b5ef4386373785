// A guide's fragment around train::parallelize: a program's CLI::App and plan options, a network
// of the user's as a Sequential, its forward, optimizer factory and loss, the loop's data stream
// and test rows.
#include <torch/torch.h>

#include <CLI/CLI.hpp>

#include <cohort/cli/plan_options.h>
#include <cohort/cohort.h>

namespace train = cohort::train;

[[maybe_unused]] void fragment() {
  CLI::App app("a program of the user's");
  cohort::cli::PlanOptions plan_options;
  auto& ctx = train::get_context();
  torch::nn::Sequential net(torch::nn::Flatten(), torch::nn::Linear(784, 64), torch::nn::ReLU(),
                            torch::nn::Linear(64, 10));
  const auto forward = [net](const at::Tensor& x) mutable { return net->forward(x); };
  const auto make_optimizer = [](std::vector<at::Tensor> parameters) {
    return std::make_unique<torch::optim::AdamW>(parameters, torch::optim::AdamWOptions(3e-3));
  };
  const auto loss_fn = [](const at::Tensor& out, const at::Tensor& y) {
    return torch::nn::functional::cross_entropy(out, y);
  };
  auto stream = train::get_dataset_shard("train");
  const int64_t rows_per_step = 64;
  const cohort::Json metrics{{"loss", 0.0}};
  const auto test_x = torch::rand({100, 784});
  const auto test_y = torch::randint(10, {100});
  train::ResumePoint start;
  {
    // SNIPPET
  }
}

#include "support/small_classifier.h"

#include <torch/torch.h>

#include "cohort/parallel/fully_shard.h"

namespace cohort::testing {

std::pair<at::Tensor, at::Tensor> classifier_examples() {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(3);
  auto x = torch::randn({kClassifierRows, 8}, generator);
  x.select(1, 0).copy_(torch::arange(kClassifierRows, torch::kFloat));
  return {x, torch::arange(kClassifierRows, torch::kLong) % 4};
}

data::Dataset classifier_dataset() {
  auto [x, y] = classifier_examples();
  return data::Dataset::from_tensors({{"x", x}, {"y", y}}).random_shuffle(7);
}

train::Plan plan_named(const std::string& name) {
  train::Plan plan;
  if (name == "zero1") plan.zero.stage = 1;
  if (name == "zero2") plan.zero.stage = 2;
  if (name == "zero3") plan.zero.stage = 3;
  if (name == "hsdp") plan.zero = {.stage = 2, .shard_group_size = 2};
  // Stage 3 in groups of 2, every unit sharded (the classifier's are small).
  if (name == "hsdp3")
    plan.zero = {.stage = 3, .param_persistence_threshold = 0, .shard_group_size = 2};
  if (name == "pipeline") plan.pp = 2;
  if (name == "mesh") {
    plan.pp = 2;
    plan.zero.stage = 1;
    plan.gradient_accumulation_steps = 2;
  }
  if (name == "zero_bubble") {
    plan.pp = 2;
    plan.schedule = parallel::pipeline::ScheduleKind::kZeroBubble;
  }
  if (name == "local_sgd") plan.sync = parallel::LocalSgd{.every = 2};
  if (name == "diloco") plan.sync = parallel::DiLoCo{.inner_steps = 2};
  if (name == "parameter_server")
    plan.sync = parallel::AsyncParameterServer{.max_staleness = 0, .servers = 1};
  return plan;
}

train::ParallelModel classifier_net(const train::Plan& plan, int hidden_layers, double dropout,
                                    bool stateless) {
  torch::manual_seed(0);
  const auto linear = [&](int64_t in, int64_t out) -> torch::nn::AnyModule {
    if (plan.zero.stage == 3 || plan.activation_checkpointing.enabled())
      return torch::nn::AnyModule(parallel::FullyShard(torch::nn::Linear(in, out)));
    return torch::nn::AnyModule(torch::nn::Linear(in, out));
  };
  torch::nn::Sequential net;
  const auto activation = [&] {
    net->push_back(torch::nn::ReLU());
    if (dropout > 0) net->push_back(torch::nn::Dropout(dropout));
  };
  net->push_back(linear(8, 16));
  for (int layer = 1; layer < hidden_layers; ++layer) {
    activation();
    net->push_back(linear(16, 16));
  }
  activation();
  net->push_back(linear(16, 4));
  return train::parallelize(
      {.module = net.ptr(),
       .forward = [net](const at::Tensor& x) mutable { return net->forward(x); },
       .layers = net},
      [stateless](std::vector<at::Tensor> p) -> std::unique_ptr<torch::optim::Optimizer> {
        if (stateless) return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1));
        return std::make_unique<torch::optim::AdamW>(p, torch::optim::AdamWOptions(1e-2));
      },
      [](const at::Tensor& out, const at::Tensor& y) {
        return torch::nn::functional::cross_entropy(out, y);
      },
      plan);
}

}  // namespace cohort::testing

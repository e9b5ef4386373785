#include "cohort/train/captured_step.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <optional>

#include "cohort/comm/process_group.h"
#include "cohort/error.h"
#include "cohort/optim/flat_optimizer.h"
#include "cohort/parallel/distributed_data_parallel.h"
#include "support/cuda.h"
#include "support/expect.h"
#include "support/local_group.h"

namespace cohort::train {
namespace {

using cohort::testing::expect_error;

torch::nn::Sequential make_net() {
  torch::manual_seed(5);
  return torch::nn::Sequential(torch::nn::Linear(32, 64), torch::nn::ReLU(),
                               torch::nn::Linear(64, 10));
}

// Batch b of a run: 16 rows, the last one 8 (a partial batch, which runs eagerly).
std::pair<torch::Tensor, torch::Tensor> batch(int b, int batches) {
  torch::manual_seed(100 + b);
  const int64_t rows = b + 1 == batches ? 8 : 16;
  return {torch::randn({rows, 32}).cuda(), torch::randint(0, 10, {rows}).cuda()};
}

std::unique_ptr<optim::FlatOptimizer> make_optimizer(const std::string& algorithm,
                                                     torch::nn::Sequential& net) {
  if (algorithm == "sgd")
    return std::make_unique<optim::FlatSGD>(net->parameters(),
                                            torch::optim::SGDOptions(0.05).momentum(0.9));
  return std::make_unique<optim::FlatAdam>(net->parameters(), torch::optim::AdamOptions(1e-2));
}

struct Training {
  std::vector<double> losses;
  std::vector<torch::Tensor> parameters;
  int64_t steps = 0;  // the optimizer's count, as a checkpoint would save it
};

// `batches` steps, the learning rate halved before step 8 (as a schedule would), either eagerly
// or through a CapturedStep made by `make_captured` (null: eagerly).
Training train(const std::string& algorithm, int batches, bool host_sync_in_step,
               const std::function<std::unique_ptr<CapturedStep>(
                   CapturedStep::StepFunction, optim::FlatOptimizer&)>& make_captured,
               torch::nn::Sequential net = nullptr) {
  if (!net) {
    net = make_net();
    net->to(torch::kCUDA);
  }
  auto optimizer = make_optimizer(algorithm, net);
  CapturedStep::StepFunction step = [&](const std::vector<torch::Tensor>& in) {
    optimizer->zero_grad();
    auto loss = torch::nn::functional::cross_entropy(net->forward(in[0]), in[1]);
    loss.backward();
    if (host_sync_in_step && loss.item<double>() < 0) throw std::logic_error("negative loss");
    optimizer->step();
    return loss.detach();
  };
  std::unique_ptr<CapturedStep> captured;
  if (make_captured) captured = make_captured(step, *optimizer);
  Training run;
  for (int b = 0; b < batches; ++b) {
    if (b == 8) {
      for (auto& group : optimizer->param_groups())
        group.options().set_lr(group.options().get_lr() / 2);
    }
    const auto [x, y] = batch(b, batches);
    const auto loss = captured ? captured->run({x, y}) : step({x, y});
    run.losses.push_back(loss.item<double>());
  }
  for (const auto& p : net->parameters()) run.parameters.push_back(p.detach().cpu().clone());
  run.steps = optimizer->parameter_state(0, 0).steps;
  return run;
}

void expect_same_run(const Training& a, const Training& b) {
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t s = 0; s < a.losses.size(); ++s)
    EXPECT_NEAR(a.losses[s], b.losses[s], 1e-5 * std::abs(b.losses[s])) << "step " << s;
  ASSERT_EQ(a.parameters.size(), b.parameters.size());
  for (size_t i = 0; i < a.parameters.size(); ++i)
    EXPECT_TRUE(torch::allclose(a.parameters[i], b.parameters[i], 1e-5, 1e-6))
        << "parameter " << i << " differs by "
        << (a.parameters[i] - b.parameters[i]).abs().max().item<double>();
  EXPECT_EQ(a.steps, b.steps);
}

TEST(CapturedStep, BadOptionsAndCpuInputsAreNamed) {
  auto step = [](const std::vector<torch::Tensor>& in) { return in[0].sum(); };
  expect_error<UsageError>([&] { CapturedStep(step, {.warmup_steps = 0}); }, "warmup_steps 0");
  expect_error<UsageError>([&] { CapturedStep(nullptr); }, "step function is empty");
  CapturedStep captured(step);
  expect_error<UsageError>([&] { captured.run({torch::ones({2})}); }, "drop --cuda-graph");
  expect_error<UsageError>([&] { captured.run({}); }, "no inputs");
  EXPECT_FALSE(captured.captured());
}

// Every call is one training step: replays (the learning rate changed by a schedule included),
// the warm-up and a partial last batch run eagerly, and the optimizer counts every step.
TEST(CapturedStep, ReplaysTrainAsTheEagerLoopDoes) {
  COHORT_REQUIRE_CUDA();
  if (!CapturedStep::available()) GTEST_SKIP() << "this libtorch was built without CUDA graphs";
  for (const std::string algorithm : {"adam", "sgd"}) {
    SCOPED_TRACE(algorithm);
    const Training eager = train(algorithm, 12, false, nullptr);
    const Training graph = train(algorithm, 12, false, [&](auto step, optim::FlatOptimizer& o) {
      return std::make_unique<CapturedStep>(step, CaptureOptions{.optimizer = &o});
    });
    expect_same_run(graph, eager);
    EXPECT_EQ(graph.steps, 12);
  }
  // The counts of replays and eager steps.
  auto net = make_net();
  net->to(torch::kCUDA);
  optim::FlatAdam optimizer(net->parameters());
  CapturedStep captured(
      [&](const std::vector<torch::Tensor>& in) {
        optimizer.zero_grad();
        auto loss = torch::nn::functional::cross_entropy(net->forward(in[0]), in[1]);
        loss.backward();
        optimizer.step();
        return loss.detach();
      },
      {.warmup_steps = 2, .optimizer = &optimizer});
  for (int b = 0; b < 6; ++b) {
    const auto [x, y] = batch(b, 6);
    captured.run({x, y});
  }
  EXPECT_TRUE(captured.captured()) << captured.fallback_reason();
  EXPECT_EQ(captured.replays(), 3);      // the capture's own call, then two
  EXPECT_EQ(captured.eager_steps(), 3);  // two warm-up steps and the partial batch
}

// .item() inside the step cannot be captured: one logged reason, then eager steps with the same
// results (the optimizer's counts put back as they were before the capture).
TEST(CapturedStep, AHostSyncInTheStepFallsBackWithItsReason) {
  COHORT_REQUIRE_CUDA();
  if (!CapturedStep::available()) GTEST_SKIP() << "this libtorch was built without CUDA graphs";
  const Training eager = train("adam", 10, true, nullptr);
  std::vector<std::string> logged;
  const Training fallback = train("adam", 10, true, [&](auto step, optim::FlatOptimizer& o) {
    return std::make_unique<CapturedStep>(
        step, CaptureOptions{.optimizer = &o,
                             .log = [&](const std::string& line) { logged.push_back(line); }});
  });
  expect_same_run(fallback, eager);
  ASSERT_EQ(logged.size(), 1u);
  EXPECT_NE(logged[0].find("runs eagerly"), std::string::npos) << logged[0];
  std::cout << logged[0] << std::endl;
}

// With DDP: over Gloo the step falls back naming the nccl backend; over NCCL (world size 1 here:
// NCCL refuses two ranks on one GPU) it is captured or falls back with its reason, printed.
// Either way the run trains as eagerly.
TEST(CapturedStep, DdpStepsTrainAsEagerOnEitherBackend) {
  COHORT_REQUIRE_CUDA();
  if (!CapturedStep::available()) GTEST_SKIP() << "this libtorch was built without CUDA graphs";
  // kAuto: CUDA tensors over NCCL, DDP's few CPU tensors over Gloo (as cohort train does).
  std::vector<comm::Backend> backends{comm::Backend::kGloo};
  if (comm::nccl_available()) backends.push_back(comm::Backend::kAuto);
  for (const auto backend : backends) {
    SCOPED_TRACE(comm::to_string(backend));
    testing::run_ranks(
        1,
        [&](comm::ProcessGroup& group) {
          // The net is wrapped by DDP (its hooks all-reduce in backward) for the whole run.
          auto with_ddp = [&](bool capture, std::string* reason) {
            auto net = make_net();
            net->to(torch::kCUDA);
            // DDP set up on the capture's stream (as cohort train --cuda-graph does).
            std::optional<CaptureStreamScope> scope;
            if (capture) scope.emplace();
            parallel::DistributedDataParallel ddp(net.ptr(), group);
            scope.reset();
            if (!capture) return train("adam", 12, false, nullptr, net);
            return train(
                "adam", 12, false,
                [&](CapturedStep::StepFunction step, optim::FlatOptimizer& o) {
                  return std::make_unique<CapturedStep>(
                      step,
                      CaptureOptions{.optimizer = &o,
                                     .group = &group,
                                     .log = [=](const std::string& line) { *reason = line; }});
                },
                net);
          };
          std::string reason;
          const Training eager = with_ddp(false, nullptr);
          const Training graph = with_ddp(true, &reason);
          expect_same_run(graph, eager);
          if (backend == comm::Backend::kGloo) {
            EXPECT_NE(reason.find("nccl backend"), std::string::npos) << reason;
          } else {
            std::cout << "DDP over NCCL: "
                      << (reason.empty() ? "captured, the all-reduce inside the graph" : reason)
                      << std::endl;
          }
        },
        testing::gpu_group_options(backend));
  }
}

}  // namespace
}  // namespace cohort::train

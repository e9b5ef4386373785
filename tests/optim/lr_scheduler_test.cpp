#include "cohort/optim/lr_scheduler.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

#include "cohort/error.h"
#include "support/expect.h"

namespace cohort {
namespace {

TEST(LrSchedule, WarmupThenCosineLinearOrStepDecay) {
  const optim::LrScheduleOptions cosine{
      .warmup_steps = 4, .decay = "cosine", .total_steps = 14, .min_lr_ratio = 0.1};
  EXPECT_DOUBLE_EQ(cosine.factor(0), 0.25);
  EXPECT_DOUBLE_EQ(cosine.factor(3), 1.0);
  EXPECT_DOUBLE_EQ(cosine.factor(4), 1.0);
  EXPECT_NEAR(cosine.factor(9), 0.1 + 0.9 * 0.5, 1e-12);  // halfway
  EXPECT_NEAR(cosine.factor(14), 0.1, 1e-12);
  EXPECT_NEAR(cosine.factor(100), 0.1, 1e-12);
  const optim::LrScheduleOptions linear{.decay = "linear", .total_steps = 10};
  EXPECT_DOUBLE_EQ(linear.factor(0), 1.0);
  EXPECT_DOUBLE_EQ(linear.factor(5), 0.5);
  EXPECT_DOUBLE_EQ(linear.factor(10), 0.0);
  const optim::LrScheduleOptions step{.decay = "step", .step_size = 3, .gamma = 0.5};
  EXPECT_DOUBLE_EQ(step.factor(2), 1.0);
  EXPECT_DOUBLE_EQ(step.factor(3), 0.5);
  EXPECT_DOUBLE_EQ(step.factor(6), 0.25);
}

TEST(LrScheduler, SetsEveryGroupsLrAndKeepsAChangeMadeInBetween) {
  auto a = torch::zeros({1}, torch::requires_grad());
  auto b = torch::zeros({1}, torch::requires_grad());
  torch::optim::SGD optimizer(
      std::vector<torch::optim::OptimizerParamGroup>{
          torch::optim::OptimizerParamGroup({a}),
          torch::optim::OptimizerParamGroup({b}, std::make_unique<torch::optim::SGDOptions>(1.0))},
      torch::optim::SGDOptions(0.1));
  optim::LrScheduler schedule(optimizer,
                              {.warmup_steps = 2, .decay = "step", .step_size = 2, .gamma = 0.5});
  EXPECT_NEAR(schedule.get_last_lr()[0], 0.05, 1e-12);
  EXPECT_NEAR(schedule.get_last_lr()[1], 0.5, 1e-12);
  schedule.step();
  EXPECT_NEAR(schedule.get_last_lr()[0], 0.1, 1e-12);
  // An elastic restart doubled the lr (linear scaling): the schedule keeps the doubling.
  for (auto& group : optimizer.param_groups()) group.options().set_lr(group.options().get_lr() * 2);
  schedule.step();
  schedule.step();
  schedule.step();
  EXPECT_NEAR(schedule.get_last_lr()[0], 0.1, 1e-12);  // 0.1 * 2 * 0.5 at step 4
  EXPECT_NEAR(schedule.get_last_lr()[1], 1.0, 1e-12);
  // Resumed after 4 steps with the checkpoint's lr: left as loaded, then on.
  optim::LrScheduler resumed(optimizer,
                             {.warmup_steps = 2, .decay = "step", .step_size = 2, .gamma = 0.5}, 4);
  EXPECT_NEAR(resumed.get_last_lr()[0], 0.1, 1e-12);
  resumed.step();
  resumed.step();
  EXPECT_NEAR(resumed.get_last_lr()[0], 0.05, 1e-12);
}

TEST(LrSchedule, BadOptionsAreNamed) {
  using testing::expect_error;
  expect_error<UsageError>([] { optim::LrScheduleOptions{.decay = "exp"}.validate(); },
                           "unknown lr decay 'exp'");
  expect_error<UsageError>(
      [] {
        optim::LrScheduleOptions{.warmup_steps = 5, .decay = "cosine", .total_steps = 5}.validate();
      },
      "total_steps (5) greater than warmup_steps (5)");
  expect_error<UsageError>([] { optim::LrScheduleOptions{.warmup_steps = -1}.validate(); },
                           "warmup_steps -1");
  expect_error<UsageError>([] { optim::LrScheduleOptions{.decay = "step"}.validate(); },
                           "step_size >= 1");
}

}  // namespace
}  // namespace cohort

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

TEST(LrSchedule, EveryOptionComesBackFromJsonAndGivesTheSameFactors) {
  const optim::LrScheduleOptions options{.warmup_steps = 2,
                                         .warmup_type = "log",
                                         .warmup_start_ratio = 0.1,
                                         .decay = "step",
                                         .total_steps = 50,
                                         .step_size = 4,
                                         .gamma = 0.5,
                                         .min_lr_ratio = 0.05};
  const auto read = Json(options).get<optim::LrScheduleOptions>();
  EXPECT_EQ(Json(read), Json(options));
  for (int64_t step : {0, 1, 2, 6, 10, 30}) EXPECT_EQ(read.factor(step), options.factor(step));
  const auto cosine = Json{{"decay", "cosine"}}.get<optim::LrScheduleOptions>();
  EXPECT_EQ(cosine.decay, "cosine");
  EXPECT_EQ(cosine.gamma, optim::LrScheduleOptions{}.gamma);
  cohort::testing::expect_error<UsageError>(
      [] {
        Json{{"step_size", "four"}}.get<optim::LrScheduleOptions>();
      },
      "field 'step_size'");
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

// The schedule's own state (a checkpoint's part) takes a schedule made afresh on to the step where
// the saved one stood, whatever its steps_done.
TEST(LrSchedule, ItsStateGoesOnFromTheSavedStep) {
  const optim::LrScheduleOptions options{.warmup_steps = 3, .decay = "cosine", .total_steps = 9};
  auto w = torch::zeros({2}, torch::requires_grad());
  torch::optim::SGD saved_optimizer({w}, torch::optim::SGDOptions(0.4));
  optim::LrScheduler saved(saved_optimizer, options);
  for (int i = 0; i < 4; ++i) saved.step();
  const auto state = saved.state_dict();
  EXPECT_TRUE(state.tensors.empty());
  EXPECT_EQ(state.values["steps_done"], 4);
  torch::optim::SGD optimizer({w}, torch::optim::SGDOptions(0.4));
  optim::LrScheduler resumed(optimizer, options);
  // The optimizer's lr comes back with its own state.
  optimizer.param_groups()[0].options().set_lr(saved.get_last_lr()[0]);
  resumed.load_state_dict(state);
  EXPECT_EQ(resumed.steps_done(), 4);
  for (int i = 0; i < 6; ++i) {
    saved.step();
    resumed.step();
    EXPECT_DOUBLE_EQ(resumed.get_last_lr()[0], saved.get_last_lr()[0]) << "step " << i + 5;
  }
  // An engine that splits the one group otherwise (ZeRO's buckets) takes its lr for each group.
  torch::optim::SGD two_groups({w}, torch::optim::SGDOptions(0.4));
  two_groups.add_param_group(torch::optim::OptimizerParamGroup({torch::zeros({1})}));
  optim::LrScheduler split(two_groups, options);
  split.load_state_dict(state);
  EXPECT_EQ(split.steps_done(), 4);
  // Groups of different lrs into another number of groups, or altered values, are refused.
  using testing::expect_error;
  auto two_lrs = split.state_dict();
  two_lrs.values["base_lrs"] = {0.4, 0.2};
  expect_error<UsageError>([&] { resumed.check_state(two_lrs.values); },
                           "has 2 param groups of different learning rates, the optimizer 1");
  expect_error<UsageError>(
      [&] {
        resumed.check_state(Json{{"steps_done", 2}});
      },
      "the learning-rate schedule's state is malformed");
  expect_error<UsageError>(
      [&] {
        resumed.check_state(Json{{"steps_done", -1}, {"base_lrs", {0.4}}});
      },
      "says -1 steps done");
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

#include "cohort/cli/plan_options.h"

#include <gtest/gtest.h>

#include "cohort/error.h"

namespace cohort {
namespace {

// Every option of the plan survives the JSON a Trainer hands its workers, the precision and the
// loss scaler (which reach only the plan now, not ScalingConfig) included.
TEST(PlanOptions, TheWorkersJsonKeepsEveryOptionOfThePlan) {
  cli::PlanOptions options{.pp = 2,
                           .micro_batches = 4,
                           .schedule = "gpipe",
                           .zero = {.reduce_bucket_size = 1000},
                           .sync = "diloco:3",
                           .outer_lr = 0.5,
                           .gradient_accumulation_steps = 2,
                           .gradient_clipping = 1.5,
                           .precision = "bf16",
                           .loss_scaler = {.initial_scale = 256, .hysteresis = 3}};
  const Json json = options;
  const auto plan = json.get<cli::PlanOptions>().plan(4);
  EXPECT_EQ(plan.pp, 2);
  EXPECT_EQ(plan.micro_batches, 4);
  EXPECT_EQ(plan.schedule, parallel::pipeline::ScheduleKind::kGPipe);
  EXPECT_EQ(plan.zero.stage, 0);
  EXPECT_EQ(plan.zero.reduce_bucket_size, 1000);
  ASSERT_TRUE(std::holds_alternative<parallel::DiLoCo>(plan.sync));
  EXPECT_EQ(std::get<parallel::DiLoCo>(plan.sync).inner_steps, 3);
  EXPECT_EQ(std::get<parallel::DiLoCo>(plan.sync).outer_lr, 0.5);
  EXPECT_EQ(plan.gradient_accumulation_steps, 2);
  EXPECT_EQ(plan.gradient_clipping, 1.5);
  EXPECT_EQ(plan.precision, optim::Precision::kBf16);
  EXPECT_EQ(plan.loss_scaler, options.loss_scaler);
  // The defaults: a plan of fp32, the loss scaler's own defaults.
  const auto defaults = Json::object().get<cli::PlanOptions>().plan();
  EXPECT_EQ(defaults.precision, optim::Precision::kFp32);
  EXPECT_EQ(defaults.loss_scaler, optim::LossScalerOptions{});
}

// The UsageError's message of reading `json` as PlanOptions and making its plan; empty if none.
std::string problem_of(const Json& json) {
  try {
    json.get<cli::PlanOptions>().plan();
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

TEST(PlanOptions, AValueOfTheWrongTypeOrABadPrecisionIsNamed) {
  const Json bad_scaler{{"loss_scaler", {{"hysteresis", "two"}}}};
  EXPECT_NE(problem_of(bad_scaler).find("'hysteresis'"), std::string::npos)
      << problem_of(bad_scaler);
  EXPECT_EQ(problem_of(Json{{"precision", "fp8"}}),
            "unknown precision 'fp8': choose fp32, bf16 or fp16");
  EXPECT_EQ(problem_of(Json{{"loss_scaler", {{"min_scale", 0}}}}),
            "loss scaler min_scale 0 must be > 0");
}

}  // namespace
}  // namespace cohort

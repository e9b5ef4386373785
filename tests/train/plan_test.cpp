#include "cohort/train/plan.h"

#include <gtest/gtest.h>

#include <string>

#include "cohort/error.h"

namespace cohort {
namespace {

// The message of the UsageError that `plan`'s validate(world_size) throws; empty when it passes.
std::string problem_of(const train::Plan& plan, int world_size = 0) {
  try {
    plan.validate(world_size);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

TEST(Plan, ConflictingOptionsAreOneLineNamingBothAndTheFix) {
  EXPECT_EQ(problem_of({}), "");
  EXPECT_EQ(problem_of({.pp = 2, .precision = optim::Precision::kBf16}, 4), "");
  // The precision is the plan's now: fp16 with a pipeline is refused here, for every program.
  EXPECT_EQ(problem_of({.pp = 2, .precision = optim::Precision::kFp16}),
            "--precision fp16 with --pp 2 --tp 1 is not supported yet: the pipeline's loss "
            "scaler is not there yet; use --precision bf16 or fp32");
  EXPECT_EQ(problem_of({.precision = optim::Precision::kFp16}), "");
  EXPECT_EQ(problem_of({.loss_scaler = {.growth_factor = 0.5}}),
            "loss scaler growth_factor 0.5 must be > 1");
  EXPECT_EQ(problem_of({.pp = 2, .tp = 2}, 6),
            "--pp 2 --tp 2 makes groups of 4 workers, which does not divide --workers 6: use "
            "--workers a multiple of 4");
  EXPECT_EQ(problem_of({.gradient_accumulation_steps = 2, .cuda_graph = true}),
            "--cuda-graph captures one micro-batch per step: drop --gradient-accumulation-steps "
            "or --cuda-graph");
}

}  // namespace
}  // namespace cohort

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
  // Sharding groups: ZeRO's, dividing the data-parallel workers (those of a mesh too).
  EXPECT_EQ(problem_of({.zero = {.stage = 2, .shard_group_size = 2}}, 4), "");
  EXPECT_EQ(problem_of({.pp = 2, .zero = {.stage = 1, .shard_group_size = 2}}, 8), "");
  EXPECT_EQ(problem_of({.zero = {.shard_group_size = 2}}, 4),
            "--shard-group-size 2 shards ZeRO's state inside groups: use it with --zero-stage 1, "
            "2 or 3");
  EXPECT_EQ(problem_of({.zero = {.stage = 3, .shard_group_size = 3}}, 4),
            "--shard-group-size 3 does not divide the 4 data-parallel workers (--workers 4): use "
            "a divisor of 4");
  EXPECT_EQ(problem_of({.pp = 2, .zero = {.stage = 1, .shard_group_size = 4}}, 4),
            "--shard-group-size 4 does not divide the 2 data-parallel workers (--workers 4 / "
            "(--pp x --tp)): use a divisor of 2");
  // Where the optimizer state lives.
  EXPECT_EQ(train::to_string(train::parse_optimizer_offload("disk:/scratch")), "disk:/scratch");
  EXPECT_EQ(train::parse_optimizer_offload("cpu").device, train::OptimizerOffload::Device::kCpu);
  EXPECT_EQ(train::parse_optimizer_offload("none").device, train::OptimizerOffload::Device::kNone);
  for (const std::string bad : {"disk:", "gpu", "disk"}) {
    try {
      train::parse_optimizer_offload(bad);
      ADD_FAILURE() << bad;
    } catch (const UsageError& e) {
      EXPECT_EQ(std::string(e.what()), "--offload-optimizer '" + bad +
                                           "': give none, cpu (host memory) or disk:PATH (files "
                                           "in the folder PATH)");
    }
  }
  // Activation checkpointing: a policy that means something, not inside a captured graph.
  EXPECT_EQ(problem_of({.activation_checkpointing = {.every = -1}}),
            "--activation-checkpointing every:-1: every:K needs K >= 1 (1: every unit; none: no "
            "checkpointing)");
  EXPECT_EQ(problem_of({.cuda_graph = true, .activation_checkpointing = {.every = 1}}),
            "--cuda-graph does not capture checkpointed units (their recomputation reads the "
            "random generators' state on the host): drop --activation-checkpointing or "
            "--cuda-graph");
}

TEST(Plan, ABatchMustSplitIntoThePipelinesMicroBatches) {
  // pp 2: 4 micro-batches a batch by default, --micro-batches when given; accumulation adds
  // batches, not rows.
  const train::Plan pipeline{.pp = 2, .gradient_accumulation_steps = 3};
  pipeline.check_batch_size(4);
  try {
    pipeline.check_batch_size(3);
    ADD_FAILURE() << "a batch of 3 rows split into 4 micro-batches";
  } catch (const UsageError& e) {
    EXPECT_EQ(std::string(e.what()),
              "--batch-size 3 cannot be split into 4 micro-batches (--micro-batches): use a "
              "batch of at least 4 rows");
  }
  EXPECT_THROW(train::Plan({.pp = 2, .micro_batches = 8}).check_batch_size(7), UsageError);
  train::Plan{}.check_batch_size(1);  // no pipeline: any batch
  // A micro-batch's rows: the batch's share (at least 1), the whole batch without a pipeline.
  EXPECT_EQ(pipeline.micro_batch_rows(16), 4);
  EXPECT_EQ(pipeline.micro_batch_rows(3), 1);
  EXPECT_EQ(train::Plan({.pp = 2, .micro_batches = 8}).micro_batch_rows(64), 8);
  EXPECT_EQ(train::Plan{.gradient_accumulation_steps = 4}.micro_batch_rows(32), 32);
}

}  // namespace
}  // namespace cohort

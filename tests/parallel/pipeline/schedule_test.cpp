#include "cohort/parallel/pipeline/schedule.h"

#include <gtest/gtest.h>

#include <algorithm>

#include "cohort/parallel/pipeline/simulator.h"

namespace cohort::parallel::pipeline {
namespace {

Program compile(ScheduleKind kind, int ranks, int m, int v = 1) {
  return compile_schedule(
      {.kind = kind, .layout = {.ranks = ranks, .virtual_stages = v}, .micro_batches = m});
}

TEST(PipelineSchedule, GPipeAnd1F1BMeetTheBubbleFormulaForEveryShape) {
  for (ScheduleKind kind : {ScheduleKind::kGPipe, ScheduleKind::kOneFOneB}) {
    for (int p = 1; p <= 5; ++p) {
      for (int m = 1; m <= 9; ++m) {
        SCOPED_TRACE(std::string(to_string(kind)) + " p=" + std::to_string(p) +
                     " m=" + std::to_string(m));
        const ScheduleOptions options{.kind = kind, .layout = {.ranks = p}, .micro_batches = m};
        const SimulationResult run = simulate(compile_schedule(options));
        EXPECT_NEAR(run.bubble_fraction, expected_bubble(options), 1e-9);
        for (int r = 0; r < p; ++r) {
          // GPipe keeps every micro-batch; 1F1B at most p - r of them.
          const int bound = kind == ScheduleKind::kGPipe ? m : std::min(p - r, m);
          EXPECT_EQ(run.peak_live_activations[r], bound) << "rank " << r;
        }
      }
    }
  }
}

TEST(PipelineSchedule, InterleavedMeetsItsBubbleFormula) {
  for (int p = 2; p <= 4; ++p) {
    for (int v = 2; v <= 3; ++v) {
      for (int m = p; m <= 4 * p; m += p) {
        SCOPED_TRACE("p=" + std::to_string(p) + " v=" + std::to_string(v) +
                     " m=" + std::to_string(m));
        const ScheduleOptions options{.kind = ScheduleKind::kInterleaved,
                                      .layout = {.ranks = p, .virtual_stages = v},
                                      .micro_batches = m};
        // Each of the v stages of a rank costs 1/v of an uninterleaved stage.
        const SimulationCosts chunk{
            .forward = 1.0 / v, .backward_input = 1.0 / v, .backward_weight = 1.0 / v};
        const SimulationResult run = simulate(compile_schedule(options), chunk);
        EXPECT_NEAR(run.bubble_fraction, expected_bubble(options), 1e-9);
        const double one_f_one_b = expected_bubble(
            {.kind = ScheduleKind::kOneFOneB, .layout = {.ranks = p}, .micro_batches = m});
        EXPECT_LT(run.bubble_fraction, one_f_one_b);
      }
    }
  }
}

TEST(PipelineSchedule, ZeroBubbleCutsTheBubbleOf1F1BWithItsMemory) {
  for (int p = 2; p <= 6; ++p) {
    for (int m = 1; m <= 3 * p; ++m) {
      SCOPED_TRACE("p=" + std::to_string(p) + " m=" + std::to_string(m));
      const ScheduleOptions zb{
          .kind = ScheduleKind::kZeroBubble, .layout = {.ranks = p}, .micro_batches = m};
      const SimulationResult run = simulate(compile_schedule(zb));
      const SimulationResult base = simulate(compile(ScheduleKind::kOneFOneB, p, m));
      if (m >= p) {
        EXPECT_NEAR(run.bubble_fraction, expected_bubble(zb), 1e-9);
      }
      EXPECT_LE(run.bubble_fraction, base.bubble_fraction + 1e-12);
      // The peak of 1F1B (rank 0's), on every rank.
      const int peak =
          *std::max_element(base.peak_live_activations.begin(), base.peak_live_activations.end());
      for (int r = 0; r < p; ++r) EXPECT_LE(run.peak_live_activations[r], peak) << "rank " << r;
    }
  }
}

TEST(PipelineSchedule, FewerMicroBatchesThanStagesWork) {
  for (ScheduleKind kind :
       {ScheduleKind::kGPipe, ScheduleKind::kOneFOneB, ScheduleKind::kZeroBubble}) {
    const SimulationResult run = simulate(compile(kind, 4, 1));
    // One micro-batch through four stages: each rank works a quarter of the time, unless the
    // weight backwards run beside the input backwards of the stages before.
    EXPECT_NEAR(run.bubble_fraction, kind == ScheduleKind::kZeroBubble ? 1.0 - 12.0 / 36 : 0.75,
                1e-9)
        << to_string(kind);
  }
}

TEST(PipelineSchedule, EveryActionHasItsPlace) {
  const Program program = compile(ScheduleKind::kOneFOneB, 2, 3);
  ASSERT_EQ(program.ranks.size(), 2u);
  std::vector<std::string> rank0, rank1;
  for (const Action& a : program.ranks[0]) rank0.push_back(short_name(a));
  for (const Action& a : program.ranks[1]) rank1.push_back(short_name(a));
  EXPECT_EQ(rank0,
            (std::vector<std::string>{"F0.0", "sA0.0", "F0.1", "sA0.1", "rG0.0", "B0.0", "F0.2",
                                      "sA0.2", "rG0.1", "B0.1", "rG0.2", "B0.2", "OPT"}));
  EXPECT_EQ(rank1,
            (std::vector<std::string>{"rA1.0", "F1.0", "B1.0", "sG1.0", "rA1.1", "F1.1", "B1.1",
                                      "sG1.1", "rA1.2", "F1.2", "B1.2", "sG1.2", "OPT"}));
}

TEST(PipelineSchedule, TheSimulatorNamesTheRanksOfADeadlock) {
  Program program = compile(ScheduleKind::kOneFOneB, 2, 2);
  // Rank 1 waits for micro-batch 1's activation before it sends micro-batch 0's gradient, while
  // rank 0 (1F1B) waits for that gradient before it runs micro-batch 1's forward: valid per
  // rank, a deadlock together.
  auto& r0 = program.ranks[0];
  r0 = {{ActionType::kForward, 0, 0},        {ActionType::kSendActivation, 0, 0},
        {ActionType::kRecvGradient, 0, 0},   {ActionType::kBackward, 0, 0},
        {ActionType::kForward, 0, 1},        {ActionType::kSendActivation, 0, 1},
        {ActionType::kRecvGradient, 0, 1},   {ActionType::kBackward, 0, 1},
        {ActionType::kOptimizerStep, -1, -1}};
  auto& r1 = program.ranks[1];
  r1 = {{ActionType::kRecvActivation, 1, 0}, {ActionType::kForward, 1, 0},
        {ActionType::kRecvActivation, 1, 1}, {ActionType::kForward, 1, 1},
        {ActionType::kBackward, 1, 0},       {ActionType::kSendGradient, 1, 0},
        {ActionType::kBackward, 1, 1},       {ActionType::kSendGradient, 1, 1},
        {ActionType::kOptimizerStep, -1, -1}};
  try {
    simulate(program);
    FAIL() << "no deadlock found";
  } catch (const ScheduleError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("deadlocks"), std::string::npos) << what;
    EXPECT_NE(what.find("rank 0 waits in action 2 (recv gradient of stage 0, micro-batch 0)"),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("rank 1 waits in action 2 (recv activation of stage 1, micro-batch 1)"),
              std::string::npos)
        << what;
  }
}

TEST(PipelineSchedule, ValidationNamesAMissingOrMisplacedAction) {
  Program program = compile(ScheduleKind::kGPipe, 2, 2);
  auto& r1 = program.ranks[1];
  // Drop rank 1's last backward (and its send): rank 0 would wait forever.
  const auto b = std::find(r1.begin(), r1.end(), Action{ActionType::kBackward, 1, 1});
  ASSERT_NE(b, r1.end());
  r1.erase(b, b + 2);
  EXPECT_THROW(
      {
        try {
          validate(program);
        } catch (const ScheduleError& e) {
          EXPECT_NE(std::string(e.what()).find("never runs the backward of stage 1, micro-batch 1"),
                    std::string::npos)
              << e.what();
          throw;
        }
      },
      ScheduleError);
  Program swapped = compile(ScheduleKind::kGPipe, 2, 1);
  std::swap(swapped.ranks[1][0], swapped.ranks[1][1]);  // forward before its receive
  EXPECT_THROW(validate(swapped), ScheduleError);
}

TEST(PipelineSchedule, BadShapesGetAnErrorThatSaysWhatWorks) {
  auto message = [](const ScheduleOptions& options) {
    try {
      compile_schedule(options);
    } catch (const UsageError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message({.kind = ScheduleKind::kOneFOneB, .layout = {.ranks = 4}, .micro_batches = 0})
                .find("micro-batches must be >= 1, got 0"),
            std::string::npos);
  EXPECT_NE(message({.kind = ScheduleKind::kInterleaved,
                     .layout = {.ranks = 4, .virtual_stages = 2},
                     .micro_batches = 6})
                .find("multiple of the 4 pipeline ranks, got 6: use 8 or 4"),
            std::string::npos);
  EXPECT_NE(message({.kind = ScheduleKind::kOneFOneB,
                     .layout = {.ranks = 2, .virtual_stages = 2},
                     .micro_batches = 4})
                .find("use the interleaved schedule"),
            std::string::npos);
  EXPECT_EQ(schedule_from_string("zero-bubble"), ScheduleKind::kZeroBubble);
  EXPECT_THROW(schedule_from_string("pipedream"), UsageError);
}

}  // namespace
}  // namespace cohort::parallel::pipeline

#include "cohort/trace.h"

#include <gtest/gtest.h>

#include <chrono>
#include <optional>

#include "cohort/json.h"

namespace cohort::trace {
namespace {

// The recorder is the process's: each test starts from what the ones before it left (steps
// already ended, totals not yet taken).

TEST(Trace, PhasesAddUpPerReportAndStepsAreCounted) {
  take_totals();
  const int64_t step = current_step();
  {
    Span backward(Phase::kBackward);
    add(Phase::kCommWait, 0.25);  // a wait inside the backward pass
  }
  add(Phase::kDataWait, 0.5);
  end_step();
  end_step();
  const Totals totals = take_totals();
  EXPECT_EQ(totals.steps, 2);
  EXPECT_DOUBLE_EQ(totals.seconds[static_cast<size_t>(Phase::kDataWait)], 0.5);
  EXPECT_DOUBLE_EQ(totals.seconds[static_cast<size_t>(Phase::kCommWait)], 0.25);
  // Recorded at all: the clock ticks between a span's start and end, and between two steps.
  EXPECT_GT(totals.seconds[static_cast<size_t>(Phase::kBackward)], 0.0);
  EXPECT_GT(totals.wall_seconds, 0.0);
  EXPECT_GE(totals.busy_seconds, 0.0);
  EXPECT_EQ(current_step(), step + 2);
  // Taken: the next report starts from nothing.
  EXPECT_EQ(take_totals().steps, 0);
}

// The step time without waits is over the steps the wall time is measured over: a long wait in
// the first step (a peer still starting) is not taken off the later steps' time. It was, and a
// rank that computed 30 ms per step could be measured at 24 ms on a busy machine.
TEST(Trace, AWaitInTheFirstStepIsNotTakenOffTheOthers) {
  take_totals();
  add(Phase::kCommWait, 10.0);  // the first step: ten seconds waiting for a peer
  end_step();
  const auto busy = std::chrono::steady_clock::now();
  for (int step = 0; step < 2; ++step) {
    while (std::chrono::steady_clock::now() - busy < std::chrono::milliseconds(20 * (step + 1))) {
    }
    end_step();
  }
  const Totals totals = take_totals();
  EXPECT_EQ(totals.steps, 3);
  // Two steps of about 20 ms measured, extended to three: about 60 ms of work, none of it waits.
  EXPECT_GE(totals.busy_seconds, 0.055) << totals.wall_seconds;
  EXPECT_NEAR(totals.busy_seconds, totals.wall_seconds, 1e-9);
}

TEST(Trace, OnlyTheProfiledStepsBecomeEventsHandedOnOnceTheLastEnds) {
  std::optional<std::vector<Event>> handed;
  int calls = 0;
  const int64_t first = current_step() + 1;  // the second step from here
  set_profile_steps(first, first + 1, [&](const std::vector<Event>& events) {
    handed = events;
    ++calls;
  });
  for (int64_t step = first - 1; step <= first + 2; ++step) {
    { Span forward(Phase::kForward); }
    add(Phase::kCommWait, 0.001);
    end_step();
    if (step < first + 1) {
      EXPECT_FALSE(handed.has_value()) << "handed after step " << step;
    }
  }
  finish_profile();  // already handed: not again
  EXPECT_EQ(calls, 1);
  ASSERT_TRUE(handed.has_value());
  ASSERT_EQ(handed->size(), 4u);
  for (const auto& e : *handed) {
    EXPECT_TRUE(e.step == first || e.step == first + 1) << e.step;
    EXPECT_GT(e.start_us, 1.6e15);  // microseconds since 1970, in this century
  }
  EXPECT_EQ((*handed)[1].phase, Phase::kCommWait);
  EXPECT_NEAR((*handed)[1].duration_us, 1000, 1);

  const Json trace = Json::parse(chrome_trace(*handed, 1));
  int complete = 0;
  for (const auto& e : trace["traceEvents"]) {
    EXPECT_EQ(e["pid"], 1);
    if (e["ph"] == "X") {
      ++complete;
      EXPECT_TRUE(e["name"] == "forward" || e["name"] == "comm_wait") << e;
      EXPECT_TRUE(e["args"]["step"] == first || e["args"]["step"] == first + 1) << e;
    }
  }
  EXPECT_EQ(complete, 4);
}

TEST(Trace, ARunThatEndsInsideTheWindowHandsWhatItRecorded) {
  std::vector<Event> handed;
  const int64_t step = current_step();
  set_profile_steps(step, step + 100, [&](const std::vector<Event>& events) { handed = events; });
  { Span optimizer(Phase::kOptimizer); }
  end_step();
  finish_profile();
  ASSERT_EQ(handed.size(), 1u);
  EXPECT_EQ(handed[0].phase, Phase::kOptimizer);
  EXPECT_EQ(handed[0].step, step);
}

}  // namespace
}  // namespace cohort::trace

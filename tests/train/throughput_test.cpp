#include "cohort/train/throughput.h"

#include <gtest/gtest.h>

#include "cohort/error.h"

namespace {

using cohort::train::Throughput;
using Clock = Throughput::Clock;
using std::chrono::milliseconds;

TEST(Throughput, LeavesOutTheWarmUpAndTheTimeBetweenPasses) {
  const auto t0 = Clock::time_point{};
  Throughput throughput({.warmup_steps = 2});
  throughput.start(t0);
  // Two slow warm-up steps, then two of 100 ms over 50 samples each.
  throughput.step(50, t0 + milliseconds(900));
  throughput.step(50, t0 + milliseconds(1800));
  throughput.step(50, t0 + milliseconds(1900));
  throughput.step(50, t0 + milliseconds(2000));
  // An evaluation of 5 s, then a new pass: its time is not training time.
  throughput.start(t0 + milliseconds(7000));
  throughput.step(50, t0 + milliseconds(7100));
  EXPECT_EQ(throughput.steps(), 5);
  EXPECT_EQ(throughput.measured_steps(), 3);
  ASSERT_TRUE(throughput.samples_per_second());
  EXPECT_NEAR(*throughput.samples_per_second(), 500.0, 1e-9);
  EXPECT_EQ(throughput.why_unmeasured(), "");
}

TEST(Throughput, AShortRunIsMeasuredOverTheStepsAfterItsFirst) {
  const auto t0 = Clock::time_point{};
  Throughput throughput({.warmup_steps = 5});
  throughput.start(t0);
  throughput.step(10, t0 + milliseconds(1000));
  throughput.step(10, t0 + milliseconds(1050));
  throughput.step(10, t0 + milliseconds(1100));
  EXPECT_EQ(throughput.measured_steps(), 2);
  ASSERT_TRUE(throughput.samples_per_second());
  EXPECT_NEAR(*throughput.samples_per_second(), 200.0, 1e-9);
}

TEST(Throughput, OneStepIsNotMeasuredAndSaysWhy) {
  Throughput throughput;
  EXPECT_FALSE(throughput.samples_per_second());
  EXPECT_NE(throughput.why_unmeasured().find("no step"), std::string::npos);
  throughput.step(64);
  EXPECT_FALSE(throughput.samples_per_second());
  EXPECT_EQ(throughput.measured_steps(), 0);
  EXPECT_NE(throughput.why_unmeasured().find("1 step"), std::string::npos);
  EXPECT_THROW(Throughput({.warmup_steps = -1}), cohort::UsageError);
}

}  // namespace

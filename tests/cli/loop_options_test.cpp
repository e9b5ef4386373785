// A training loop's flags for a user's own program (cli::LoopOptions, add_loop_options): the
// loop's options and learning-rate schedule they give on every worker, and a bad value named by
// its flag.
#include "cohort/cli/loop_options.h"

#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "cohort/error.h"
#include "support/expect.h"
#include "support/parse_flags.h"

namespace cohort::cli {
namespace {

LoopOptions loop_flags(std::vector<std::string> args) {
  CLI::App app("test");
  LoopOptions loop{.epochs = 2, .batch_size = 16};  // the program's defaults
  add_loop_options(&app, loop);
  cohort::testing::parse_flags(app, std::move(args));
  return loop;
}

TEST(LoopOptions, FlagsGiveTheLoopsOptionsOnEveryWorker) {
  const auto defaults = loop_flags({});
  EXPECT_EQ(defaults.epochs, 2);
  EXPECT_EQ(defaults.batch_size, 16);
  const auto flags = loop_flags({"--epochs", "3", "--batch-size", "32", "--max-steps", "40",
                                 "--seed", "7", "--warmup-steps", "5", "--lr-decay", "cosine"});
  // As the workers read them from the Trainer's config.
  const auto loop_options = Json(flags).get<LoopOptions>();
  train::EpochLoopOptions loop;
  loop_options.apply(loop);
  EXPECT_EQ(loop.epochs, 3);
  EXPECT_EQ(loop.batch_size, 32);
  EXPECT_EQ(loop.max_steps, 40);
  EXPECT_EQ(loop_options.seed, 7u);
  const auto schedule = loop_options.lr_schedule(100);
  EXPECT_EQ(schedule.warmup_steps, 5);
  EXPECT_EQ(schedule.decay, "cosine");
  EXPECT_EQ(schedule.total_steps, 100);
  EXPECT_DOUBLE_EQ(schedule.factor(4), 1.0);  // the warmup's last step: the full lr
  EXPECT_NEAR(schedule.factor(99), 0.0, 1e-3);
}

TEST(LoopOptions, ARunNoLongerThanItsWarmupDoesNotDecay) {
  const auto options = loop_flags({"--warmup-steps", "10", "--lr-decay", "linear"});
  EXPECT_EQ(options.lr_schedule(10).decay, "none");
  EXPECT_EQ(options.lr_schedule(11).decay, "linear");
}

TEST(LoopOptions, ADeepSpeedSchedulerReplacesTheWarmupAndDecayFlags) {
  auto options = loop_flags({"--warmup-steps", "10", "--lr-decay", "linear"});
  options.schedule = optim::LrScheduleOptions{.warmup_steps = 3, .warmup_type = "log"};
  const auto read = Json(options).get<LoopOptions>();
  ASSERT_TRUE(read.schedule.has_value());
  EXPECT_EQ(read.lr_schedule(100).warmup_steps, 3);
  EXPECT_EQ(read.lr_schedule(100).warmup_type, "log");
  EXPECT_FALSE(Json(loop_flags({})).get<LoopOptions>().schedule.has_value());
}

TEST(LoopOptions, ABadValueIsNamedByItsFlag) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--epochs", "0"}, "--epochs 0 must be >= 1"},
      {{"--batch-size", "0"}, "--batch-size 0 must be >= 1"},
      {{"--max-steps", "-1"}, "--max-steps -1 must be >= 0 (0: no limit)"},
      {{"--warmup-steps", "-3"}, "--warmup-steps -3 must be >= 0"},
      {{"--lr-decay", "exp"}, "unknown --lr-decay 'exp': choose none, cosine or linear"},
  };
  for (const auto& [args, message] : cases) {
    const auto options = loop_flags(args);
    cohort::testing::expect_error<UsageError>([&] { options.validate(); }, message);
  }
  Json wrong = Json(loop_flags({}));
  wrong["epochs"] = "five";
  cohort::testing::expect_error<UsageError>([&] { (void)wrong.get<LoopOptions>(); },
                                            "field 'epochs' is string");
}

}  // namespace
}  // namespace cohort::cli

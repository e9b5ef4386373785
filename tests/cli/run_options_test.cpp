// A run's flags for a user's own program (cli::RunOptions, add_run_options): the RunConfig they
// make, a bad value named by its flag, the loop's cadence, and the same options through JSON.
#include "cohort/cli/run_options.h"

#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "cohort/error.h"
#include "support/expect.h"
#include "support/parse_flags.h"

namespace cohort::cli {
namespace {

RunOptions parsed(std::vector<std::string> args) {
  CLI::App app("test");
  RunOptions options;
  add_run_options(&app, options);
  cohort::testing::parse_flags(app, std::move(args));
  return options;
}

TEST(RunOptions, FlagsMakeTheRunConfigAndTheLoopsCadence) {
  const auto options =
      parsed({"--name", "r", "--umask", "027", "--heartbeat-timeout", "2.5",
              "--checkpoint-every-steps", "10", "--async-checkpoint", "--checkpoint-when-busy",
              "skip", "--profile-steps", "3-4", "--dashboard", "0", "--recovery", "live"});
  const auto run = options.run_config();
  EXPECT_EQ(run.name, "r");
  EXPECT_EQ(run.umask, 027);
  EXPECT_EQ(run.failure_config.heartbeat_timeout, std::chrono::milliseconds(2500));
  EXPECT_EQ(run.failure_config.recovery, FailureConfig::Recovery::kLive);
  EXPECT_EQ(run.profile_steps.first, 3);
  EXPECT_EQ(run.profile_steps.last, 4);
  ASSERT_TRUE(run.dashboard.has_value());
  EXPECT_EQ(run.dashboard->port, 0);
  train::EpochLoopOptions loop;
  options.apply(loop);
  EXPECT_EQ(loop.checkpoint_every_steps, 10);
  EXPECT_EQ(loop.snapshot_every_steps, 0);
  EXPECT_TRUE(loop.save.async);
  EXPECT_TRUE(loop.save.skip_when_busy);
  // Through a config's JSON (the workers' copy), the same options.
  const auto read = Json(options).get<RunOptions>();
  EXPECT_EQ(Json(read), Json(options));
  EXPECT_EQ(read.checkpoint_every_steps, 10);
  EXPECT_EQ(read.dashboard, "0");
}

TEST(RunOptions, ABadValueIsNamedByItsFlag) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--recovery", "later"}, "unknown --recovery 'later': choose restart or live"},
      {{"--checkpoint-when-busy", "skip"}, "--checkpoint-when-busy skip needs --async-checkpoint"},
      {{"--snapshot-every-steps", "5", "--snapshot-dir", ""}, "needs a --snapshot-dir"},
      {{"--checkpoint-every-steps", "0"}, "--checkpoint-every-steps 0 must be >= 1"},
      {{"--umask", "999"}, "unknown --umask '999'"},
      {{"--dashboard", "http"}, "--dashboard 'http' is not a port"},
      {{"--profile-steps", "5-2"}, "the last step is before the first"},
      {{"--heartbeat-timeout", "0"}, "--heartbeat-timeout 0"},
      {{"--rdzv", "etcd://"}, "--rdzv"},
  };
  for (const auto& [args, fragment] : cases) {
    const auto options = parsed(args);
    cohort::testing::expect_error<UsageError>([&] { options.run_config(); }, fragment);
  }
  cohort::testing::expect_error<UsageError>(
      [] {
        parsed({"--profile-steps", "50"}).run_config(/*max_steps=*/20);
      },
      "the run stops after --max-steps 20, before step 50");
  cohort::testing::expect_error<UsageError>(
      [] {
        Json{{"resume", "yes"}}.get<RunOptions>();
      },
      "field 'resume' is string");
}

}  // namespace
}  // namespace cohort::cli

// The workers' flags for a user's own program (cli::ScalingOptions, add_scaling_options): the
// ScalingConfig they make with the plan's mesh, and a bad value named by its flag before any
// worker starts.
#include "cohort/cli/scaling_options.h"

#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "cohort/cli/plan_options.h"
#include "cohort/error.h"
#include "support/expect.h"
#include "support/parse_flags.h"

namespace cohort::cli {
namespace {

// The scaling and plan options of `args`, parsed as a program with both sets of flags parses
// them.
std::pair<ScalingOptions, PlanOptions> scaling_flags(std::vector<std::string> args) {
  CLI::App app("test");
  ScalingOptions scaling{.workers = 4};
  PlanOptions plan;
  add_scaling_options(&app, scaling);
  add_plan_options(&app, plan);
  cohort::testing::parse_flags(app, std::move(args));
  return {scaling, plan};
}

TEST(ScalingOptions, FlagsAndThePlansMeshMakeTheScalingConfig) {
  const auto [defaults, no_plan] = scaling_flags({});
  EXPECT_EQ(defaults.workers, 4);  // the program's default
  const auto [scaling, plan] =
      scaling_flags({"--workers", "8", "--min-workers", "4", "--threads", "2", "--pp", "2", "--tp",
                     "2", "--backend", "gloo", "--sync", "ddp"});
  const auto config = scaling.scaling_config(plan.plan(scaling.workers));
  EXPECT_EQ(config.num_workers, 8);
  EXPECT_EQ(config.min_workers, 4);
  EXPECT_EQ(config.resources_per_worker.cpu_threads, 2);
  EXPECT_EQ(config.backend, "gloo");
  EXPECT_FALSE(config.use_gpu);
  EXPECT_EQ(config.mesh.pp, 2);
  EXPECT_EQ(config.mesh.tp, 2);
  const auto [servers, async] = scaling_flags({"--sync", "async-ps:2", "--parameter-servers", "2"});
  EXPECT_EQ(servers.scaling_config(async.plan(servers.workers)).num_parameter_servers, 2);
}

TEST(ScalingOptions, ABadValueIsNamedByItsFlag) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--workers", "0"}, "--workers 0 must be >= 1"},
      {{"--threads", "0"}, "--threads 0"},
      {{"--gpus-per-worker", "-1"}, "--gpus-per-worker -1 must be >= 0"},
      {{"--gpus-per-worker", "2"}, "--gpus-per-worker 2 needs --use-gpu"},
      {{"--parameter-servers", "1"},
       "--parameter-servers 1 with --sync ddp: parameter servers serve only --sync async-ps:K"},
      {{"--cuda-graph"}, "--cuda-graph needs --use-gpu"},
      {{"--cuda-graph", "--use-gpu", "--backend", "gloo"},
       "--cuda-graph needs NCCL's collectives (--backend auto or nccl)"},
      {{"--precision", "fp16"}, "precision fp16 needs a GPU"},
  };
  for (const auto& [args, message] : cases) {
    SCOPED_TRACE(args.front());
    const auto [scaling, plan] = scaling_flags(args);
    cohort::testing::expect_error<UsageError>(
        [&, &scaling = scaling, &plan = plan] { scaling.scaling_config(plan.plan()); }, message);
  }
}

}  // namespace
}  // namespace cohort::cli

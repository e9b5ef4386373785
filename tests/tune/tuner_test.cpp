#include "cohort/tune/tuner.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>

#include "cohort/cohort.h"
#include "cohort/runtime/worker_info.h"
#include "support/expect.h"
#include "support/subprocess.h"
#include "support/tiny_mnist.h"

namespace cohort::tune {
namespace {

using cohort::testing::expect_error;

Json read_json_file(const std::filesystem::path& path) {
  std::ifstream in(path);
  return Json::parse(in);
}

RunConfig quiet_run(const std::filesystem::path& dir, const std::string& name) {
  return RunConfig{.name = name, .storage_path = dir, .verbose = 0};
}

// Simulated work of about `seconds` on one thread.
void work_for(double seconds) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  auto a = torch::rand({64, 64});
  while (std::chrono::steady_clock::now() < until) a = torch::tanh(torch::mm(a, a) * 0.01);
}

// score = -(x - 2)^2, a little higher each iteration; throws for x == throw_at.
void quadratic(const Json& c) {
  const double x = c["x"].get<double>();
  for (int i = 1; i <= c.value("iterations", 3); ++i) {
    if (c.contains("throw_at") && x == c["throw_at"].get<double>()) {
      throw std::runtime_error("x=" + std::to_string(x) + " is out of its domain");
    }
    train::report({{"score", -(x - 2) * (x - 2) + 0.01 * i}, {"x_seen", x}});
  }
}

TEST(Tuner, AGridOfTrialsFindsTheBestAndKeepsTheExperiment) {
  const auto dir = cohort::testing::temp_dir("tuner_grid");
  Tuner tuner(
      quadratic, Json{{"x", grid_search({0.0, 1.0, 2.0, 3.5})}, {"iterations", 3}},
      TuneConfig{
          .metric = "score", .mode = "max", .max_concurrent_trials = 2, .max_cpu_threads = 2},
      RunConfig{.name = "grid", .storage_path = dir, .verbose = 1});
  // Trial processes re-run this test up to fit() and end there: only the tuner's own process
  // captures (a capture never read leaves its file in /tmp).
  if (runtime::spawned_role().empty()) ::testing::internal::CaptureStdout();
  const ResultGrid grid = tuner.fit();
  const std::string output = ::testing::internal::GetCapturedStdout();
  ASSERT_EQ(grid.size(), 4u);
  EXPECT_EQ(grid.num_errors(), 0) << grid.errors()[0];
  EXPECT_EQ(grid.num_terminated(), 4);
  const Result best = grid.get_best_result();
  EXPECT_EQ(best.config["x"], 2.0);
  EXPECT_EQ(best.metrics["x_seen"], 2.0);  // the config reached the trial's function
  EXPECT_EQ(best.metrics_history.size(), 3u);
  EXPECT_EQ(best.path, dir / "grid" / "trial_00002");
  EXPECT_EQ(grid.get_best_result("score", "min").config["x"], 0.0);  // -(0 - 2)^2 is the lowest
  for (size_t i = 0; i < grid.size(); ++i) EXPECT_EQ(grid.trials()[i].iterations, 3);
  // The experiment on disk: its state, one folder per trial, a table of trials.
  const Json state = read_json_file(dir / "grid" / "experiment_state.json");
  ASSERT_EQ(state["trials"].size(), 4u);
  for (const auto& trial : state["trials"]) EXPECT_EQ(trial["status"], "TERMINATED");
  const std::string csv = cohort::testing::read_text((dir / "grid" / "trials.csv").string());
  EXPECT_EQ(csv.substr(0, csv.find('\n'))
                .find("trial_name,status,stopped_early,config/x,config/iterations"),
            0u)
      << csv;
  EXPECT_EQ(std::count(csv.begin(), csv.end(), '\n'), 5);
  // The status table, as plain lines when stdout is not a terminal.
  EXPECT_NE(output.find("== Status =="), std::string::npos) << output;
  EXPECT_NE(output.find("Number of trials: 4/4 (4 TERMINATED)"), std::string::npos) << output;
  EXPECT_NE(output.find("Current best trial: trial_00002 with score=0.03 and parameters={x=2}"),
            std::string::npos)
      << output;
  EXPECT_NE(output.find("trial_00003 iter 3: score="), std::string::npos) << output;
  // A second experiment of the same name is refused: it would mix with the first.
  expect_error<UsageError>([&] { tuner.fit(); }, "continue it with Tuner::restore");
}

TEST(Tuner, ATrialThatThrowsIsErroredWhileTheOthersFinish) {
  const auto dir = cohort::testing::temp_dir("tuner_errors");
  Tuner tuner(quadratic, Json{{"x", grid_search({0.0, 1.0, 2.0})}, {"throw_at", 1.0}},
              TuneConfig{.metric = "score", .mode = "max", .max_cpu_threads = 2},
              quiet_run(dir, "errors"));
  const ResultGrid grid = tuner.fit();
  ASSERT_EQ(grid.size(), 3u);
  EXPECT_EQ(grid.num_errors(), 1);
  EXPECT_EQ(grid.num_terminated(), 2);
  ASSERT_EQ(grid.errors().size(), 1u);
  EXPECT_NE(grid.errors()[0].find("trial_00001: "), std::string::npos) << grid.errors()[0];
  EXPECT_NE(grid.errors()[0].find("x=1.000000 is out of its domain"), std::string::npos)
      << grid.errors()[0];
  EXPECT_FALSE(grid[1].ok());
  EXPECT_TRUE(grid[0].ok());
  EXPECT_TRUE(grid[2].ok());
  EXPECT_EQ(grid.get_best_result().config["x"], 2.0);
}

// Each trial logs when its worker trained and with how many threads: the intervals show what
// ran at once.
void timed_trial(const Json& c) {
  const auto now = [] {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
        .count();
  };
  const double start = now();
  work_for(1.0);
  train::report({{"done", 1}});
  std::ofstream(std::filesystem::path(c["log_dir"].get<std::string>()) /
                (std::to_string(::getpid()) + ".json"))
      << Json{{"start", start}, {"end", now()}, {"threads", torch::get_num_threads()}}.dump();
}

TEST(Tuner, RunningTrialsNeverRequestMoreThreadsThanAllowed) {
  const auto dir = cohort::testing::temp_dir("tuner_threads");
  const auto logs = dir / "intervals";
  std::filesystem::create_directories(logs);
  Tuner tuner(timed_trial,
              Json{{"scaling_config", {{"cpu_threads", grid_search({1, 2, 1, 1, 2})}}},
                   {"log_dir", logs.string()}},
              TuneConfig{.max_cpu_threads = 2}, quiet_run(dir, "threads"));
  const ResultGrid grid = tuner.fit();
  ASSERT_EQ(grid.num_terminated(), 5) << (grid.errors().empty() ? "" : grid.errors()[0]);
  std::vector<std::pair<double, int>> events;  // (time, +threads at a start, -threads at an end)
  int two_thread_trials = 0;
  for (const auto& entry : std::filesystem::directory_iterator(logs)) {
    const Json interval = read_json_file(entry.path());
    const int threads = interval["threads"].get<int>();
    two_thread_trials += threads == 2;
    events.emplace_back(interval["start"].get<double>(), threads);
    events.emplace_back(interval["end"].get<double>(), -threads);
  }
  ASSERT_EQ(events.size(), 10u);
  EXPECT_EQ(two_thread_trials, 2);  // scaling_config.cpu_threads reached the workers
  std::sort(events.begin(), events.end());
  int in_use = 0, most = 0;
  for (const auto& [time, delta] : events) {
    in_use += delta;
    most = std::max(most, in_use);
  }
  EXPECT_EQ(most, 2);  // never more than allowed, and the room was used
}

// Quality q from the param space; the score grows toward q with the iterations.
void ranked_trial(const Json& c) {
  const double q = c["q"].get<double>();
  int start = 0;
  if (auto checkpoint = train::get_checkpoint())
    start = checkpoint->metrics()["iteration"].get<int>();
  for (int i = start + 1; i <= 6; ++i) {
    work_for(0.1);
    train::report({{"score", q * (1 - 1.0 / (i + 1))}, {"iteration", i}});
  }
}

TEST(Tuner, ASHAStopsPoorTrialsEarlyAndKeepsTheBestToTheEnd) {
  const auto dir = cohort::testing::temp_dir("tuner_asha");
  const std::vector<double> qualities{0.2, 0.9, 0.1, 0.5, 0.3, 0.8, 0.05, 0.6};
  Tuner tuner(ranked_trial, Json{{"q", grid_search(qualities)}},
              TuneConfig{.metric = "score",
                         .mode = "max",
                         .max_concurrent_trials = 2,
                         .scheduler = std::make_shared<ASHAScheduler>(
                             ASHAOptions{.max_t = 6, .grace_period = 1, .reduction_factor = 2}),
                         .max_cpu_threads = 2},
              quiet_run(dir, "asha"));
  const ResultGrid grid = tuner.fit();
  ASSERT_EQ(grid.size(), qualities.size());
  EXPECT_EQ(grid.num_errors(), 0) << grid.errors()[0];
  int64_t iterations = 0;
  for (const auto& t : grid.trials()) iterations += t.iterations;
  EXPECT_LT(iterations, 6 * static_cast<int64_t>(qualities.size()));
  // The best is never below a rung's cutoff; the worst arrives after six others set the cutoff.
  EXPECT_EQ(grid.trials()[1].iterations, 6);
  EXPECT_EQ(grid.trials()[1].status, "TERMINATED");
  EXPECT_FALSE(grid.trials()[1].stopped_early);  // it ran as long as ASHA allows: not early
  EXPECT_TRUE(grid.trials()[6].stopped_early);
  EXPECT_LT(grid.trials()[6].iterations, 6);
  EXPECT_TRUE(grid[6].ok());  // stopped early is not an error
  EXPECT_EQ(grid.get_best_result().config["q"], 0.9);
}

// Reports every 0.2 s of work, for much longer than the budget.
void long_trial(const Json& c) {
  for (int i = 1; i <= 200; ++i) {
    work_for(0.2);
    train::report({{"score", i}});
  }
}

TEST(Tuner, TheTimeBudgetStopsRunningTrialsAndStartsNoMore) {
  const auto dir = cohort::testing::temp_dir("tuner_budget");
  const auto started = std::chrono::steady_clock::now();
  const ResultGrid grid =
      Tuner(long_trial, Json{{"x", grid_search({1, 2, 3, 4, 5, 6})}},
            TuneConfig{.max_concurrent_trials = 2, .time_budget_s = 4, .max_cpu_threads = 2},
            quiet_run(dir, "budget"))
          .fit();
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  EXPECT_LT(took, 40) << "a 4 s budget, trials of 40 s";
  ASSERT_EQ(grid.size(), 2u);  // the first two, stopped; the other four never started
  for (const auto& t : grid.trials()) {
    EXPECT_EQ(t.status, "TERMINATED");
    EXPECT_TRUE(t.stopped_early);
    EXPECT_LT(t.iterations, 200);
  }
}

TEST(Tuner, BadConfigurationsAreNamed) {
  const auto dir = cohort::testing::temp_dir("tuner_bad");
  expect_error<UsageError>(
      [&] {
        Tuner(quadratic, Json{{"x", 1.0}}, TuneConfig{.metric = "score"}, quiet_run(dir, "a"))
            .fit();
      },
      "TuneConfig.metric='score' needs TuneConfig.mode");
  expect_error<UsageError>(
      [&] {
        Tuner(quadratic, Json{{"x", loguniform(-1, 1)}}, TuneConfig{}, quiet_run(dir, "b")).fit();
      },
      "param_space/x: loguniform needs 0 < lower");
  expect_error<UsageError>(
      [&] {
        Tuner(quadratic, Json{{"x", 1.0}}, TuneConfig{.num_samples = 0}, quiet_run(dir, "c")).fit();
      },
      "num_samples=0 must be >= 1");
  expect_error<UsageError>([&] { Tuner::restore(dir / "nothing", quadratic).fit(); },
                           "holds no experiment");
  // A trial that can never fit is an error of its own, not a hang.
  const ResultGrid grid =
      Tuner(quadratic, Json{{"x", 1.0}, {"scaling_config", {{"cpu_threads", 3}}}},
            TuneConfig{.max_cpu_threads = 2}, quiet_run(dir, "d"))
          .fit();
  ASSERT_EQ(grid.num_errors(), 1);
  EXPECT_NE(grid.errors()[0].find("requests 3 CPU threads"), std::string::npos) << grid.errors()[0];
}

}  // namespace
}  // namespace cohort::tune

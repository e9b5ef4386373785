// What a run shows about itself: where the step time goes and which rank is slow (in its
// reports and TensorBoard files), and Chrome traces of chosen steps.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <fstream>
#include <set>
#include <thread>

#include "cohort/cohort.h"
#include "support/tiny_mnist.h"
#include "train/run_recorder.h"
#include "train/tensorboard_log.h"

namespace cohort {
namespace {

namespace fs = std::filesystem;

TEST(Observability, ReportsNameTheSlowRankAndProfiledStepsBecomeChromeTraces) {
  const auto dir = testing::temp_dir("observability");
  RunConfig run{.name = "slow",
                .storage_path = dir,
                .verbose = 0,
                .setup_timeout = std::chrono::seconds(30),
                .collective_timeout = std::chrono::seconds(60),
                .profile_steps = {.first = 3, .last = 5}};
  Trainer trainer(
      [](const Json&) {
        auto& ctx = train::get_context();
        torch::manual_seed(0);
        auto model = train::prepare_model(torch::nn::Linear(16, 1));
        torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.01));
        const auto x = torch::randn({32, 16});
        for (int report = 0; report < 2; ++report) {
          for (int step = 0; step < 4; ++step) {
            optimizer.zero_grad();
            at::Tensor loss;
            {
              auto forward = train::autocast();
              loss = model->forward(x).pow(2).mean();
              // Rank 1 stands for a slow device: its forward takes 30 ms longer.
              if (ctx.get_world_rank() == 1)
                std::this_thread::sleep_for(std::chrono::milliseconds(30));
            }
            train::backward(loss);
            train::step_optimizer(optimizer);
          }
          train::report({{"loss", 1.0}});
        }
      },
      ScalingConfig{.num_workers = 2}, run);
  const Result result = trainer.fit();
  ASSERT_TRUE(result.ok()) << *result.error;

  // Rank 0 waits for rank 1 in the gradient all-reduce: not counted, rank 1 is the slow one.
  for (const auto& m : result.metrics_history) {
    EXPECT_EQ(m.at("slowest_rank"), 1) << m;
    const double max = m.at("step_time_ms_max").get<double>();
    const double median = m.at("step_time_ms_median").get<double>();
    EXPECT_GE(max, 25) << m;
    EXPECT_GT(max, train::kStragglerRatio * median) << m;
    EXPECT_LE(m.at("step_time_ms_min").get<double>(), median) << m;
    EXPECT_GE(m.at("forward_ms").get<double>(), 15) << m;  // the mean of 30 and ~0
    EXPECT_GE(m.at("comm_wait_ms").get<double>(), 10) << m;
    for (const char* key : {"backward_ms", "optimizer_ms", "data_wait_ms"})
      EXPECT_TRUE(m.contains(key)) << key << " missing from " << m;
    const auto line = train::straggler_line(m);
    ASSERT_TRUE(line.has_value()) << m;
    EXPECT_NE(line->find("straggler: rank 1 takes"), std::string::npos) << *line;
  }

  // TensorBoard has the figures as scalars, one per report.
  const auto tensorboard = dir / "slow" / train::kTensorBoardDir;
  std::set<int64_t> steps_seen;
  for (const auto& file : train::event_files(tensorboard))
    for (const auto& e : train::read_events(file))
      if (e.tag == "step_time_ms_max") steps_seen.insert(e.step);
  EXPECT_EQ(steps_seen, (std::set<int64_t>{1, 2}));

  // Steps 3 to 5 of each rank, each with its forward, backward and optimizer spans.
  for (int rank = 0; rank < 2; ++rank) {
    const auto file = dir / "slow" / "trace" / ("rank-" + std::to_string(rank) + ".json");
    ASSERT_TRUE(fs::exists(file)) << file;
    std::ifstream in(file);
    const Json trace = Json::parse(in);
    std::map<std::string, std::set<int64_t>> steps_of;
    for (const auto& e : trace.at("traceEvents")) {
      if (e.at("ph") != "X") continue;
      EXPECT_EQ(e.at("pid"), rank);
      // Wall-clock microseconds since 1970, so that several ranks' traces line up.
      EXPECT_GT(e.at("ts").get<double>(), 1.6e15) << e;
      steps_of[e.at("name").get<std::string>()].insert(e.at("args").at("step").get<int64_t>());
    }
    for (const char* phase : {"forward", "backward", "optimizer", "comm_wait"})
      EXPECT_EQ(steps_of[phase], (std::set<int64_t>{3, 4, 5})) << "rank " << rank << " " << phase;
  }
  fs::remove_all(dir);
}

TEST(Observability, AStragglerLineOnlyBeyondTwentyPercentOfTheMedian) {
  const auto line = train::straggler_line(
      {{"slowest_rank", 3}, {"step_time_ms_max", 150.0}, {"step_time_ms_median", 100.0}});
  ASSERT_TRUE(line.has_value());
  EXPECT_NE(line->find("rank 3 takes 150.0 ms per step against the median rank's 100.0 ms, 50% "
                       "more (waits for peers not counted)"),
            std::string::npos)
      << *line;
  EXPECT_FALSE(
      train::straggler_line(
          {{"slowest_rank", 1}, {"step_time_ms_max", 119.0}, {"step_time_ms_median", 100.0}})
          .has_value());
  EXPECT_FALSE(train::straggler_line(
                   {{"slowest_rank", 1}, {"step_time_ms_max", 0.5}, {"step_time_ms_median", 0.1}})
                   .has_value());
  EXPECT_FALSE(train::straggler_line({{"loss", 1.0}}).has_value());
}

}  // namespace
}  // namespace cohort

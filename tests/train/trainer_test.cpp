#include "cohort/train/trainer.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <csignal>
#include <fstream>

#include "cohort/cohort.h"
#include "cohort/models/zoo.h"
#include "support/expect.h"
#include "support/subprocess.h"
#include "support/tiny_mnist.h"

namespace cohort {
namespace {

RunConfig run_config(const std::filesystem::path& dir, const std::string& name) {
  return RunConfig{.name = name,
                   .storage_path = dir,
                   .verbose = 0,
                   .setup_timeout = std::chrono::seconds(30),
                   .collective_timeout = std::chrono::seconds(60)};
}

std::vector<Json> read_jsonl(const std::filesystem::path& path) {
  std::vector<Json> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) out.push_back(Json::parse(line));
  return out;
}

TEST(Trainer, RunsTheLoopOnEveryRankAndKeepsRankZerosReports) {
  auto dir = cohort::testing::temp_dir("trainer_reports");
  Trainer trainer(
      [](const Json& config) {
        auto& ctx = train::get_context();
        std::vector<at::Tensor> ranks{torch::tensor({double(ctx.get_world_rank())})};
        ctx.get_process_group().allreduce(ranks);
        for (int i = 0; i < config["reports"].get<int>(); ++i) {
          train::report({{"i", i},
                         {"rank", ctx.get_world_rank()},
                         {"world_size", ctx.get_world_size()},
                         {"rank_sum", ranks[0].item<double>()},
                         {"name", ctx.get_experiment_name()}});
        }
      },
      ScalingConfig{.num_workers = 3}, run_config(dir, "reports"), Json{{"reports", 4}});
  Result result = trainer.fit();
  ASSERT_TRUE(result.ok()) << *result.error;
  EXPECT_EQ(result.path, dir / "reports");
  ASSERT_EQ(result.metrics_history.size(), 4u);
  EXPECT_EQ(result.metrics["i"], 3);
  EXPECT_EQ(result.metrics["rank"], 0);
  EXPECT_EQ(result.metrics["world_size"], 3);
  EXPECT_EQ(result.metrics["rank_sum"], 3.0);
  EXPECT_EQ(result.metrics["name"], "reports");
  auto lines = read_jsonl(dir / "reports" / "metrics.jsonl");
  ASSERT_EQ(lines.size(), 4u);
  EXPECT_EQ(lines[2]["i"], 2);
  EXPECT_EQ(lines[2]["training_iteration"], 3);
  auto saved = Json::parse(cohort::testing::read_text((dir / "reports" / "result.json").string()));
  EXPECT_EQ(saved["i"], 3);
  EXPECT_EQ(saved["workers"], 3);
  EXPECT_TRUE(saved["error"].is_null());
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(std::filesystem::exists(dir / "reports" / "logs" / ("rank-" + std::to_string(r) + ".log")));
  }
  std::filesystem::remove_all(dir);
}

// The heart of data parallelism, across real processes: after one step both ranks hold the
// same parameters, equal to one single-process step on the union of their batches.
TEST(Trainer, TwoWorkersAverageGradientsLikeOneProcessOnTheUnionBatch) {
  auto dir = cohort::testing::temp_dir("trainer_average");
  auto make_batch = [] {
    auto g = torch::make_generator<at::CPUGeneratorImpl>(42);
    return std::make_pair(torch::randn({16, 1, 28, 28}, g), torch::randint(0, 10, {16}, g, torch::kLong));
  };
  auto make_model = [] {
    torch::manual_seed(3);
    return models::create_model("mlp");
  };
  Trainer trainer(
      [&](const Json&) {
        auto& ctx = train::get_context();
        auto [x, y] = make_batch();
        auto model = train::prepare_model(make_model());
        torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.5));
        opt.zero_grad();
        const int64_t half = 8;
        torch::nn::functional::cross_entropy(model->forward(x.narrow(0, ctx.get_world_rank() * half, half)),
                                             y.narrow(0, ctx.get_world_rank() * half, half))
            .backward();
        opt.step();
        std::vector<torch::Tensor> params = model->parameters();
        torch::save(params, (ctx.get_storage_path() / ("params_" + std::to_string(ctx.get_world_rank()) + ".pt")).string());
      },
      ScalingConfig{.num_workers = 2}, run_config(dir, "average"));
  Result result = trainer.fit();
  ASSERT_TRUE(result.ok()) << *result.error;
  std::vector<torch::Tensor> p0, p1;
  torch::load(p0, (dir / "average" / "params_0.pt").string());
  torch::load(p1, (dir / "average" / "params_1.pt").string());
  auto reference = make_model();
  auto [x, y] = make_batch();
  torch::optim::SGD opt(reference->parameters(), torch::optim::SGDOptions(0.5));
  opt.zero_grad();
  torch::nn::functional::cross_entropy(reference->forward(x), y).backward();
  opt.step();
  auto expected = reference->parameters();
  ASSERT_EQ(p0.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_TRUE(torch::equal(p0[i], p1[i])) << "parameter " << i << " differs between ranks";
    EXPECT_TRUE(torch::allclose(p0[i], expected[i], 1e-5, 1e-6)) << "parameter " << i;
    // The step really moved the weights.
    EXPECT_FALSE(torch::allclose(p0[i], make_model()->parameters()[i]));
  }
  std::filesystem::remove_all(dir);
}

TEST(Trainer, AnExceptionOnOneRankStopsAllAndNamesTheRank) {
  auto dir = cohort::testing::temp_dir("trainer_throw");
  Trainer trainer(
      [](const Json&) {
        auto& ctx = train::get_context();
        if (ctx.get_world_rank() == 1) throw std::runtime_error("bad things on one rank");
        // Rank 0 blocks in a collective that rank 1 never joins; it must be stopped, not hang.
        std::vector<at::Tensor> t{torch::ones({1})};
        ctx.get_process_group().allreduce(t);
      },
      ScalingConfig{.num_workers = 2}, run_config(dir, "throw"));
  const auto start = std::chrono::steady_clock::now();
  Result result = trainer.fit();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.error->find("rank 1 failed: bad things on one rank"), std::string::npos) << *result.error;
  auto saved = Json::parse(cohort::testing::read_text((dir / "throw" / "result.json").string()));
  EXPECT_NE(saved["error"].get<std::string>().find("rank 1"), std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST(Trainer, AKilledWorkerEndsTheRunWithItsSignal) {
  auto dir = cohort::testing::temp_dir("trainer_kill");
  Trainer trainer(
      [](const Json&) {
        auto& ctx = train::get_context();
        if (ctx.get_world_rank() == 0) std::raise(SIGKILL);
        std::vector<at::Tensor> t{torch::ones({1})};
        ctx.get_process_group().allreduce(t);
      },
      ScalingConfig{.num_workers = 2}, run_config(dir, "kill"));
  Result result = trainer.fit();
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.error->find("rank 0"), std::string::npos) << *result.error;
  EXPECT_NE(result.error->find("signal 9"), std::string::npos) << *result.error;
  std::filesystem::remove_all(dir);
}

TEST(Trainer, RejectsBadConfigBeforeStartingWorkers) {
  auto loop = [](const Json&) {};
  EXPECT_THROW(Trainer(loop, ScalingConfig{.num_workers = 0}), UsageError);
  EXPECT_THROW(Trainer(loop, ScalingConfig{.resources_per_worker = {.cpu_threads = 0}}), UsageError);
  auto dir = cohort::testing::temp_dir("trainer_storage");
  std::ofstream(dir / "a_file") << "x";
  Trainer trainer(loop, ScalingConfig{}, run_config(dir / "a_file", "x"));
  cohort::testing::expect_error<UsageError>([&] { trainer.fit(); }, "storage path");
  std::filesystem::remove_all(dir);
}

TEST(Trainer, WorkerApiOutsideALoopSaysWhereToCallIt) {
  cohort::testing::expect_error<RuntimeError>([] { train::get_context(); },
                                              "inside the function given to cohort::Trainer");
}

}  // namespace
}  // namespace cohort

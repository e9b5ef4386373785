// Fault injection: workers killed, stopped, throwing, never joining, or dying while a checkpoint
// is being committed. Each injection fires once (a marker file in the run directory), so the
// restarted group runs clean.
#include <gtest/gtest.h>
#include <poll.h>
#include <torch/torch.h>
#include <unistd.h>

#include <csignal>
#include <fstream>
#include <future>

#include "cohort/cohort.h"
#include "support/expect.h"
#include "support/fault_injection.h"
#include "support/tiny_mnist.h"
#include "train/run_files.h"

namespace cohort {
namespace {

RunConfig run_config(const std::filesystem::path& dir, const std::string& name, int max_failures) {
  return RunConfig{.name = name,
                   .storage_path = dir,
                   .failure_config = {.max_failures = max_failures,
                                      .heartbeat_timeout = std::chrono::seconds(3)},
                   .verbose = 0,
                   .setup_timeout = std::chrono::seconds(10),
                   .collective_timeout = std::chrono::seconds(30)};
}

// A small data-parallel regression, checkpointed after every step and resumed exactly:
// config {"steps", "fault": none|kill|stop|throw|kill_before_report, "fault_rank", "fault_step"}.
void regression_loop(const Json& c) {
  auto& ctx = train::get_context();
  torch::manual_seed(7);
  auto model = torch::nn::Linear(4, 1);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  int start = 0;
  if (auto checkpoint = train::get_checkpoint()) {
    train::load_checkpoint(*checkpoint, *model, optimizer);
    start = checkpoint->metrics()["step"].get<int>() + 1;
  }
  train::prepare_model(model.ptr());
  const std::string fault = c.value("fault", std::string("none"));
  const bool my_fault = ctx.get_world_rank() == c.value("fault_rank", -1);
  for (int step = start; step < c["steps"].get<int>(); ++step) {
    auto g = torch::make_generator<at::CPUGeneratorImpl>(1000 * step + ctx.get_world_rank());
    auto x = torch::randn({8, 4}, g);
    auto y = x.sum(1, true);
    optimizer.zero_grad();
    torch::mse_loss(model->forward(x), y).backward();
    optimizer.step();
    if (my_fault && step == c["fault_step"].get<int>()) {
      if (fault == "kill_before_report" && testing::first_time_in_run(fault)) std::raise(SIGKILL);
      if (fault == "throw" && testing::first_time_in_run(fault))
        throw std::runtime_error("injected failure");
    }
    std::optional<Checkpoint> checkpoint;
    // Inside the run directory: a rank killed before removing it leaves nothing in /tmp.
    const auto tmp = ctx.get_storage_path() / ("ft-staging-" + std::to_string(::getpid()));
    if (ctx.get_world_rank() == 0) {
      checkpoint = train::save_checkpoint(tmp, *model, optimizer);
    }
    train::report({{"step", step},
                   {"weight_sum", model->weight.sum().item<double>()},
                   {"bias", model->bias.item<double>()}},
                  checkpoint);
    std::filesystem::remove_all(tmp);
    if (my_fault && step == c["fault_step"].get<int>()) {
      if (fault == "kill" && testing::first_time_in_run(fault)) std::raise(SIGKILL);
      if (fault == "stop" && testing::first_time_in_run(fault)) std::raise(SIGSTOP);
      if (fault == "hang" && testing::first_time_in_run(fault)) {
        // Alive and beating, but in none of the group's collectives: the driver ends it.
        std::promise<void>().get_future().wait_for(std::chrono::minutes(2));
      }
    }
  }
}

Result run_regression(const std::filesystem::path& dir, const std::string& name, int max_failures,
                      Json faults) {
  faults["steps"] = 8;
  Trainer trainer(regression_loop, ScalingConfig{.num_workers = 2},
                  run_config(dir, name, max_failures), faults);
  return trainer.fit();
}

// The same regression with an asynchronous parameter server (two servers, in the two workers):
// every rank checkpoints its server's shard after every step; config {"steps", "fault_rank",
// "fault_step"} kills that rank once, after its report.
void parameter_server_loop(const Json& c) {
  auto& ctx = train::get_context();
  torch::manual_seed(7);
  auto model = torch::nn::Linear(4, 1);
  train::prepare_model(model.ptr(), {.sync = parallel::AsyncParameterServer{.max_staleness = 1}});
  auto optimizer = train::prepare_optimizer(
      model.ptr(),
      std::make_unique<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.05)));
  int start = 0;
  if (auto checkpoint = train::get_checkpoint()) {
    train::load_checkpoint(*checkpoint, *model, *optimizer);
    start = checkpoint->metrics()["step"].get<int>() + 1;
  }
  for (int step = start; step < c["steps"].get<int>(); ++step) {
    auto g = torch::make_generator<at::CPUGeneratorImpl>(1000 * step + ctx.get_world_rank());
    auto x = torch::randn({8, 4}, g);
    optimizer->zero_grad();
    auto loss = torch::mse_loss(model->forward(x), x.sum(1, true));
    loss.backward();
    optimizer->step();
    const auto tmp = ctx.get_storage_path() / ("ps-staging-" + std::to_string(::getpid()));
    auto checkpoint = train::save_checkpoint(tmp, *model, *optimizer);  // on every rank
    train::report({{"step", step}, {"loss", loss.item<double>()}}, checkpoint);
    std::filesystem::remove_all(tmp);
    if (ctx.get_world_rank() == c["fault_rank"].get<int>() && step == c["fault_step"].get<int>() &&
        testing::first_time_in_run("kill"))
      std::raise(SIGKILL);
  }
}

class FaultTolerance : public ::testing::Test {
 protected:
  std::filesystem::path dir = cohort::testing::temp_dir("fault");
  void TearDown() override { std::filesystem::remove_all(dir); }
};

TEST_F(FaultTolerance, KilledWorkersRecoverToTheUninterruptedResult) {
  const Result baseline = run_regression(dir, "baseline", 0, {});
  ASSERT_TRUE(baseline.ok()) << *baseline.error;
  // A SIGKILL right after a checkpoint, at several steps and ranks: exactly the same weights.
  for (const auto& [rank, step] : std::vector<std::pair<int, int>>{{1, 1}, {0, 4}, {1, 6}}) {
    const std::string name = "kill_r" + std::to_string(rank) + "_s" + std::to_string(step);
    const Result result = run_regression(
        dir, name, 1, {{"fault", "kill"}, {"fault_rank", rank}, {"fault_step", step}});
    ASSERT_TRUE(result.ok()) << name << ": " << *result.error;
    EXPECT_EQ(result.metrics["step"], 7) << name;
    EXPECT_EQ(result.metrics["weight_sum"], baseline.metrics["weight_sum"]) << name;
    EXPECT_EQ(result.metrics["bias"], baseline.metrics["bias"]) << name;
    ASSERT_EQ(result.failures.size(), 1u) << name;
    const auto& failure = result.failures[0];
    EXPECT_EQ(failure["rank"], rank) << failure.dump();
    EXPECT_NE(failure["cause"].get<std::string>().find("signal 9"), std::string::npos)
        << failure.dump();
    // Rank 0's report of that step may or may not have reached the driver before the stop.
    EXPECT_GE(failure["reports"].get<int>(), step) << failure.dump();
    EXPECT_LE(failure["reports"].get<int>(), step + 1) << failure.dump();
    EXPECT_TRUE(failure["restarted"].get<bool>());
    EXPECT_GT(failure["recovery_s"].get<double>(), 0.0) << failure.dump();
    auto saved = read_json(dir / name / kResultFile);
    EXPECT_EQ(saved["failures"].size(), 1u);
    EXPECT_EQ(Result::from_path(dir / name).failures, result.failures) << name;
  }
}

// A dead parameter server is a dead worker: the group restarts from the latest checkpoint, each
// server reading its shard back, and trains to the end.
TEST_F(FaultTolerance, AKilledParameterServerRestartsFromItsShard) {
  Trainer trainer(
      parameter_server_loop, ScalingConfig{.num_workers = 2, .num_parameter_servers = 2},
      run_config(dir, "ps", 1), Json{{"steps", 8}, {"fault_rank", 1}, {"fault_step", 3}});
  const Result result = trainer.fit();
  ASSERT_TRUE(result.ok()) << *result.error;
  EXPECT_EQ(result.metrics["step"], 7);
  ASSERT_EQ(result.failures.size(), 1u);
  EXPECT_EQ(result.failures[0]["rank"], 1) << result.failures[0].dump();
  EXPECT_TRUE(result.failures[0]["restarted"].get<bool>());
  const auto shards = result.checkpoint->path();
  EXPECT_TRUE(std::filesystem::exists(shards / "zero-rank1-of-2.safetensors"));
}

TEST_F(FaultTolerance, WithoutRestartsTheFailureIsTheResult) {
  const Result result = run_regression(dir, "no_restart", 0,
                                       {{"fault", "kill"}, {"fault_rank", 1}, {"fault_step", 2}});
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.error->find("rank 1"), std::string::npos) << *result.error;
  ASSERT_EQ(result.failures.size(), 1u);
  EXPECT_FALSE(result.failures[0]["restarted"].get<bool>());
  EXPECT_TRUE(result.failures[0]["recovery_s"].is_null());
}

TEST_F(FaultTolerance, AStoppedRankIsFoundByItsMissingHeartbeat) {
  const auto start = std::chrono::steady_clock::now();
  const Result hung =
      run_regression(dir, "stopped", 0, {{"fault", "stop"}, {"fault_rank", 1}, {"fault_step", 2}});
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(25));
  ASSERT_FALSE(hung.ok());
  EXPECT_NE(hung.error->find("rank 1 sent no heartbeat"), std::string::npos) << *hung.error;
  // The stall inspector: rank 0 went on into the next step's all-reduce, rank 1 never did.
  EXPECT_NE(hung.error->find("ranks [1] did not enter collective #"), std::string::npos)
      << *hung.error;
  const Result recovered = run_regression(
      dir, "stopped_then_restarted", 1, {{"fault", "stop"}, {"fault_rank", 1}, {"fault_step", 2}});
  ASSERT_TRUE(recovered.ok()) << *recovered.error;
  ASSERT_EQ(recovered.failures.size(), 1u);
  EXPECT_EQ(recovered.failures[0]["rank"], 1);
}

// A rank that stays alive but leaves the group's collectives: rank 0's collective times out, and
// before the group is stopped every rank writes its flight recorder, whose records name the
// collective rank 1 never entered.
TEST_F(FaultTolerance, AHangIsExplainedByTheRanksFlightRecorders) {
  RunConfig run = run_config(dir, "hang", 0);
  run.collective_timeout = std::chrono::seconds(3);
  Trainer trainer(regression_loop, ScalingConfig{.num_workers = 2}, run,
                  Json{{"steps", 8}, {"fault", "hang"}, {"fault_rank", 1}, {"fault_step", 2}});
  const Result result = trainer.fit();
  ASSERT_FALSE(result.ok());
  const std::string& error = *result.error;
  std::cout << "the failure: " << error << std::endl;
  EXPECT_NE(error.find("did not complete within 3000 ms"), std::string::npos) << error;
  const auto flight = dir / "hang" / "flight";
  EXPECT_NE(error.find("flight recorder (" + flight.string() + "): group train/"),
            std::string::npos)
      << error;
  EXPECT_NE(error.find(": ranks [0] entered it (rank 0 timed out); ranks [1] did not: rank 1 "
                       "(its last: #"),
            std::string::npos)
      << error;
  // Rank 0 wrote its own when its collective timed out; rank 1 when the driver asked.
  const Json rank0 = read_json(flight / "rank-0.json");
  const Json rank1 = read_json(flight / "rank-1.json");
  EXPECT_NE(rank0["reason"].get<std::string>().find("did not complete"), std::string::npos)
      << rank0["reason"];
  EXPECT_EQ(rank1["reason"], "the driver stops the group after a failure");
  // The control messages are there too: rank 1 said it reports (each rank does, at each report).
  bool reported = false;
  for (const auto& entry : rank1["entries"])
    reported = reported || (entry["group"] == "control" && entry["op"] == "report_begin");
  EXPECT_TRUE(reported) << rank1.dump(1);
}

TEST_F(FaultTolerance, AnExceptionOnOneRankIsRetried) {
  const Result baseline = run_regression(dir, "baseline", 0, {});
  const Result result =
      run_regression(dir, "throw", 2, {{"fault", "throw"}, {"fault_rank", 0}, {"fault_step", 3}});
  ASSERT_TRUE(result.ok()) << *result.error;
  ASSERT_EQ(result.failures.size(), 1u);
  EXPECT_NE(result.failures[0]["cause"].get<std::string>().find("rank 0 failed: injected failure"),
            std::string::npos)
      << result.failures[0].dump();
  EXPECT_EQ(result.metrics["weight_sum"], baseline.metrics["weight_sum"]);
}

TEST_F(FaultTolerance, ACrashWhileACheckpointIsCommittedKeepsThePreviousOne) {
  const Result baseline = run_regression(dir, "baseline", 0, {});
  // Rank 1 dies before its report of step 3, while rank 0 has staged its checkpoint files and
  // waits: that checkpoint must never appear, and the restart resumes from step 2's.
  const Result result =
      run_regression(dir, "commit_crash", 1,
                     {{"fault", "kill_before_report"}, {"fault_rank", 1}, {"fault_step", 3}});
  ASSERT_TRUE(result.ok()) << *result.error;
  EXPECT_EQ(result.failures[0]["reports"], 3);
  EXPECT_EQ(result.metrics["weight_sum"], baseline.metrics["weight_sum"]);
  for (const auto& entry : std::filesystem::directory_iterator(dir / "commit_crash")) {
    if (checkpoint_index(entry.path()) >= 0) Checkpoint::from_directory(entry.path()).verify();
  }
}

// Elastic: an epoch over 24 numbered examples per report, checkpointed, lr rescaled by
// linear_lr_scaling on resume. Config {"workers" (the full group), "epochs", "kill_rank",
// "kill_epoch"}; the killed rank marks its slot busy (the test's slot_available reads the
// marker), and rank 0 of the shrunk group frees it before its first report, so the group grows
// back right after that checkpoint. With a mesh the data is sharded over dp: "rows_agree" says
// whether the ranks of each pipeline read the same rows.
void elastic_loop(const Json& c) {
  auto& ctx = train::get_context();
  const int full = c["workers"].get<int>();
  auto model = torch::nn::Linear(1, 1);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.3));
  int start = 0;
  if (auto checkpoint = train::get_checkpoint()) {
    train::load_checkpoint(*checkpoint, *model, optimizer);
    start = checkpoint->metrics()["epoch"].get<int>() + 1;
  }
  const auto busy = ctx.get_storage_path() / "slot-busy";
  data::TensorDataset examples{.inputs = torch::arange(24, torch::kFloat).unsqueeze(1),
                               .targets = torch::zeros({24, 1})};
  auto loader = train::prepare_data_loader(examples, {.batch_size = 2, .shuffle = true, .seed = 3});
  const bool mesh = ctx.has_mesh();
  for (int epoch = start; epoch < c["epochs"].get<int>(); ++epoch) {
    loader.set_epoch(epoch);
    auto seen = torch::zeros({2});
    std::vector<at::Tensor> ids;
    for (auto& batch : loader) {
      seen[0] += batch.data.size(0);
      seen[1] += batch.data.sum();
      ids.push_back(batch.data.flatten());
    }
    // A pipeline's ranks must read the same rows, in the same order.
    std::vector<at::Tensor> order{torch::cat(ids)}, lowest{order[0].clone()};
    if (mesh) {
      ctx.get_mesh().pp().allreduce(order, comm::ReduceOp::kMax);
      ctx.get_mesh().pp().allreduce(lowest, comm::ReduceOp::kMin);
    }
    std::vector<at::Tensor> disagree{torch::full({1}, torch::equal(order[0], lowest[0]) ? 0. : 1.)};
    ctx.get_process_group().allreduce(disagree);
    std::vector<at::Tensor> totals{seen};
    (mesh ? ctx.get_mesh().dp() : ctx.get_process_group()).allreduce(totals);
    if (ctx.get_world_rank() == 0 && ctx.get_world_size() < full) std::filesystem::remove(busy);
    // Inside the run directory, which the test removes, also when this worker is killed.
    const auto tmp = ctx.get_storage_path() / ("elastic-ckpt-" + std::to_string(::getpid()));
    std::optional<Checkpoint> checkpoint;
    if (ctx.get_world_rank() == 0) checkpoint = train::save_checkpoint(tmp, *model, optimizer);
    Json metrics{{"epoch", epoch},
                 {"world_size", ctx.get_world_size()},
                 {"lr", optimizer.param_groups()[0].options().get_lr()},
                 {"samples", totals[0][0].item<double>()},
                 {"id_sum", totals[0][1].item<double>()},
                 {"rows_agree", disagree[0].item<double>() == 0}};
    if (mesh) metrics["mesh"] = parallel::to_string(ctx.get_mesh().shape());
    train::report(metrics, checkpoint);
    std::filesystem::remove_all(tmp);
    if (ctx.get_world_size() < full) {
      // The driver now stops this shrunk group to grow it back. Its next epoch would take less
      // time than that stop, so it waits for it here (the stop's SIGTERM ends the wait, and the
      // process), at most 30 s.
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      while (std::chrono::steady_clock::now() < deadline) ::poll(nullptr, 0, 50);
    }
    if (ctx.get_world_rank() == c.value("kill_rank", -1) && epoch == c.value("kill_epoch", -1) &&
        testing::first_time_in_run("elastic-kill")) {
      std::ofstream(busy) << "slot of a killed worker";
      std::raise(SIGKILL);
    }
  }
}

// `workers` slots, the last one busy while the killed worker's marker exists.
ScalingConfig elastic_scaling(const std::filesystem::path& run_dir, int workers, int min_workers) {
  return ScalingConfig{.num_workers = workers,
                       .min_workers = min_workers,
                       .slot_available =
                           [run_dir, workers](int slot) {
                             return slot != workers - 1 ||
                                    !std::filesystem::exists(run_dir / "slot-busy");
                           },
                       .on_world_size_change = train::linear_lr_scaling};
}

TEST_F(FaultTolerance, AnElasticGroupShrinksAfterAFailureAndGrowsBackWhenTheSlotIsFree) {
  Trainer trainer(elastic_loop, elastic_scaling(dir / "elastic", 3, 2),
                  run_config(dir, "elastic", 1),
                  Json{{"workers", 3}, {"epochs", 6}, {"kill_rank", 2}, {"kill_epoch", 1}});
  const Result result = trainer.fit();
  ASSERT_TRUE(result.ok()) << *result.error;
  std::vector<int> epochs, sizes;
  for (const auto& record : result.metrics_history) {
    epochs.push_back(record["epoch"].get<int>());
    sizes.push_back(record["world_size"].get<int>());
    // Re-sharded for every world size: each example exactly once per epoch.
    EXPECT_EQ(record["samples"], 24.0) << record.dump();
    EXPECT_EQ(record["id_sum"], 276.0) << record.dump();
    EXPECT_NEAR(record["lr"].get<double>(), 0.1 * record["world_size"].get<int>(), 1e-9)
        << record.dump();
  }
  EXPECT_EQ(epochs, (std::vector<int>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(sizes, (std::vector<int>{3, 3, 2, 3, 3, 3}));
  ASSERT_EQ(result.failures.size(), 1u);
  EXPECT_EQ(result.failures[0]["slot"], 2) << result.failures[0].dump();
  ASSERT_EQ(result.resizes.size(), 2u);
  EXPECT_EQ(result.resizes[0]["from"], 3);
  EXPECT_EQ(result.resizes[0]["to"], 2);
  EXPECT_EQ(result.resizes[1]["to"], 3);
  EXPECT_EQ(result.resizes[1]["reports"], 3) << result.resizes[1].dump();
  EXPECT_EQ(result.workers, 3);
  EXPECT_EQ(Result::from_path(dir / "elastic").resizes, result.resizes);
}

// With a mesh the group shrinks and grows by whole pipelines: 4 workers of pp 2 lose one, and
// the 3 free slots restart 2 (dp 1), not 3; the data is re-sharded over dp, the ranks of each
// pipeline reading the same rows, and the lr follows dp.
TEST_F(FaultTolerance, AnElasticMeshKeepsWholePipelines) {
  auto scaling = elastic_scaling(dir / "elastic_mesh", 4, 2);
  scaling.mesh = {.pp = 2};
  Trainer trainer(elastic_loop, scaling, run_config(dir, "elastic_mesh", 1),
                  Json{{"workers", 4}, {"epochs", 5}, {"kill_rank", 3}, {"kill_epoch", 1}});
  const Result result = trainer.fit();
  ASSERT_TRUE(result.ok()) << *result.error;
  std::vector<int> sizes;
  std::vector<std::string> meshes;
  for (const auto& record : result.metrics_history) {
    sizes.push_back(record["world_size"].get<int>());
    meshes.push_back(record["mesh"].get<std::string>());
    EXPECT_EQ(record["samples"], 24.0) << record.dump();
    EXPECT_EQ(record["id_sum"], 276.0) << record.dump();
    EXPECT_TRUE(record["rows_agree"].get<bool>()) << record.dump();
    EXPECT_NEAR(record["lr"].get<double>(), 0.3 * record["world_size"].get<int>() / 4, 1e-9)
        << record.dump();
  }
  EXPECT_EQ(sizes, (std::vector<int>{4, 4, 2, 4, 4}));
  EXPECT_EQ(meshes[2], "dp 1 x pp 2 x tp 1");
  EXPECT_EQ(meshes[3], "dp 2 x pp 2 x tp 1");
  ASSERT_EQ(result.resizes.size(), 2u);
  EXPECT_EQ(result.resizes[0]["to"], 2);
  EXPECT_EQ(result.resizes[1]["to"], 4);
  // Not a multiple of pp x tp, or dp fixed: refused before any worker starts.
  cohort::testing::expect_error<UsageError>(
      [] {
        Trainer(elastic_loop, ScalingConfig{.num_workers = 4, .min_workers = 3, .mesh = {.pp = 2}});
      },
      "ScalingConfig.min_workers 3 with pp 2 x tp 1: an elastic group keeps whole replicas of 2 "
      "workers; use a "
      "multiple of 2");
  cohort::testing::expect_error<UsageError>(
      [] {
        Trainer(elastic_loop,
                ScalingConfig{.num_workers = 4, .min_workers = 2, .mesh = {.dp = 2, .pp = 2}});
      },
      "leave mesh.dp at 0");
}

TEST_F(FaultTolerance, AGroupBelowItsMinimumFailsNamingTheBusySlots) {
  auto run = run_config(dir, "below_min", 1);
  run.setup_timeout = std::chrono::seconds(2);
  Trainer trainer(elastic_loop, elastic_scaling(dir / "below_min", 3, 3), run,
                  Json{{"workers", 3}, {"epochs", 3}, {"kill_rank", 2}, {"kill_epoch", 0}});
  const Result result = trainer.fit();
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.error->find("only 2 of 3 worker slots are free (slots [2] still busy"),
            std::string::npos)
      << *result.error;
  ASSERT_EQ(result.failures.size(), 1u);
  EXPECT_FALSE(result.failures[0]["restarted"].get<bool>());
  EXPECT_THROW(Trainer(elastic_loop, ScalingConfig{.num_workers = 2, .min_workers = 3}),
               UsageError);
}

TEST_F(FaultTolerance, ARankThatNeverJoinsFailsWithinTheSetupDeadline) {
  // Rank 1 stops before it reaches fit(), so it never joins the rendezvous.
  if (runtime::is_spawned_worker() && std::string(std::getenv("RANK")) == "1") std::raise(SIGSTOP);
  auto run = run_config(dir, "never_joins", 0);
  run.setup_timeout = std::chrono::seconds(2);
  Trainer trainer([](const Json&) {}, ScalingConfig{.num_workers = 2}, run);
  const auto start = std::chrono::steady_clock::now();
  const Result result = trainer.fit();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.error->find("ranks [1] of 2 did not join the rendezvous at 127.0.0.1:"),
            std::string::npos)
      << *result.error;
}

}  // namespace
}  // namespace cohort

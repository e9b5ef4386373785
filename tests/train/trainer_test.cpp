#include "cohort/train/trainer.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sys/stat.h>
#include <unistd.h>
#include <csignal>

#include <fstream>
#include <iostream>
#include <tuple>

#include "cohort/cohort.h"
#include "cohort/models/zoo.h"
#include "cohort/runtime/worker_group.h"
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
    EXPECT_TRUE(
        std::filesystem::exists(dir / "reports" / "logs" / ("rank-" + std::to_string(r) + ".log")));
  }
  std::filesystem::remove_all(dir);
}

// The heart of data parallelism, across real processes: after one step both ranks hold the
// same parameters, equal to one single-process step on the union of their batches.
TEST(Trainer, TwoWorkersAverageGradientsLikeOneProcessOnTheUnionBatch) {
  auto dir = cohort::testing::temp_dir("trainer_average");
  auto make_batch = [] {
    auto g = torch::make_generator<at::CPUGeneratorImpl>(42);
    return std::make_pair(torch::randn({16, 1, 28, 28}, g),
                          torch::randint(0, 10, {16}, g, torch::kLong));
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
        torch::nn::functional::cross_entropy(
            model->forward(x.narrow(0, ctx.get_world_rank() * half, half)),
            y.narrow(0, ctx.get_world_rank() * half, half))
            .backward();
        opt.step();
        std::vector<torch::Tensor> params = model->parameters();
        torch::save(params, (ctx.get_storage_path() /
                             ("params_" + std::to_string(ctx.get_world_rank()) + ".pt"))
                                .string());
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
  EXPECT_NE(result.error->find("rank 1 failed: bad things on one rank"), std::string::npos)
      << *result.error;
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
  EXPECT_THROW(Trainer(loop, ScalingConfig{.resources_per_worker = {.cpu_threads = 0}}),
               UsageError);
  cohort::testing::expect_error<UsageError>(
      [&] { Trainer(loop, ScalingConfig{.num_workers = 2, .num_parameter_servers = 3}); },
      "ScalingConfig.num_parameter_servers 3 must be between 0 and ScalingConfig.num_workers 2: "
      "the servers run in the worker processes, at most one per worker");
  // The same checks for a program whose flags fill the configs, named by its flags.
  cohort::testing::expect_error<UsageError>(
      [] {
        check_configs(ScalingConfig{.num_workers = 2, .min_workers = 3}, RunConfig{},
                      {{"ScalingConfig.num_workers", "--n"}, {"ScalingConfig.min_workers", "--m"}});
      },
      "--m 3 must be between 1 and --n 2 (0: a fixed-size group)");
  // Live recovery without replacements shrinks the group, which a fixed-size group never does.
  RunConfig shrinking;
  shrinking.failure_config.recovery = FailureConfig::Recovery::kLive;
  shrinking.failure_config.replace_lost = false;
  cohort::testing::expect_error<UsageError>(
      [&] { Trainer(loop, ScalingConfig{.num_workers = 3}, shrinking); },
      "FailureConfig.recovery live with FailureConfig.replace_lost false goes on with fewer "
      "workers: give ScalingConfig.min_workers below ScalingConfig.num_workers 3 (e.g. "
      "ScalingConfig.min_workers 2)");
  Trainer(loop, ScalingConfig{.num_workers = 3, .min_workers = 2}, shrinking);
  cohort::testing::expect_error<UsageError>(
      [&] { Trainer(loop, ScalingConfig{}, RunConfig{.umask = 01022}); },
      "RunConfig.umask 01022 is no umask: give permission bits between 0 and 0777");
  auto dir = cohort::testing::temp_dir("trainer_storage");
  std::ofstream(dir / "a_file") << "x";
  Trainer trainer(loop, ScalingConfig{}, run_config(dir / "a_file", "x"));
  cohort::testing::expect_error<UsageError>([&] { trainer.fit(); }, "storage path");
  std::filesystem::remove_all(dir);
}

TEST(Trainer, PrecisionReachesEveryWorkerAndFp16WithoutAGpuIsRefused) {
  auto dir = cohort::testing::temp_dir("trainer_precision");
  Trainer trainer(
      [](const Json&) {
        torch::manual_seed(0);
        auto model = train::prepare_model(torch::nn::Linear(4, 2));
        optim::FlatSGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
        torch::Tensor out;
        {
          auto autocast = train::autocast();
          out = model->forward(torch::randn({3, 4}));
        }
        train::backward(out.to(torch::kFloat).pow(2).mean());
        const bool stepped = train::step_optimizer(optimizer);
        train::report({{"precision", optim::to_string(train::get_context().get_precision())},
                       {"output_dtype", std::string(c10::toString(out.scalar_type()))},
                       {"stepped", stepped},
                       {"weight_dtype", std::string(c10::toString(model->weight.scalar_type()))}});
      },
      ScalingConfig{.num_workers = 2, .precision = "bf16"}, run_config(dir, "bf16"));
  const auto result = trainer.fit();
  ASSERT_TRUE(result.ok()) << *result.error;
  EXPECT_EQ(result.metrics["precision"], "bf16");
  EXPECT_EQ(result.metrics["output_dtype"], "BFloat16");
  EXPECT_EQ(result.metrics["weight_dtype"], "Float") << "parameters stay float32";
  EXPECT_EQ(result.metrics["stepped"], true);
  EXPECT_FALSE(result.metrics.contains("loss_scale")) << "bf16 needs no loss scaling";

  auto loop = [](const Json&) {};
  cohort::testing::expect_error<UsageError>(
      [&] { Trainer(loop, ScalingConfig{.precision = "fp16"}); }, "Use bf16 instead");
  cohort::testing::expect_error<UsageError>(
      [&] { Trainer(loop, ScalingConfig{.loss_scaler = {.hysteresis = 0}}); }, "hysteresis 0");
  std::filesystem::remove_all(dir);
}

// A program that fits one loop twice with other ScalingConfigs: each run's workers take the mesh
// and precision of the Trainer that started them (the driver's, through their spec), not those of
// the first Trainer the re-executed program constructs.
TEST(Trainer, EachFitsWorkersTakeTheirOwnTrainersScalingConfig) {
  auto dir = cohort::testing::temp_dir("trainer_two_fits");
  const auto loop = [](const Json&) {
    const auto& ctx = train::get_context();
    train::report({{"precision", optim::to_string(ctx.get_precision())},
                   {"pp", ctx.has_mesh() ? ctx.get_mesh().shape().pp : 1}});
  };
  Trainer first(loop, ScalingConfig{.num_workers = 2, .precision = "bf16", .mesh = {.pp = 2}},
                run_config(dir, "first"));
  const auto a = first.fit();
  ASSERT_TRUE(a.ok()) << *a.error;
  EXPECT_EQ(a.metrics["precision"], "bf16");
  EXPECT_EQ(a.metrics["pp"], 2);
  Trainer second(loop, ScalingConfig{.num_workers = 3}, run_config(dir, "second"));
  const auto b = second.fit();
  std::filesystem::remove_all(dir);
  ASSERT_TRUE(b.ok()) << *b.error;
  EXPECT_EQ(b.metrics["precision"], "fp32");
  EXPECT_EQ(b.metrics["pp"], 1);
}

// prepare_model with DiLoCo: a backward before prepare_optimizer is stopped naming the fix, ZeRO
// is refused, a second optimizer and get_ddp name the engine, and report() counts the bytes each
// worker sent per step: one all-reduce of the parameters every H steps, DDP's bytes divided by H.
TEST(Trainer, DiLoCoThroughPrepareModelSendsDdpsBytesDividedByH) {
  auto dir = cohort::testing::temp_dir("trainer_diloco");
  Trainer trainer(
      [](const Json&) {
        const parallel::DiLoCo diloco{.inner_steps = 2};
        auto forgotten = train::prepare_model(torch::nn::Linear(4, 3), {.sync = diloco});
        std::string guard_message;
        try {
          forgotten->forward(torch::randn({2, 4})).sum().backward();
        } catch (const std::exception& e) {
          guard_message = e.what();
        }
        std::string zero_message;
        try {
          train::prepare_model(torch::nn::Linear(4, 3), {.zero = {.stage = 2}, .sync = diloco});
        } catch (const UsageError& e) {
          zero_message = e.what();
        }
        torch::manual_seed(1);
        auto model = train::prepare_model(torch::nn::Linear(4, 3), {.sync = diloco});
        auto optimizer = train::prepare_optimizer(
            model, std::make_unique<torch::optim::SGD>(model->parameters(),
                                                       torch::optim::SGDOptions(0.1)));
        // The engine is the optimizer's: a second one, or asking for DDP, names it.
        std::string twice_message, ddp_message;
        try {
          train::prepare_optimizer(model, std::make_unique<torch::optim::SGD>(
                                              model->parameters(), torch::optim::SGDOptions(0.1)));
        } catch (const UsageError& e) {
          twice_message = e.what();
        }
        try {
          train::get_ddp(model.ptr());
        } catch (const UsageError& e) {
          ddp_message = e.what();
        }
        train::report({{"phase", "prepared"}});  // the start's broadcast is not per-step traffic
        for (int step = 0; step < 4; ++step) {
          optimizer->zero_grad();
          auto no_sync = train::no_sync(model);  // nothing to hold: no communication anyway
          model->forward(torch::randn({2, 4})).pow(2).mean().backward();
          optimizer->step();
        }
        train::report({{"guard", guard_message},
                       {"zero", zero_message},
                       {"twice", twice_message},
                       {"ddp", ddp_message}});
      },
      ScalingConfig{.num_workers = 2}, run_config(dir, "diloco"));
  const auto result = trainer.fit();
  ASSERT_TRUE(result.ok()) << *result.error;
  EXPECT_NE(result.metrics["guard"].get<std::string>().find(
                "before its optimizer was passed through cohort::train::prepare_optimizer"),
            std::string::npos)
      << result.metrics["guard"];
  EXPECT_NE(result.metrics["zero"].get<std::string>().find(
                "sync diloco:2 cannot be combined with ZeRO stage 2"),
            std::string::npos)
      << result.metrics["zero"];
  EXPECT_EQ(result.metrics["twice"],
            "prepare_optimizer: this model already has its LocalSgdOptimizer; prepare one "
            "optimizer per model");
  EXPECT_EQ(result.metrics["ddp"],
            "this model was prepared with sync diloco:2: its engine is the LocalSgdOptimizer that "
            "prepare_optimizer returned, not DDP");
  // 15 float32 parameters, all-reduced twice in 4 steps at 2 (N - 1) / N x 4 bytes each.
  EXPECT_DOUBLE_EQ(result.metrics["comm_bytes_per_step"].get<double>(), 2 * 15 * 4.0 / 4);
  std::filesystem::remove_all(dir);
}

TEST(Trainer, WorkerApiOutsideALoopSaysWhereToCallIt) {
  cohort::testing::expect_error<RuntimeError>([] { train::get_context(); },
                                              "inside the function given to cohort::Trainer");
}

// Under a launcher, rank 0's fit() runs the loop in the calling process and returns: the session
// is its own and ends with it (its store and groups too), so a second fit in the same program
// starts clean, and the worker API outside a loop says so again.
TEST(Trainer, UnderALauncherEachFitOwnsItsSessionAndEndsItOnReturn) {
  // This process as rank 0 of 1 under a torchrun-style launcher, until the test ends (however).
  struct Launched {
    std::filesystem::path dir = cohort::testing::temp_dir("launched_fit");
    std::map<std::string, std::string> variables{
        {"RANK", "0"},
        {"WORLD_SIZE", "1"},
        {"LOCAL_RANK", "0"},
        {"LOCAL_WORLD_SIZE", "1"},
        {"MASTER_ADDR", "127.0.0.1"},
        // The same port for both fits: the first's store must be gone when it returns.
        {"MASTER_PORT", std::to_string(cohort::testing::free_port())}};
    Launched() {
      for (const auto& [name, value] : variables) setenv(name.c_str(), value.c_str(), 1);
    }
    ~Launched() {
      for (const auto& variable : variables) unsetenv(variable.first.c_str());
      std::filesystem::remove_all(dir);
    }
  } launched;
  auto loop = [](const Json& config) {
    const auto& context = train::get_context();
    train::report({{"fit", config.at("fit")}, {"world_size", context.get_world_size()}});
  };
  for (int fit = 1; fit <= 2; ++fit) {
    const auto result =
        Trainer(loop, ScalingConfig{.num_workers = 1},
                run_config(launched.dir, "fit" + std::to_string(fit)), {{"fit", fit}})
            .fit();
    ASSERT_FALSE(result.error) << *result.error;
    EXPECT_EQ(result.metrics.at("fit"), fit);
    EXPECT_EQ(result.metrics.at("world_size"), 1);
    cohort::testing::expect_error<RuntimeError>([] { train::get_context(); },
                                                "outside a train loop");
  }
}

// The driver is who keeps the run and gets its Result: what a program says or checks once before
// fit() it says there. Under cohort launch a run that recovers live has its job host drive it,
// not rank 0.
TEST(Trainer, TheDriverIsTheProcessWhoseFitKeepsTheRun) {
  struct Variables {
    std::vector<std::string> names;
    void set(const std::map<std::string, std::string>& values) {
      clear();
      for (const auto& [name, value] : values) {
        setenv(name.c_str(), value.c_str(), 1);
        names.push_back(name);
      }
    }
    void clear() {
      for (const auto& name : names) unsetenv(name.c_str());
      names.clear();
    }
    ~Variables() { clear(); }
  } env;
  ASSERT_TRUE(runtime::spawned_role().empty() && !runtime::detect_launch());
  RunConfig live;
  live.failure_config.recovery = FailureConfig::Recovery::kLive;
  const RunConfig restart;
  EXPECT_TRUE(is_driver(restart));  // the program the user started
  const std::map<std::string, std::string> rank0{
      {"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}};
  env.set(rank0);
  EXPECT_TRUE(is_driver(live));  // torchrun-style: rank 0 keeps the run
  auto launched = rank0;
  launched[runtime::kLauncherVar] = "cohort-launch";
  env.set(launched);
  EXPECT_TRUE(is_driver(restart));
  EXPECT_FALSE(is_driver(live));  // the job host keeps it
  launched["RANK"] = "1";
  env.set(launched);
  EXPECT_FALSE(is_driver(restart));
  env.set({{runtime::kRoleVar, runtime::kJobHostRole}});
  EXPECT_TRUE(is_driver(live));
  env.set({{runtime::kRoleVar, runtime::kWorkerRole}});
  EXPECT_FALSE(is_driver(restart));
}

// Writes `files` (name -> content) to a fresh folder for a checkpoint, inside the run directory
// so that the test's cleanup removes it (a worker ends with _Exit, running no cleanup of its own).
Checkpoint folder_with(const std::string& tag, const std::map<std::string, std::string>& files) {
  auto dir = train::get_context().get_storage_path() /
             ("test-ckpt-" + tag + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  for (const auto& [name, content] : files) std::ofstream(dir / name) << content;
  return Checkpoint::from_directory(dir);
}

TEST(Trainer, CheckpointsFromAllRanksAreMergedAndKeptByScore) {
  auto dir = cohort::testing::temp_dir("trainer_ckpt");
  auto run = run_config(dir, "ckpt");
  run.checkpoint_config = {.num_to_keep = 1, .checkpoint_score_attribute = "acc"};
  Trainer trainer(
      [](const Json&) {
        auto& ctx = train::get_context();
        const std::string rank = std::to_string(ctx.get_world_rank());
        const std::vector<double> acc{0.2, 0.9, 0.4};
        for (size_t i = 0; i < acc.size(); ++i) {
          train::report(
              {{"acc", acc[i]}, {"i", i}},
              folder_with(rank + std::to_string(i), {{"shard-rank" + rank + ".txt", rank},
                                                     {"common.txt", "from rank " + rank}}));
        }
      },
      ScalingConfig{.num_workers = 2}, run);
  Result result = trainer.fit();
  ASSERT_TRUE(result.ok()) << *result.error;
  ASSERT_TRUE(result.checkpoint);
  EXPECT_EQ(result.checkpoint->path().filename(), "checkpoint_000002");
  // Best (acc 0.9) and latest kept; the first, worse than both, removed.
  ASSERT_EQ(result.best_checkpoints.size(), 2u);
  EXPECT_EQ(result.best_checkpoints[0].first.path().filename(), "checkpoint_000001");
  EXPECT_EQ(result.best_checkpoints[0].second["acc"], 0.9);
  EXPECT_FALSE(std::filesystem::exists(dir / "ckpt" / "checkpoint_000000"));
  const auto path = result.checkpoint->path();
  result.checkpoint->verify();
  EXPECT_EQ(cohort::testing::read_text((path / "shard-rank0.txt").string()), "0");
  EXPECT_EQ(cohort::testing::read_text((path / "shard-rank1.txt").string()), "1");
  EXPECT_EQ(cohort::testing::read_text((path / "common.txt").string()), "from rank 0");
  EXPECT_EQ(result.checkpoint->metrics()["i"], 2);

  auto reloaded = Result::from_path(dir / "ckpt");
  EXPECT_TRUE(reloaded.ok());
  EXPECT_EQ(reloaded.metrics, result.metrics);
  EXPECT_EQ(reloaded.metrics_history.size(), 3u);
  EXPECT_EQ(reloaded.checkpoint->path(), result.checkpoint->path());
  ASSERT_EQ(reloaded.best_checkpoints.size(), 2u);
  EXPECT_EQ(reloaded.best_checkpoints[0].first.path(), result.best_checkpoints[0].first.path());
  EXPECT_EQ(reloaded.workers, 2);
  auto csv = cohort::testing::read_text((dir / "ckpt" / "metrics.csv").string());
  // checkpoint_ms: cohort's measure of the slowest rank's checkpoint time.
  EXPECT_EQ(csv.substr(0, csv.find('\n')),
            "acc,i,checkpoint_ms,training_iteration,timestamp,checkpoint");
  EXPECT_EQ(std::count(csv.begin(), csv.end(), '\n'), 4);
  std::filesystem::remove_all(dir);
}

// The run directory and what the run writes in it are the user's alone unless RunConfig::umask
// says otherwise, whatever the program's own umask; that is back when fit() returns.
TEST(Trainer, TheRunIsPrivateUnlessRunConfigUmaskSaysOtherwise) {
  auto dir = cohort::testing::temp_dir("trainer_umask");
  const mode_t before = ::umask(0);  // the program's own: anyone may read and write
  const auto mode = [](const std::filesystem::path& path) {
    return static_cast<unsigned>(std::filesystem::status(path).permissions()) & 0777;
  };
  for (const auto& [mask, folder, file] :
       std::vector<std::tuple<int, unsigned, unsigned>>{{077, 0700, 0600}, {022, 0755, 0644}}) {
    auto run = run_config(dir, "umask" + std::to_string(mask));
    run.umask = mask;
    Trainer trainer(
        [](const Json&) {
          const auto rank = std::to_string(train::get_context().get_world_rank());
          train::report({{"x", 1}}, folder_with("umask" + rank, {{"part-" + rank + ".txt", rank}}));
        },
        ScalingConfig{.num_workers = 2}, run);
    Result result = trainer.fit();
    ASSERT_TRUE(result.ok()) << *result.error;
    const auto run_dir = dir / run.name;
    const auto checkpoint = result.checkpoint->path();
    EXPECT_EQ(mode(run_dir), folder) << "umask 0" << std::oct << mask;
    EXPECT_EQ(mode(run_dir / "logs"), folder);
    EXPECT_EQ(mode(checkpoint), folder);
    EXPECT_EQ(mode(checkpoint / "part-1.txt"), file) << "a worker's file, copied";
    EXPECT_EQ(mode(checkpoint / "manifest.json"), file);
    EXPECT_EQ(mode(run_dir / "metrics.jsonl"), file);
    EXPECT_EQ(mode(run_dir / "result.json"), file);
    EXPECT_EQ(mode(run_dir / "logs" / "rank-1.log"), file);
    EXPECT_EQ(::umask(0), 0u) << "the program's own umask is back after fit()";
  }
  ::umask(before);
  std::filesystem::remove_all(dir);
}

// Ray issue 46814: a resumed run must go on from the checkpointed epoch, not from the first.
TEST(Trainer, RunningAgainResumesFromTheLatestCheckpoint) {
  auto dir = cohort::testing::temp_dir("trainer_resume");
  auto loop = [](const Json& config) {
    int start = 0;
    if (auto checkpoint = train::get_checkpoint()) {
      start =
          std::stoi(cohort::testing::read_text((checkpoint->path() / "epoch.txt").string())) + 1;
    }
    for (int epoch = start; epoch < config["epochs"].get<int>(); ++epoch) {
      const bool rank0 = train::get_context().get_world_rank() == 0;
      std::optional<Checkpoint> checkpoint;
      if (rank0)
        checkpoint =
            folder_with("resume" + std::to_string(epoch), {{"epoch.txt", std::to_string(epoch)}});
      train::report({{"epoch", epoch}, {"started_at", start}}, checkpoint);
    }
  };
  {
    Trainer first(loop, ScalingConfig{.num_workers = 2}, run_config(dir, "resume"),
                  Json{{"epochs", 2}});
    ASSERT_TRUE(first.fit().ok());
  }
  // A crash in the middle of an append left half a record. The history is appended to, never
  // rewritten (a crash while rewriting it would lose it): its bytes stay, the cut line is
  // skipped and ended, and the next record has a line of its own.
  const auto log = dir / "resume" / "metrics.jsonl";
  const std::string before = cohort::testing::read_text(log.string());
  ASSERT_EQ(std::count(before.begin(), before.end(), '\n'), 2);
  std::ofstream(log, std::ios::app) << R"({"epoch": 1, "star)";
  Trainer again(loop, ScalingConfig{.num_workers = 2}, run_config(dir, "resume"),
                Json{{"epochs", 4}});
  Result result = again.fit();
  ASSERT_TRUE(result.ok()) << *result.error;
  EXPECT_EQ(result.metrics["epoch"], 3);
  EXPECT_EQ(result.metrics["started_at"], 2);
  EXPECT_EQ(result.metrics_history.size(), 4u);  // the whole run's history
  const std::string after = cohort::testing::read_text(log.string());
  EXPECT_EQ(after.substr(0, before.size()), before);
  EXPECT_EQ(after.substr(before.size())
                .rfind(R"({"epoch": 1, "star)"
                       "\n{",
                       0),
            0u)
      << after;
  EXPECT_EQ(std::count(after.begin(), after.end(), '\n'), 5);
  EXPECT_EQ(Result::from_path(dir / "resume").metrics_history.size(), 4u);
  EXPECT_EQ(result.checkpoint->path().filename(), "checkpoint_000003");

  std::filesystem::resize_file(dir / "resume" / "checkpoint_000003" / "epoch.txt", 0);
  Trainer after_corruption(loop, ScalingConfig{.num_workers = 2}, run_config(dir, "resume"),
                           Json{{"epochs", 5}});
  result = after_corruption.fit();
  ASSERT_TRUE(result.ok()) << *result.error;
  EXPECT_EQ(result.metrics["started_at"], 3);  // from checkpoint_000002 (epoch 2)
  EXPECT_EQ(result.checkpoint->path().filename(), "checkpoint_000005");

  auto fresh = run_config(dir, "resume");
  fresh.resume = false;
  Trainer no_resume(loop, ScalingConfig{.num_workers = 2}, fresh, Json{{"epochs", 1}});
  result = no_resume.fit();
  ASSERT_TRUE(result.ok());
  EXPECT_EQ(result.metrics["started_at"], 0);
  EXPECT_EQ(result.metrics_history.size(), 1u);
  EXPECT_TRUE(std::filesystem::exists(dir / "resume" / "checkpoint_000005"));  // left alone
  std::filesystem::remove_all(dir);
}

TEST(Trainer, UnequalReportCountsEndInAnErrorNotAHang) {
  auto dir = cohort::testing::temp_dir("trainer_report_count");
  auto run = run_config(dir, "count");
  run.collective_timeout = std::chrono::seconds(120);  // the check must not wait for this
  Trainer trainer(
      [](const Json&) {
        const int calls = train::get_context().get_world_rank() == 0 ? 3 : 2;
        for (int i = 0; i < calls; ++i) train::report({{"i", i}});
      },
      ScalingConfig{.num_workers = 2}, run);
  const auto start = std::chrono::steady_clock::now();
  Result result = trainer.fit();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.error->find("rank 1 finished after 2 report() calls while rank 0 made call #3"),
            std::string::npos)
      << *result.error;
  std::filesystem::remove_all(dir);
}

TEST(Trainer, AScoreAttributeNeverReportedIsAnErrorAtTheFirstReport) {
  auto dir = cohort::testing::temp_dir("trainer_score");
  auto run = run_config(dir, "score");
  run.checkpoint_config.checkpoint_score_attribute = "accuracy";
  Trainer trainer(
      [](const Json&) {
        for (int i = 0; i < 1000; ++i) train::report({{"loss", 1.0 / (i + 1)}});
      },
      ScalingConfig{.num_workers = 1}, run);
  Result result = trainer.fit();
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.error->find("'accuracy' is not among the reported metrics [loss]"),
            std::string::npos)
      << *result.error;
  std::filesystem::remove_all(dir);
}

TEST(Trainer, BarrierBroadcastAndDatasetShards) {
  auto dir = cohort::testing::temp_dir("trainer_shards");
  auto numbers = data::Dataset::from_tensors({{"x", torch::arange(10, torch::kFloat).view({10, 1})},
                                              {"y", torch::arange(10, torch::kLong)}});
  Trainer trainer(
      [](const Json&) {
        auto& ctx = train::get_context();
        train::barrier();
        auto value = train::broadcast_from_rank_zero(Json{{"from", ctx.get_world_rank()}});
        int64_t sum = 0, count = 0;
        auto shard = train::get_dataset_shard("numbers");
        for (auto& batch : shard.iter_batches({.batch_size = 2})) {
          sum += batch["y"].sum().item<int64_t>();
          count += batch["y"].size(0);
        }
        std::vector<at::Tensor> totals{torch::tensor({sum, count})};
        ctx.get_process_group().allreduce(totals);
        train::report({{"broadcast_from", value["from"]},
                       {"sum", totals[0][0].item<int64_t>()},
                       {"count", totals[0][1].item<int64_t>()},
                       {"my_count", count}});
        cohort::testing::expect_error<UsageError>([] { train::get_dataset_shard("absent"); },
                                                  "no dataset named 'absent'");
      },
      ScalingConfig{.num_workers = 2}, run_config(dir, "shards"), Json::object(),
      {{"numbers", numbers}});
  Result result = trainer.fit();
  ASSERT_TRUE(result.ok()) << *result.error;
  EXPECT_EQ(result.metrics["broadcast_from"], 0);
  EXPECT_EQ(result.metrics["sum"], 45);
  EXPECT_EQ(result.metrics["count"], 10);
  EXPECT_EQ(result.metrics["my_count"], 5);
  EXPECT_TRUE(result.metrics.contains("ingest_wait_ms")) << result.metrics.dump();
  std::filesystem::remove_all(dir);
}

// Ray PR 42601: shards left uneven by a filter must not leave one rank waiting in an all-reduce.
// Here rank 0's shard keeps 12 rows and rank 1's 4, preprocessed by worker processes each rank
// starts; both ranks step through the same number of batches, each an all-reduce.
TEST(Trainer, UnevenShardsAfterAFilterGiveEveryRankTheSameBatchesWithOffload) {
  auto dir = cohort::testing::temp_dir("trainer_uneven");
  auto rows =
      data::Dataset::from_tensors({{"x", torch::arange(32, torch::kFloat)}})
          .map_batches(
              [](data::Block b) {
                b["x"] = b["x"] * 10;
                return b;
              },
              {.name = "times ten", .batch_size = 4, .num_workers = 2})
          // Shards are strided: even ids go to rank 0, odd ones to rank 1.
          .filter([](const data::Block& b) {
            auto id = b[data::kIdColumn];
            return (id % 2 == 0).logical_and(id < 24).logical_or((id % 2 == 1).logical_and(id < 8));
          });
  Trainer trainer(
      [](const Json&) {
        auto& ctx = train::get_context();
        auto shard = train::get_dataset_shard("rows");
        for (int epoch = 0; epoch < 2; ++epoch) {
          shard.set_epoch(epoch);
          int64_t batches = 0;
          for (auto& batch : shard.iter_batches({.batch_size = 2})) {
            EXPECT_TRUE(torch::equal(batch["x"], batch[data::kIdColumn].to(torch::kFloat) * 10));
            std::vector<at::Tensor> t{torch::ones({1})};
            ctx.get_process_group().allreduce(t);
            ++batches;
          }
          train::report({{"batches", batches}, {"rank", ctx.get_world_rank()}});
        }
      },
      ScalingConfig{.num_workers = 2}, run_config(dir, "uneven"), Json::object(), {{"rows", rows}});
  Result result = trainer.fit();
  ASSERT_TRUE(result.ok()) << *result.error;
  // Rank 1 has 4 rows, 2 batches: both ranks stop there.
  EXPECT_EQ(result.metrics["batches"], 2);
  EXPECT_EQ(result.metrics_history.size(), 2u);
  std::filesystem::remove_all(dir);
}

TEST(Trainer, IdenticalLinesFromAllRanksArePrintedOnce) {
  // Runs the Trainer in a child process so that its terminal output can be read.
  if (const char* child_dir = std::getenv("COHORT_DEDUP_DIR")) {
    auto run = run_config(child_dir, "dedup");
    run.verbose = 1;
    Trainer trainer(
        [](const Json&) {
          train::barrier();  // all ranks print at about the same time
          std::cout << "the same words" << std::endl;
        },
        ScalingConfig{.num_workers = 3}, run);
    std::exit(trainer.fit().ok() ? 0 : 1);
  }
  auto dir = cohort::testing::temp_dir("trainer_dedup");
  auto r = cohort::testing::run_command(
      {cohort::runtime::self_executable(),
       "--gtest_filter=Trainer.IdenticalLinesFromAllRanksArePrintedOnce"},
      std::chrono::seconds(60), {{"COHORT_DEDUP_DIR", dir.string()}});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  size_t count = 0;
  for (size_t at = r.output.find(") the same words\n"); at != std::string::npos;
       at = r.output.find(") the same words\n", at + 1)) {
    ++count;
  }
  EXPECT_EQ(count, 1u) << r.output;
  EXPECT_NE(r.output.find("the same words [repeated 2x across ranks]"), std::string::npos)
      << r.output;
  for (int rank = 0; rank < 3; ++rank) {
    auto log = cohort::testing::read_text(
        (dir / "dedup" / "logs" / ("rank-" + std::to_string(rank) + ".log")).string());
    EXPECT_NE(log.find("the same words"), std::string::npos) << "rank " << rank;
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace cohort

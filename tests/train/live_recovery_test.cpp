// Live recovery (FailureConfig::Recovery::kLive): a worker killed or hung inside an epoch, the
// survivors go on in the same processes, with a replacement in its place or without it.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <csignal>
#include <fstream>
#include <iomanip>
#include <map>
#include <set>

#include "cohort/cohort.h"
#include "support/fault_injection.h"
#include "support/small_classifier.h"
#include "support/tiny_mnist.h"
#include "train/live_recovery.h"
#include "train/run_files.h"

namespace cohort {
namespace {

using testing::kClassifierBatch;
using testing::kClassifierRows;

// Two epochs of an MLP under config {"plan": a testing::plan_named, "sgd": plain SGD instead of
// AdamW, "files", "fault": "none"|"kill"|"stop", "fault_rank", "fault_step"}: the rank fails so
// once, right after that step. Every process writes its pid to <files>-pids.txt at each start of
// the loop, and "<epoch> <id>" of each row of its completed steps to <files>-<pid>.txt. Each epoch
// reports the spread of the ranks' parameter sums after a synchronisation (0: the replicas
// agree). Each process also writes to <files>-<pid>-sums.txt the sum of its parameters after
// each step ("step <steps> <sum>") and after loading a checkpoint ("loaded <sum>"); at ZeRO stage
// 3 that of the parameters it holds whole (none where every unit is sharded: a gather would be a
// collective of its own).
double parameter_sum(train::ParallelModel& model) {
  double sum = 0;
  for (const auto& p : model.module().parameters())
    if (p.storage().nbytes() > 0) sum += p.detach().to(torch::kDouble).sum().item<double>();
  return sum;
}

void live_loop(const Json& c) {
  auto& ctx = train::get_context();
  const std::string files = c["files"];
  std::ofstream(files + "-pids.txt", std::ios::app) << ::getpid() << "\n";
  auto model = testing::classifier_net(testing::plan_named(c["plan"]), /*hidden_layers=*/1,
                                       /*dropout=*/0, /*stateless=*/c.value("sgd", false));
  std::ofstream sums(files + "-" + std::to_string(::getpid()) + "-sums.txt", std::ios::app);
  sums << std::setprecision(17);
  train::ResumePoint start;
  if (auto checkpoint = train::get_checkpoint()) {
    model.load(*checkpoint);
    start = train::resume_point(*checkpoint);
    sums << "loaded " << parameter_sum(model) << std::endl;
  }
  std::ofstream rows(files + "-" + std::to_string(::getpid()) + ".txt", std::ios::app);
  auto stream = train::get_dataset_shard("train");
  const std::string fault = c.value("fault", std::string("none"));
  for (int epoch = start.epoch; epoch < 2; ++epoch) {
    stream.set_epoch(epoch);
    for (auto& batch : stream.iter_batches({.batch_size = kClassifierBatch})) {
      model.step(batch["x"], batch["y"]);
      sums << "step " << model.steps() << " " << parameter_sum(model) << std::endl;
      for (int64_t i = 0; i < batch["x"].size(0); ++i)
        rows << epoch << " " << batch["x"][i][0].item<int64_t>() << "\n";
      rows.flush();
      if (ctx.get_world_rank() == c.value("fault_rank", -1) &&
          model.steps() == c.value("fault_step", int64_t{-1}) &&
          testing::first_time_in_run(fault)) {
        if (fault == "kill") std::raise(SIGKILL);
        if (fault == "stop") std::raise(SIGSTOP);
      }
    }
    model.sync();  // local SGD's replicas averaged
    const auto spread = torch::cat(
        ctx.get_process_group().allgather(torch::tensor({parameter_sum(model)}, torch::kDouble)));
    train::report({{"epoch", epoch + 1},
                   {"steps", model.steps()},
                   {"world_size", ctx.get_world_size()},
                   {"replica_spread", (spread.max() - spread.min()).item<double>()}},
                  model);
  }
}

// Who takes whose state in a live round. DDP: the survivors as far as the source keep their own,
// the others take the source's. ZeRO in sharding groups of 2: each rank takes it from a survivor
// as far that held the same shard, itself where it can; none such, or a group that is no
// multiple of 2, and the round cannot go on, saying why.
TEST(StateProviders, EachRankTakesItsStateFromASurvivorAsFarThatHeldTheSameShard) {
  std::string why;
  const Json progress = Json::parse("[[5, 0], null, [4, 0], [5, 0]]");
  // Old ranks 0, 2, 3 survived; old rank 1 replaced (new rank 1). The source is new rank 0.
  const std::vector<int> members{0, -1, 2, 3};
  EXPECT_EQ(train::state_providers(members, progress, 0, 0, why), (std::vector<int>{0, 0, 0, 3}));
  // Shards by old rank % 2: the replacement (shard 1) from old rank 3, the survivor behind (old
  // rank 2, shard 0) from old rank 0.
  EXPECT_EQ(train::state_providers(members, progress, 0, 2, why), (std::vector<int>{0, 3, 0, 3}));
  // Shard 1's only survivor a step behind: nobody holds it as of step 5.
  const Json behind = Json::parse("[[5, 0], null, [5, 0], [4, 0]]");
  EXPECT_TRUE(train::state_providers(members, behind, 0, 2, why).empty());
  EXPECT_NE(why.find("no survivor holds ZeRO shard 1 of 2 as of step 5"), std::string::npos) << why;
  // Shrunk to 3: no multiple of the sharding group.
  why.clear();
  EXPECT_TRUE(train::state_providers({0, 2, 3}, Json::parse("[[5, 0], [5, 0], [5, 0]]"), 0, 2, why)
                  .empty());
  EXPECT_NE(why.find("the 3 workers left are no multiple of --shard-group-size 2"),
            std::string::npos)
      << why;
}

// A failed run's driver removes the live rounds' state folders (a killed worker leaves its own),
// and nothing else: the snapshots stay for a run that resumes it.
TEST(LiveStates, OnlyTheLiveRoundsFoldersAreRemoved) {
  const auto root = cohort::testing::temp_dir("live_states");
  const auto live = train::live_state_folder_in(root, "a1b2-live1", 2);
  std::filesystem::create_directories(live);
  std::ofstream(live / "model.safetensors") << "state";
  std::filesystem::create_directories(root / "snapshot_000010" / "checkpoint");
  train::remove_live_states(root);
  EXPECT_FALSE(std::filesystem::exists(live));
  EXPECT_TRUE(std::filesystem::exists(root / "snapshot_000010" / "checkpoint"));
  train::remove_live_states(root / "none");  // no folder: nothing to do
  std::filesystem::remove_all(root);
}

class LiveRecovery : public ::testing::Test {
 protected:
  void TearDown() override { std::filesystem::remove_all(dir); }

  Result fit(const std::string& name, Json config, FailureConfig failure = {}, int min_workers = 0,
             int workers = 3) {
    config["files"] = (dir / name).string();
    if (!config.contains("plan")) config["plan"] = "ddp";
    failure.recovery = FailureConfig::Recovery::kLive;
    if (failure.heartbeat_timeout == kDefaultHeartbeatTimeout)
      failure.heartbeat_timeout = std::chrono::seconds(3);
    // Field by field: GCC 12 takes a designated initializer of RunConfig's nested members for a
    // read of uninitialized memory (-Wmaybe-uninitialized).
    RunConfig run;
    run.name = name;
    run.storage_path = dir;
    run.failure_config = failure;
    run.snapshot_path = dir / "snapshots";
    run.verbose = 0;
    run.setup_timeout = std::chrono::seconds(60);
    run.collective_timeout = std::chrono::seconds(60);
    Trainer trainer(live_loop, {.num_workers = workers, .min_workers = min_workers}, run, config,
                    {{"train", testing::classifier_dataset()}});
    return trainer.fit();
  }

  // The pids that started run `name`'s loop, one per start.
  std::vector<int> loop_starts(const std::string& name) {
    std::vector<int> pids;
    std::ifstream in((dir / name).string() + "-pids.txt");
    for (int pid; in >> pid;) pids.push_back(pid);
    return pids;
  }

  // Of run `name`, by epoch: how often each row id was trained on, over every process.
  std::map<int, std::map<int64_t, int>> rows_trained(const std::string& name) {
    std::map<int, std::map<int64_t, int>> out;
    const auto starts = loop_starts(name);
    for (int pid : std::set<int>(starts.begin(), starts.end())) {
      std::ifstream in((dir / name).string() + "-" + std::to_string(pid) + ".txt");
      int epoch;
      int64_t id;
      while (in >> epoch >> id) ++out[epoch][id];
    }
    return out;
  }

  void expect_every_row_once_per_epoch(const std::string& name) {
    const auto trained = rows_trained(name);
    ASSERT_EQ(trained.size(), 2u);
    for (const auto& [epoch, counts] : trained) {
      EXPECT_EQ(static_cast<int64_t>(counts.size()), kClassifierRows) << "epoch " << epoch;
      for (const auto& [id, times] : counts)
        EXPECT_EQ(times, 1) << "row " << id << " of epoch " << epoch;
    }
  }

  std::map<std::string, at::Tensor> model_of(const Result& result) {
    return safetensors::read(result.checkpoint->path() / "model.safetensors");
  }

  // Run `name` (`killed`) recovered live from one failure with a replacement: its `workers`
  // processes and the replacement started the loop, every row trained on once per epoch, and it
  // ended as `whole`, the run that never failed, bit for bit.
  void expect_went_on_as(const std::string& name, const Result& killed, const Result& whole,
                         int workers) {
    ASSERT_TRUE(killed.ok()) << *killed.error;
    ASSERT_EQ(killed.failures.size(), 1u);
    EXPECT_EQ(killed.failures[0]["live"], true);
    EXPECT_EQ(killed.failures[0]["restarted"], false);
    const auto starts = loop_starts(name);
    EXPECT_EQ(std::set<int>(starts.begin(), starts.end()).size(), static_cast<size_t>(workers + 1));
    EXPECT_EQ(killed.metrics["world_size"], workers);
    EXPECT_EQ(killed.metrics["steps"], whole.metrics["steps"]);
    EXPECT_EQ(killed.metrics["replica_spread"], 0.0);
    expect_every_row_once_per_epoch(name);
    const auto expected = model_of(whole);
    const auto actual = model_of(killed);
    ASSERT_EQ(actual.size(), expected.size());
    for (const auto& [tensor_name, tensor] : expected)
      EXPECT_TRUE(torch::equal(actual.at(tensor_name), tensor)) << tensor_name;
  }

  std::filesystem::path dir = cohort::testing::temp_dir("live_recovery");
};

// Rank 0 (which reports), then rank 1, killed after step 2 of the first epoch: a replacement
// takes its place and the state of a survivor; the survivors never restart; the run trains on
// every row once per epoch and ends with the parameters of a run that never failed, bit for bit.
TEST_F(LiveRecovery, AKilledWorkerIsReplacedAndTheRunMatchesAnUninterruptedOne) {
  const auto whole = fit("whole", {});
  ASSERT_TRUE(whole.ok()) << *whole.error;
  for (int rank : {0, 1}) {
    SCOPED_TRACE("rank " + std::to_string(rank) + " killed");
    const std::string name = "killed" + std::to_string(rank);
    const auto killed = fit(name, {{"fault", "kill"}, {"fault_rank", rank}, {"fault_step", 2}});
    expect_went_on_as(name, killed, whole, 3);
    ASSERT_EQ(killed.failures.size(), 1u);
    EXPECT_EQ(killed.failures[0]["rank"], rank);
    EXPECT_FALSE(killed.failures[0]["recovery_s"].is_null());
    // Three processes started the loop, the replacement a fourth; the two survivors started it
    // again in their own processes.
    EXPECT_EQ(loop_starts(name).size(), 6u);
  }
}

// ZeRO stage 2, then stage 3 (every unit sharded), in sharding groups of 2 over 4 workers (each
// shard held by two ranks), rank 0 or 3 killed after step 2: the replacement takes the model and
// its shard from the survivor that held the same shard (at stage 3 the pieces of the model that
// survivor held: no collective gathers it in the broken group), the survivors keep their own; the
// run ends as one that never failed, bit for bit.
TEST_F(LiveRecovery, ZeroInShardingGroupsTakesTheLostShardFromItsReplica) {
  for (const std::string plan : {"hsdp", "hsdp3"}) {
    const auto whole = fit(plan + "-whole", {{"plan", plan}}, {}, 0, /*workers=*/4);
    ASSERT_TRUE(whole.ok()) << *whole.error;
    for (int rank : {0, 3}) {
      SCOPED_TRACE(plan + ", rank " + std::to_string(rank) + " killed");
      const std::string name = plan + "-killed" + std::to_string(rank);
      const auto killed =
          fit(name, {{"plan", plan}, {"fault", "kill"}, {"fault_rank", rank}, {"fault_step", 2}},
              {}, 0, /*workers=*/4);
      expect_went_on_as(name, killed, whole, 4);
    }
  }
}

// ZeRO in sharding groups of 2 without a replacement: the 3 survivors are no multiple of 2, so
// each says so and the group restarts (from the epoch's start: no checkpoint yet) on the 4 slots,
// free again; the run ends well.
TEST_F(LiveRecovery, ZeroWithoutAReplacementFallsBackToARestartSayingWhy) {
  FailureConfig failure;
  failure.replace_lost = false;
  failure.max_failures = 2;  // the live round's and the restart's
  const auto result = fit(
      "hsdp-shrunk", {{"plan", "hsdp"}, {"fault", "kill"}, {"fault_rank", 1}, {"fault_step", 2}},
      failure, /*min_workers=*/2, /*workers=*/4);
  ASSERT_TRUE(result.ok()) << *result.error;
  EXPECT_FALSE(result.failures.empty());
  EXPECT_EQ(result.metrics["world_size"], 4);
  EXPECT_EQ(result.metrics["replica_spread"], 0.0);
  std::string logs;
  for (const auto& entry : std::filesystem::directory_iterator(dir / "hsdp-shrunk" / "logs")) {
    std::ifstream in(entry.path());
    logs += std::string(std::istreambuf_iterator<char>(in), {});
  }
  EXPECT_NE(logs.find("live recovery cannot go on: the 3 workers left are no multiple of "
                      "--shard-group-size 2; the group restarts"),
            std::string::npos)
      << logs;
}

// Local SGD and DiLoCo (a synchronisation every 2 steps), rank 1 killed right after one: the
// survivors keep their replicas and the replacement takes a survivor's (all the same then); with
// a stateless inner optimizer the run ends as one that never failed, bit for bit.
TEST_F(LiveRecovery, LocalSgdAndDiLoCoGoOnWithTheSurvivorsReplicas) {
  for (const std::string plan : {"local_sgd", "diloco"}) {
    SCOPED_TRACE(plan);
    const auto whole = fit(plan + "-whole", {{"plan", plan}, {"sgd", true}});
    ASSERT_TRUE(whole.ok()) << *whole.error;
    const auto killed = fit(
        plan + "-killed",
        {{"plan", plan}, {"sgd", true}, {"fault", "kill"}, {"fault_rank", 1}, {"fault_step", 2}});
    expect_went_on_as(plan + "-killed", killed, whole, 3);
  }
}

// Local SGD with AdamW, a worker killed between synchronisations (after step 3 of a period of 2):
// the two survivors go on alone from their own replicas and optimizer state (each loads the
// parameters it had, which differ), the lost one's progress since the synchronisation dropped;
// every row trained on once, the replicas one model after the epoch's synchronisation.
TEST_F(LiveRecovery, LocalSgdSurvivorsGoOnAloneBetweenSynchronisations) {
  FailureConfig failure;
  failure.replace_lost = false;
  const auto result =
      fit("local-shrunk",
          {{"plan", "local_sgd"}, {"fault", "kill"}, {"fault_rank", 0}, {"fault_step", 3}}, failure,
          /*min_workers=*/2);
  ASSERT_TRUE(result.ok()) << *result.error;
  ASSERT_EQ(result.failures.size(), 1u);
  EXPECT_EQ(result.failures[0]["live"], true);
  EXPECT_EQ(result.metrics["world_size"], 2);
  EXPECT_EQ(result.metrics["replica_spread"], 0.0);
  expect_every_row_once_per_epoch("local-shrunk");
  const auto starts = loop_starts("local-shrunk");
  std::vector<double> loaded;
  for (int pid : std::set<int>(starts.begin(), starts.end())) {
    std::ifstream in((dir / "local-shrunk").string() + "-" + std::to_string(pid) + "-sums.txt");
    std::string what;
    double last_step_sum = 0;
    int64_t steps = 0;
    for (double sum; in >> what;) {
      if (what == "step") {
        in >> steps >> sum;
        last_step_sum = sum;
      } else {
        in >> sum;
        EXPECT_EQ(steps, 3) << "pid " << pid << " regrouped after step " << steps;
        EXPECT_EQ(sum, last_step_sum) << "pid " << pid << " did not keep its own replica";
        loaded.push_back(sum);
      }
    }
  }
  ASSERT_EQ(loaded.size(), 2u);  // the two survivors, once each
  EXPECT_NE(loaded[0], loaded[1]);
}

// Without replacements the two survivors go on alone: the epoch's remaining rows re-balanced over
// them, each trained on once, the replicas equal.
TEST_F(LiveRecovery, WithoutAReplacementTheSurvivorsGoOnAlone) {
  FailureConfig failure;
  failure.replace_lost = false;
  const auto result = fit("shrunk", {{"fault", "kill"}, {"fault_rank", 2}, {"fault_step", 2}},
                          failure, /*min_workers=*/2);
  ASSERT_TRUE(result.ok()) << *result.error;
  ASSERT_EQ(result.failures.size(), 1u);
  EXPECT_EQ(result.failures[0]["live"], true);
  EXPECT_EQ(result.metrics["world_size"], 2);
  EXPECT_EQ(result.metrics["replica_spread"], 0.0);
  const auto starts = loop_starts("shrunk");
  EXPECT_EQ(std::set<int>(starts.begin(), starts.end()).size(), 3u);
  ASSERT_EQ(result.resizes.size(), 1u);
  EXPECT_EQ(result.resizes[0]["to"], 2);
  expect_every_row_once_per_epoch("shrunk");
}

// A worker that stops (SIGSTOP) is found by its missing heartbeats, killed by the driver and
// replaced; the others go on.
TEST_F(LiveRecovery, AHungWorkerIsKilledAndReplaced) {
  const auto result = fit("hung", {{"fault", "stop"}, {"fault_rank", 2}, {"fault_step", 2}});
  ASSERT_TRUE(result.ok()) << *result.error;
  ASSERT_EQ(result.failures.size(), 1u);
  EXPECT_EQ(result.failures[0]["live"], true);
  EXPECT_NE(result.failures[0]["cause"].get<std::string>().find("heartbeat"), std::string::npos)
      << result.failures[0].dump();
  EXPECT_EQ(result.metrics["world_size"], 3);
  EXPECT_EQ(result.metrics["replica_spread"], 0.0);
  expect_every_row_once_per_epoch("hung");
}

// A plan whose lost worker's state lives nowhere else is refused, naming the fallback.
TEST_F(LiveRecovery, IsRefusedForAPlanThatCannotRecoverLive) {
  const auto result = fit("zero", {{"plan", "zero1"}});
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.error->find("ZeRO stage 1"), std::string::npos) << *result.error;
  EXPECT_NE(result.error->find("--shard-group-size"), std::string::npos) << *result.error;
  EXPECT_NE(result.error->find("--recovery restart"), std::string::npos) << *result.error;
  const auto stage3 = fit("zero3", {{"plan", "zero3"}});
  ASSERT_FALSE(stage3.ok());
  EXPECT_NE(stage3.error->find("ZeRO stage 3"), std::string::npos) << *stage3.error;
  const auto served = fit("ps", {{"plan", "parameter_server"}});
  ASSERT_FALSE(served.ok());
  EXPECT_NE(served.error->find("the parameters the lost worker served"), std::string::npos)
      << *served.error;
}

}  // namespace
}  // namespace cohort

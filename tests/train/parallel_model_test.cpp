#include "cohort/train/parallel_model.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <csignal>
#include <fstream>
#include <map>
#include <set>

#include "cohort/cohort.h"
#include "cohort/parallel/fully_shard.h"
#include "support/run_config.h"
#include "support/small_classifier.h"
#include "support/subprocess.h"
#include "support/tiny_mnist.h"
#include "train/run_files.h"
#include "train/snapshots.h"

namespace cohort {
namespace {

using testing::kClassifierBatch;
using testing::kClassifierRows;
using testing::plan_named;

// Two epochs of `plan` on the rows of get_dataset_shard, or of prepare_data_loader with config
// "loader"; stopped with a checkpoint after `stop_after` steps (0: never). Every rank writes the
// ids it trained on, by epoch, to <ids>-rank<r>.txt.
void train_loop(const Json& c) {
  auto& ctx = train::get_context();
  auto plan = plan_named(c["plan"]);
  plan.activation_checkpointing =
      parallel::parse_activation_checkpointing(c.value("activation_checkpointing", "none"));
  auto model = testing::classifier_net(plan, /*hidden_layers=*/2, c.value("dropout", 0.0));
  train::ResumePoint start;
  if (auto checkpoint = train::get_checkpoint()) {
    model.load(*checkpoint);
    start = train::resume_point(*checkpoint);
  }
  const int64_t rows = kClassifierBatch * plan.gradient_accumulation_steps;
  const int64_t stop_after = c["stop_after"];
  // Snapshots after the steps `snapshot_at`; rank 1 killed after step `kill_at`, once (a file says
  // it was).
  const auto snapshot_at = c.value("snapshot_at", std::vector<int64_t>{});
  const int64_t kill_at = c.value("kill_at", int64_t{0});
  const std::string ids_file =
      c["ids"].get<std::string>() + "-rank" + std::to_string(ctx.get_world_rank()) + ".txt";
  std::ofstream ids(ids_file, std::ios::app);
  // With a kill: "<epoch> <step> <id> <start>" of every row, for the rows of the steps retaken;
  // <start> tells this start of the worker from the one before it, which may have written the
  // same step last (the killed rank's last step is the first that the restarted group retakes).
  std::ofstream rows_by_step(ids_file + ".steps", std::ios::app);
  const auto started = std::chrono::steady_clock::now().time_since_epoch().count();
  if (ctx.get_world_rank() == 0) {
    std::ofstream(c["ids"].get<std::string>() + "-resumed-from.txt", std::ios::app)
        << (train::get_checkpoint() ? train::get_checkpoint()->path().string() : "none") << "\n";
  }
  std::optional<data::DataIterator> stream;
  std::optional<data::DataLoader> loader;
  if (c["stream"] == "loader") {
    auto [x, y] = testing::classifier_examples();
    loader.emplace(
        train::prepare_data_loader({.inputs = x, .targets = y}, {.batch_size = rows, .seed = 7}));
  } else {
    stream.emplace(train::get_dataset_shard("train"));
  }
  for (int epoch = start.epoch; epoch < 2; ++epoch) {
    int64_t step = epoch == start.epoch ? start.epoch_steps_done : 0;
    bool stopped = false;
    const auto train_on = [&](const at::Tensor& x, const at::Tensor& y) {
      for (int64_t i = 0; i < x.size(0); ++i) {
        ids << epoch << " " << x[i][0].item<int64_t>() << "\n";
        rows_by_step << epoch << " " << model.steps() + 1 << " " << x[i][0].item<int64_t>() << " "
                     << started << "\n";
      }
      rows_by_step.flush();
      model.step(x, y);
      ++step;
      if (std::count(snapshot_at.begin(), snapshot_at.end(), model.steps()) > 0) {
        train::snapshot(
            {{"epoch", epoch + 1}, {train::kEpochStepMetric, step}, {"steps", model.steps()}},
            model);
      }
      const auto killed = std::filesystem::path(c["ids"].get<std::string>() + "-killed");
      if (model.steps() == kill_at && ctx.get_world_rank() == 1 &&
          !std::filesystem::exists(killed)) {
        std::ofstream(killed) << "once\n";
        std::raise(SIGKILL);
      }
      return stopped = model.steps() == stop_after;
    };
    if (loader) {
      loader->set_epoch(epoch);
      for (auto& batch : *loader)
        if (train_on(batch.data, batch.target)) break;
    } else {
      stream->set_epoch(epoch);
      for (auto& batch : stream->iter_batches({.batch_size = rows}))
        if (train_on(batch["x"], batch["y"])) break;
    }
    // The replicas agree at an epoch's end; a checkpoint inside one keeps every rank's own state.
    if (!stopped) model.sync();
    // The units of this rank's model, and those of them that recompute in backward.
    int64_t units = 0, checkpointed_units = 0;
    for (const auto& m : model.module().modules()) {
      const auto* unit = dynamic_cast<const parallel::FullyShardImpl*>(m.get());
      units += unit != nullptr;
      checkpointed_units += unit != nullptr && unit->activation_checkpointing();
    }
    train::report({{"epoch", epoch + 1},
                   {train::kEpochStepMetric, stopped ? step : 0},
                   {"steps", model.steps()},
                   {"units", units},
                   {"checkpointed_units", checkpointed_units}},
                  model, {.async = c.value("async", false)});
    if (stopped) break;
  }
}

class ParallelModelResume : public ::testing::Test {
 protected:
  void TearDown() override { std::filesystem::remove_all(dir); }

  Result fit(const std::string& name, const std::string& plan, int workers, int64_t stop_after,
             const std::string& stream = "dataset",
             const std::string& activation_checkpointing = "none") {
    return fit_with(name, plan, workers,
                    {{"activation_checkpointing", activation_checkpointing},
                     {"stop_after", stop_after},
                     {"stream", stream}});
  }

  // train_loop's run `name` of `plan` on `workers` with `config` (beside the plan and the ids
  // files), surviving `max_failures`.
  Result fit_with(const std::string& name, const std::string& plan, int workers, Json config,
                  int max_failures = 0) {
    const auto p = plan_named(plan);
    config["plan"] = plan;
    config["ids"] = (dir / name).string() + "-ids";
    if (!config.contains("stop_after")) config["stop_after"] = 0;
    if (!config.contains("stream")) config["stream"] = "dataset";
    Trainer trainer(train_loop,
                    {.num_workers = workers,
                     .num_parameter_servers = plan == "parameter_server" ? 1 : 0,
                     .mesh = {.pp = p.pp}},
                    {.name = name,
                     .storage_path = dir,
                     .failure_config = {.max_failures = max_failures},
                     .snapshot_path = snapshots,
                     .verbose = 0,
                     .setup_timeout = std::chrono::seconds(60),
                     .collective_timeout = std::chrono::seconds(60)},
                    config, {{"train", testing::classifier_dataset()}});
    return trainer.fit();
  }

  // Stopped inside its second epoch with a checkpoint and run again, `plan` trains on exactly the
  // rows an uninterrupted run does and ends with its parameters. `config` adds train_loop's
  // "async" and "dropout".
  void expect_resumed_run_matches(const std::string& plan, int workers, const Json& config);

  // The run's whole model, one tensor per name.
  std::map<std::string, at::Tensor> model_of(const Result& result) {
    const auto file = dir / "consolidated.safetensors";
    train::consolidate_checkpoint(*result.checkpoint, file);
    return safetensors::read(file);
  }

  // (epoch, row id) of every row rank `rank` of run `name` trained on in the steps that count: a
  // step taken again after a restore counts as its last taking.
  std::vector<std::pair<int, int64_t>> rows_by_step_of(const std::string& name, int rank) {
    std::map<int64_t, std::vector<std::pair<int, int64_t>>> by_step;
    std::ifstream in((dir / name).string() + "-ids-rank" + std::to_string(rank) + ".txt.steps");
    int epoch;
    int64_t step, id, start, previous = -1, previous_start = -1;
    while (in >> epoch >> step >> id >> start) {
      // A taking of the step begins: another step, or the same one by a restarted worker.
      if (step != previous || start != previous_start) by_step[step].clear();
      by_step[step].emplace_back(epoch, id);
      previous = step;
      previous_start = start;
    }
    std::vector<std::pair<int, int64_t>> out;
    for (const auto& [s, rows] : by_step) out.insert(out.end(), rows.begin(), rows.end());
    return out;
  }

  // The checkpoints each start of run `name` resumed from ("none" for a fresh start).
  std::vector<std::string> resumed_from(const std::string& name) {
    std::vector<std::string> out;
    std::ifstream in((dir / name).string() + "-ids-resumed-from.txt");
    for (std::string line; std::getline(in, line);) out.push_back(line);
    return out;
  }

  // Where two lists of (epoch, row id) first differ, and their lengths: gtest shows the first 32
  // rows of each only.
  static std::string first_difference(const std::vector<std::pair<int, int64_t>>& a,
                                      const std::vector<std::pair<int, int64_t>>& b) {
    size_t i = 0;
    while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
    const auto at = [i](const auto& rows) {
      return i < rows.size()
                 ? "(" + std::to_string(rows[i].first) + ", " + std::to_string(rows[i].second) + ")"
                 : std::string("the end");
    };
    return "; " + std::to_string(a.size()) + " and " + std::to_string(b.size()) +
           " rows, first different at row " + std::to_string(i) + ": " + at(a) + " against " +
           at(b);
  }

  // (epoch, row id) of every row rank `rank` of run `name` trained on, in order.
  std::vector<std::pair<int, int64_t>> ids_of(const std::string& name, int rank) {
    std::vector<std::pair<int, int64_t>> out;
    std::ifstream in((dir / name).string() + "-ids-rank" + std::to_string(rank) + ".txt");
    int epoch;
    int64_t id;
    while (in >> epoch >> id) out.emplace_back(epoch, id);
    return out;
  }

  std::filesystem::path dir = cohort::testing::temp_dir("parallel_model_resume");
  // Where the runs keep their snapshots (RunConfig::snapshot_path): the test's own.
  std::filesystem::path snapshots = dir / "snapshots";
};

// Stopped half way through the second epoch (6 steps of 2 x 8 rows an epoch; 12 of 8 rows with a
// pipeline's one replica; 3 with the mesh's 2 replicas of 2 x 8 accumulated), checkpointed and
// run again, a plan trains on exactly the rows the uninterrupted
// run does, in the same order, and ends with the same parameters bit for bit.
struct PlanCase {
  std::string plan;
  int workers;
};

class EveryPlanFamily : public ParallelModelResume,
                        public ::testing::WithParamInterface<PlanCase> {};

TEST_P(EveryPlanFamily, ResumedInsideAnEpochMatchesAnUninterruptedRun) {
  const auto& [plan, workers] = GetParam();
  expect_resumed_run_matches(plan, workers, Json::object());
}

// The same with every checkpoint saved asynchronously (SaveOptions::async: written to memory,
// copied into the run directory and committed behind the loop).
class AsynchronousSaves : public ParallelModelResume,
                          public ::testing::WithParamInterface<PlanCase> {};

TEST_P(AsynchronousSaves, ResumedInsideAnEpochMatchesAnUninterruptedRun) {
  const auto& [plan, workers] = GetParam();
  expect_resumed_run_matches(plan, workers, {{"async", true}});
}

// With dropout, each rank draws its masks from its own generators: a checkpoint keeps them
// (every rank's, optim::RandomState), so the resumed run draws the masks the uninterrupted run
// draws and ends with its parameters bit for bit.
class RandomGenerators : public ParallelModelResume,
                         public ::testing::WithParamInterface<PlanCase> {};

TEST_P(RandomGenerators, ResumedWithDropoutMatchesAnUninterruptedRun) {
  const auto& [plan, workers] = GetParam();
  expect_resumed_run_matches(plan, workers, {{"dropout", 0.25}});
}

void ParallelModelResume::expect_resumed_run_matches(const std::string& plan, int workers,
                                                     const Json& config) {
  const bool async = config.value("async", false);
  const auto run = [&](const std::string& name, int64_t stop_after) {
    auto c = config;
    c["stop_after"] = stop_after;
    return fit_with(name, plan, workers, c);
  };
  const auto whole = run(plan + "-whole", 0);
  ASSERT_TRUE(whole.ok()) << *whole.error;
  const int64_t steps = whole.metrics["steps"];
  const auto stopped = run(plan + "-stopped", steps / 2 + steps / 4);
  ASSERT_TRUE(stopped.ok()) << *stopped.error;
  EXPECT_EQ(stopped.metrics[train::kEpochStepMetric], steps / 4);
  // An asynchronous save says how long the step stood still for it.
  EXPECT_EQ(stopped.metrics.contains("checkpoint_snapshot_s"), async) << stopped.metrics.dump();
  // Every rank's generators and the schedule's step are in the checkpoint.
  const auto& kept = stopped.checkpoint->path();
  EXPECT_TRUE(train::holds_state(kept, optim::kLrSchedulePart));
  EXPECT_TRUE(train::holds_state(kept, optim::kRandomStatePart));
  EXPECT_TRUE(std::filesystem::exists(kept / ("rng-rank" + std::to_string(workers - 1) + "-of-" +
                                              std::to_string(workers) + ".safetensors")));
  const auto resumed = run(plan + "-stopped", 0);
  ASSERT_TRUE(resumed.ok()) << *resumed.error;
  EXPECT_EQ(resumed.metrics["steps"], steps);
  for (int rank = 0; rank < workers; ++rank)
    EXPECT_EQ(ids_of(plan + "-stopped", rank), ids_of(plan + "-whole", rank)) << rank;
  // The parameter server applies each push as it comes, in whatever order the workers' pushes
  // arrive: two of its runs never agree bit for bit, stopped or not.
  if (plan == "parameter_server") return;
  const auto expected = model_of(whole);
  const auto actual = model_of(resumed);
  ASSERT_EQ(actual.size(), expected.size());
  for (const auto& [name, tensor] : expected)
    EXPECT_TRUE(torch::equal(actual.at(name), tensor)) << name;
}

// A rank killed two steps after a snapshot inside the second epoch (the last checkpoint on disk is
// the first epoch's end): the restarted group resumes from the snapshot, not the disk, retakes at
// most the steps since it, trains on every row of the epoch once in the end, in the uninterrupted
// run's order, and ends with its parameters bit for bit. The run's snapshots go when it ends.
class SnapshotRestore : public ParallelModelResume,
                        public ::testing::WithParamInterface<PlanCase> {};

TEST_P(SnapshotRestore, AfterAKillMatchesAnUninterruptedRun) {
  const auto& [plan, workers] = GetParam();
  const auto whole = fit(plan + "-whole", plan, workers, 0);
  ASSERT_TRUE(whole.ok()) << *whole.error;
  // Rank 1 passes the second snapshot's start only once every rank's writer finished the first:
  // the first is whole when the kill comes.
  const auto killed = fit_with(plan + "-killed", plan, workers,
                               {{"snapshot_at", {8, 9}}, {"kill_at", 10}}, /*max_failures=*/1);
  ASSERT_TRUE(killed.ok()) << *killed.error;
  ASSERT_EQ(killed.failures.size(), 1u);
  EXPECT_EQ(killed.failures[0].value("restored_from", ""), "snapshot") << killed.failures[0].dump();
  const auto starts = resumed_from(plan + "-killed");
  ASSERT_EQ(starts.size(), 2u);
  EXPECT_EQ(starts[0], "none");
  EXPECT_NE(starts[1].find("/snapshot_"), std::string::npos) << starts[1];
  EXPECT_EQ(killed.metrics["steps"], whole.metrics["steps"]);
  for (int rank = 0; rank < workers; ++rank) {
    const auto rows = rows_by_step_of(plan + "-killed", rank);
    const auto expected_rows = ids_of(plan + "-whole", rank);
    EXPECT_EQ(rows, expected_rows) << "rank " << rank << first_difference(rows, expected_rows);
  }
  const auto expected = model_of(whole);
  const auto actual = model_of(killed);
  ASSERT_EQ(actual.size(), expected.size());
  for (const auto& [name, tensor] : expected)
    EXPECT_TRUE(torch::equal(actual.at(name), tensor)) << name;
  EXPECT_FALSE(std::filesystem::exists(train::snapshot_run_folder(snapshots, killed.path)));
}

INSTANTIATE_TEST_SUITE_P(ParallelModel, SnapshotRestore,
                         ::testing::Values(PlanCase{"ddp", 2}, PlanCase{"zero2", 2},
                                           PlanCase{"zero3", 2}, PlanCase{"local_sgd", 2}),
                         [](const auto& info) { return info.param.plan; });

// A failed run keeps its snapshots; when the files a rank wrote are lost with its node, the run
// resumed later restores from the copies its buddy kept, to the uninterrupted run's parameters.
TEST_F(ParallelModelResume, ASnapshotWhoseOwnFilesAreLostRestoresFromTheBuddyCopies) {
  const auto whole = fit("buddy-whole", "zero2", 2, 0);
  ASSERT_TRUE(whole.ok()) << *whole.error;
  const auto failed = fit_with("buddy", "zero2", 2, {{"snapshot_at", {8, 9}}, {"kill_at", 10}});
  ASSERT_FALSE(failed.ok());
  const auto folder = train::snapshot_run_folder(snapshots, failed.path);
  const auto held = train::held_snapshots(folder);
  ASSERT_GE(held.size(), 1u);
  // Rank 0's own files gone from every snapshot, as with the loss of its node.
  for (const auto& s : held) {
    const auto snap = folder / s.name;
    const auto list = snap / train::kSnapshotRanksDir / "0.json";
    ASSERT_TRUE(std::filesystem::exists(list));
    const auto names = read_json(list).get<std::vector<std::string>>();
    ASSERT_FALSE(names.empty());
    for (const auto& name : names)
      ASSERT_TRUE(std::filesystem::remove(snap / train::kSnapshotCheckpointDir / name)) << name;
    std::filesystem::remove(list);
  }
  const auto resumed = fit_with("buddy", "zero2", 2, Json::object());
  ASSERT_TRUE(resumed.ok()) << *resumed.error;
  const auto starts = resumed_from("buddy");
  ASSERT_EQ(starts.size(), 2u);
  EXPECT_NE(starts[1].find("restored-rank"), std::string::npos) << starts[1];
  EXPECT_EQ(resumed.metrics["steps"], whole.metrics["steps"]);
  const auto expected = model_of(whole);
  const auto actual = model_of(resumed);
  ASSERT_EQ(actual.size(), expected.size());
  for (const auto& [name, tensor] : expected)
    EXPECT_TRUE(torch::equal(actual.at(name), tensor)) << name;
}

INSTANTIATE_TEST_SUITE_P(ParallelModel, EveryPlanFamily,
                         ::testing::Values(PlanCase{"ddp", 2}, PlanCase{"zero1", 2},
                                           PlanCase{"zero2", 2}, PlanCase{"zero3", 2},
                                           PlanCase{"hsdp", 4}, PlanCase{"pipeline", 2},
                                           PlanCase{"mesh", 4}, PlanCase{"local_sgd", 2},
                                           PlanCase{"diloco", 2}, PlanCase{"parameter_server", 2}),
                         [](const auto& info) { return info.param.plan; });
INSTANTIATE_TEST_SUITE_P(ParallelModel, RandomGenerators,
                         ::testing::Values(PlanCase{"ddp", 2}, PlanCase{"zero3", 2},
                                           PlanCase{"pipeline", 2}),
                         [](const auto& info) { return info.param.plan; });
INSTANTIATE_TEST_SUITE_P(ParallelModel, AsynchronousSaves,
                         ::testing::Values(PlanCase{"ddp", 2}, PlanCase{"zero3", 2},
                                           PlanCase{"mesh", 4}, PlanCase{"local_sgd", 2}),
                         [](const auto& info) { return info.param.plan; });

// With every:1 (the units recomputed in backward: at stage 3 inside its gather again, in a
// pipeline inside each stage, with zero-bubble's input and weight backward apart), a plan trains
// to the parameters it reaches without checkpointing. Without a pipeline the last unit stays
// plain (backward would recompute it at once); a pipeline's stages checkpoint every unit.
class ActivationCheckpointingPlans : public ParallelModelResume,
                                     public ::testing::WithParamInterface<PlanCase> {};

TEST_P(ActivationCheckpointingPlans, TrainToTheParametersOfThePlainRun) {
  const auto& [plan, workers] = GetParam();
  const auto plain = fit(plan + "-plain", plan, workers, 0);
  ASSERT_TRUE(plain.ok()) << *plain.error;
  const auto checkpointed = fit(plan + "-checkpointed", plan, workers, 0, "dataset", "every:1");
  ASSERT_TRUE(checkpointed.ok()) << *checkpointed.error;
  EXPECT_EQ(checkpointed.metrics["steps"], plain.metrics["steps"]);
  EXPECT_EQ(plain.metrics["checkpointed_units"], 0);
  // A mesh's worker holds the whole model, its stages' units included.
  const int64_t units = checkpointed.metrics["units"];
  const bool pipeline = plan == "pipeline" || plan == "zero_bubble" || plan == "mesh";
  EXPECT_GE(units, 2);
  EXPECT_EQ(checkpointed.metrics["checkpointed_units"], pipeline ? units : units - 1);
  const auto expected = model_of(plain);
  const auto actual = model_of(checkpointed);
  ASSERT_EQ(actual.size(), expected.size());
  for (const auto& [name, tensor] : expected) {
    EXPECT_TRUE(torch::allclose(actual.at(name), tensor, 0, 1e-6))
        << name << " differs by " << (actual.at(name) - tensor).abs().max().item<double>();
  }
}

INSTANTIATE_TEST_SUITE_P(ParallelModel, ActivationCheckpointingPlans,
                         ::testing::Values(PlanCase{"ddp", 2}, PlanCase{"zero2", 2},
                                           PlanCase{"zero3", 2}, PlanCase{"pipeline", 2},
                                           PlanCase{"zero_bubble", 2}, PlanCase{"mesh", 4}),
                         [](const auto& info) { return info.param.plan; });

// A run of 2 workers stopped inside an epoch and resumed on 3 trains on every row of that epoch
// once, none lost and none repeated, from get_dataset_shard and from prepare_data_loader alike.
TEST_F(ParallelModelResume, AnEpochResumedAtAnotherWorldSizeLosesAndRepeatsNoRow) {
  for (const std::string stream : {"dataset", "loader"}) {
    SCOPED_TRACE(stream);
    const auto name = "elastic-" + stream;
    const auto stopped = fit(name, "ddp", 2, 6 + 3, stream);  // half the second epoch
    ASSERT_TRUE(stopped.ok()) << *stopped.error;
    const auto resumed = fit(name, "ddp", 3, 0, stream);
    ASSERT_TRUE(resumed.ok()) << *resumed.error;
    std::multiset<int64_t> second_epoch;
    for (int rank = 0; rank < 3; ++rank)
      for (const auto& [epoch, id] : ids_of(name, rank))
        if (epoch == 1) second_epoch.insert(id);
    // 48 rows taken on 2 ranks, the other 48 split over 3.
    std::multiset<int64_t> every_row;
    for (int64_t id = 0; id < kClassifierRows; ++id) every_row.insert(id);
    EXPECT_EQ(second_epoch, every_row);
  }
}

// Two steps of plan `c["plan"]`, then ParallelModel::evaluate on every row of
// classifier_examples(), and the same rows scored by hand on the whole model in this one process.
void evaluate_loop(const Json& c) {
  const auto plan = plan_named(c["plan"]);
  auto model = testing::classifier_net(plan, /*hidden_layers=*/1);
  auto [x, y] = testing::classifier_examples();
  for (int step = 0; step < 2; ++step)
    model.step(x.narrow(0, step * 2 * kClassifierBatch, 2 * kClassifierBatch),
               y.narrow(0, step * 2 * kClassifierBatch, 2 * kClassifierBatch));
  // 500-row batches would give each rank one; 10 makes several, and a last short one.
  const auto eval = model.evaluate({.inputs = x, .targets = y}, 10);
  double loss = 0, accuracy = 0;
  {
    auto whole = model.whole_model();
    torch::NoGradGuard no_grad;
    const auto out = model.forward(x);
    loss = torch::nn::functional::cross_entropy(out, y).item<double>();
    accuracy = out.argmax(1).eq(y).to(torch::kDouble).mean().item<double>();
  }
  train::report({{"loss", eval.loss},
                 {"accuracy", eval.accuracy.value_or(-1.0)},
                 {"rows", eval.rows},
                 {"expected_loss", loss},
                 {"expected_accuracy", accuracy}});
}

// ParallelModel::evaluate scores every row once over the ranks, whatever the plan cuts: the loss
// and accuracy of the whole model on all rows, as one process computes them. The plans run one
// after the other in this one program (each fit's workers take its own mesh from their spec).
TEST(ParallelModelEvaluate, ScoresEveryRowOnceWhateverThePlanCuts) {
  const auto dir = cohort::testing::temp_dir("parallel_model_evaluate");
  for (const std::string plan : {"ddp", "zero3", "pipeline"}) {
    SCOPED_TRACE(plan);
    Trainer trainer(evaluate_loop, {.num_workers = 2, .mesh = {.pp = plan_named(plan).pp}},
                    cohort::testing::quiet_run(dir, plan), Json{{"plan", plan}});
    const auto result = trainer.fit();
    ASSERT_TRUE(result.ok()) << *result.error;
    EXPECT_EQ(result.metrics["rows"], kClassifierRows);
    EXPECT_NEAR(result.metrics["loss"].get<double>(), result.metrics["expected_loss"].get<double>(),
                1e-6);
    EXPECT_DOUBLE_EQ(result.metrics["accuracy"].get<double>(),
                     result.metrics["expected_accuracy"].get<double>());
  }
  std::filesystem::remove_all(dir);
}

// `net` (a small classifier) made parallel per `plan`, with SGD and cross entropy.
train::ParallelModel parallel_classifier(torch::nn::Sequential net, const train::Plan& plan) {
  return train::parallelize(
      {.module = net.ptr(),
       .forward = [net](const at::Tensor& x) mutable { return net->forward(x); }},
      [](std::vector<at::Tensor> p) {
        return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1));
      },
      [](const at::Tensor& out, const at::Tensor& y) {
        return torch::nn::functional::cross_entropy(out, y);
      },
      plan);
}

// Each rank builds other weights (seeded by its rank) and asks how far the replicas are apart
// before any step: DDP gives every rank rank 0's state at the first step or evaluation rather
// than at parallelize (where a load follows, it is not needed at all).
void differently_seeded_loop(const Json&) {
  torch::manual_seed(train::get_context().get_world_rank());
  torch::nn::Sequential net(torch::nn::Linear(8, 4));
  auto model = parallel_classifier(net, train::Plan{});
  train::report({{"replica_spread", model.replica_spread()}});
}

TEST(ParallelModelReplicas, RanksThatBuiltOtherWeightsAgreeBeforeTheFirstStep) {
  const auto dir = cohort::testing::temp_dir("parallel_model_replicas");
  Trainer trainer(differently_seeded_loop, {.num_workers = 2},
                  cohort::testing::quiet_run(dir, "seeded"));
  const auto result = trainer.fit();
  ASSERT_TRUE(result.ok()) << *result.error;
  EXPECT_EQ(result.metrics["replica_spread"], 0.0);
  std::filesystem::remove_all(dir);
}

// A small model of `plan` trained one step; reports the worker's precision after parallelize, the
// loss scaler's options and the dtype of a forward under train::autocast().
void precision_loop(const Json& c) {
  torch::manual_seed(0);
  torch::nn::Sequential net(torch::nn::Linear(8, 4));
  train::Plan plan;
  if (c.contains("precision")) plan.precision = optim::precision_from_string(c["precision"]);
  plan.loss_scaler.initial_scale = 1024;
  auto model = parallel_classifier(net, plan);
  auto [x, y] = testing::classifier_examples();
  model.step(x.narrow(0, 0, kClassifierBatch), y.narrow(0, 0, kClassifierBatch));
  at::Tensor out;
  {
    auto autocast = train::autocast();
    out = model.forward(x.narrow(0, 0, 2));
  }
  train::report({{"worker_precision", optim::to_string(train::get_context().get_precision())},
                 {"forward_dtype", std::string(c10::toString(out.scalar_type()))}});
}

// The plan's precision is the worker's: ScalingConfig says nothing of it, yet train::autocast()
// (and the rest of the run) follows the plan's bf16.
TEST(ParallelModelPrecision, ThePlansPrecisionBecomesTheWorkers) {
  const auto dir = cohort::testing::temp_dir("plan_precision");
  Trainer trainer(precision_loop, {.num_workers = 1}, cohort::testing::quiet_run(dir, "bf16"),
                  Json{{"precision", "bf16"}});
  const auto result = trainer.fit();
  std::filesystem::remove_all(dir);
  ASSERT_TRUE(result.ok()) << *result.error;
  EXPECT_EQ(result.metrics["worker_precision"], "bf16");
  EXPECT_EQ(result.metrics["forward_dtype"], "BFloat16");
}

// A plan without a precision keeps the run's (ScalingConfig::precision).
TEST(ParallelModelPrecision, APlanWithoutOneKeepsTheRunsPrecision) {
  const auto dir = cohort::testing::temp_dir("plan_precision_unset");
  Trainer trainer(precision_loop, {.num_workers = 1, .precision = "bf16"},
                  cohort::testing::quiet_run(dir, "unset"), Json::object());
  const auto result = trainer.fit();
  std::filesystem::remove_all(dir);
  ASSERT_TRUE(result.ok()) << *result.error;
  EXPECT_EQ(result.metrics["worker_precision"], "bf16");
}

// A plan's precision that contradicts the run's is one line naming both.
TEST(ParallelModelPrecision, APlanThatContradictsTheRunsPrecisionNamesBoth) {
  const auto dir = cohort::testing::temp_dir("plan_precision_conflict");
  Trainer trainer(precision_loop, {.num_workers = 1, .precision = "bf16"},
                  cohort::testing::quiet_run(dir, "conflict"), Json{{"precision", "fp32"}});
  const auto result = trainer.fit();
  std::filesystem::remove_all(dir);
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.error->find("the plan's --precision fp32 differs from the run's "
                               "(ScalingConfig::precision bf16"),
            std::string::npos)
      << *result.error;
}

}  // namespace
}  // namespace cohort

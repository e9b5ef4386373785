#include "cohort/train/epoch_loop.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <string>

#include "cohort/cohort.h"
#include "support/run_config.h"
#include "support/small_classifier.h"
#include "support/tiny_mnist.h"

namespace cohort {
namespace {

using testing::kClassifierBatch;
using testing::plan_named;

// The library's loop over the small classifier's 96 rows (6 steps of 8 rows an epoch on each of
// 2 ranks), with the config's loop options.
void train_loop(const Json& c) {
  auto model = testing::classifier_net(plan_named(c["plan"]), /*hidden_layers=*/2);
  auto stream = train::get_dataset_shard("train");
  auto [x, y] = testing::classifier_examples();
  train::run_epochs(model, stream,
                    {.epochs = c.value("epochs", 2),
                     .batch_size = c.value("batch_size", kClassifierBatch),
                     .input_column = "x",
                     .target_column = "y",
                     .max_steps = c.value("max_steps", int64_t{0}),
                     .checkpoint_every_steps = c.value("checkpoint_every_steps", int64_t{0}),
                     .test_set = data::TensorDataset{.inputs = x, .targets = y}});
}

class EpochLoop : public ::testing::Test {
 protected:
  void TearDown() override { std::filesystem::remove_all(dir); }

  Result fit(const std::string& name, const std::string& plan, Json config) {
    config["plan"] = plan;
    Trainer trainer(train_loop, {.num_workers = 2, .mesh = {.pp = plan_named(plan).pp}},
                    testing::quiet_run(dir, name), config,
                    {{"train", testing::classifier_dataset()}});
    return trainer.fit();
  }

  // The run's whole model, one tensor per name.
  std::map<std::string, at::Tensor> model_of(const Result& result) {
    const auto file = dir / "consolidated.safetensors";
    train::consolidate_checkpoint(*result.checkpoint, file);
    return safetensors::read(file);
  }

  std::filesystem::path dir = cohort::testing::temp_dir("epoch_loop");
};

// Stopped by max_steps inside its second epoch and run again without the limit, the loop takes
// exactly the batches it had not trained on: it ends after as many steps as an uninterrupted run,
// with its parameters bit for bit. The checkpoints every N steps inside an epoch say where they
// are; each epoch's report holds the evaluation and the replicas' agreement. Run again with the
// same limit, it trains nothing.
TEST_F(EpochLoop, StoppedInsideAnEpochByMaxStepsResumesExactly) {
  for (const std::string plan : {"ddp", "zero3", "pipeline"}) {
    SCOPED_TRACE(plan);
    const auto whole = fit(plan + "-whole", plan, Json::object());
    ASSERT_TRUE(whole.ok()) << *whole.error;
    // A pipeline's one replica takes each step's 8 rows: 12 steps an epoch, else 6.
    const int64_t epoch_steps = plan == "pipeline" ? 12 : 6;
    EXPECT_EQ(whole.metrics["steps"], 2 * epoch_steps);
    EXPECT_EQ(whole.metrics["epochs"], 2);
    EXPECT_FALSE(whole.metrics.contains(train::kEpochStepMetric)) << whole.metrics.dump();
    EXPECT_EQ(whole.metrics["replica_spread"], 0.0);
    EXPECT_EQ(whole.metrics["world_size"], 2);
    ASSERT_TRUE(whole.metrics.contains("test_accuracy")) << whole.metrics.dump();
    EXPECT_GT(whole.metrics["test_loss"].get<double>(), 0.0);

    const int64_t stop_at = epoch_steps + 3;
    const auto stopped =
        fit(plan + "-stopped", plan, {{"max_steps", stop_at}, {"checkpoint_every_steps", 4}});
    ASSERT_TRUE(stopped.ok()) << *stopped.error;
    EXPECT_EQ(stopped.metrics["steps"], stop_at);
    EXPECT_EQ(stopped.metrics["epoch"], 2);
    EXPECT_EQ(stopped.metrics[train::kEpochStepMetric], 3);
    // The checkpoints after steps 4 and 8 inside an epoch (not after a pipeline's step 12, its
    // first epoch's end, which has one anyway), then the epoch's end and the stop.
    std::vector<int64_t> inside;
    for (const auto& report : stopped.metrics_history) {
      if (report.value(train::kEpochStepMetric, int64_t{0}) > 0 && !report.contains("test_loss"))
        inside.push_back(report["steps"]);
    }
    EXPECT_EQ(inside, (std::vector<int64_t>{4, 8}));
    // Run again with the same limit, it has nothing to train: no step, no new checkpoint.
    const auto again = fit(plan + "-stopped", plan, {{"max_steps", stop_at}});
    ASSERT_TRUE(again.ok()) << *again.error;
    EXPECT_EQ(again.metrics["steps"], stop_at);
    ASSERT_TRUE(again.checkpoint && stopped.checkpoint);
    EXPECT_EQ(again.checkpoint->path(), stopped.checkpoint->path());

    const auto resumed = fit(plan + "-stopped", plan, Json::object());
    ASSERT_TRUE(resumed.ok()) << *resumed.error;
    EXPECT_EQ(resumed.metrics["steps"], 2 * epoch_steps);
    const auto expected = model_of(whole);
    const auto actual = model_of(resumed);
    ASSERT_EQ(actual.size(), expected.size());
    for (const auto& [name, tensor] : expected)
      EXPECT_TRUE(torch::equal(actual.at(name), tensor)) << name;
    EXPECT_EQ(resumed.metrics["test_loss"], whole.metrics["test_loss"]);
  }
}

// Bad loop options are refused naming the field and the fix, before any step.
TEST_F(EpochLoop, BadOptionsAreNamed) {
  const std::vector<std::pair<Json, std::string>> cases{
      {{{"epochs", 0}}, "EpochLoopOptions::epochs 0 must be >= 1"},
      {{{"batch_size", 0}}, "EpochLoopOptions::batch_size 0 must be >= 1"},
      {{{"max_steps", -1}}, "EpochLoopOptions::max_steps -1 must be >= 0"},
      {{{"checkpoint_every_steps", -2}},
       "EpochLoopOptions::checkpoint_every_steps -2 must be >= 0"},
  };
  for (const auto& [config, message] : cases) {
    const auto result = fit("bad", "ddp", config);
    ASSERT_FALSE(result.ok()) << config.dump();
    EXPECT_NE(result.error->find(message), std::string::npos) << *result.error;
    EXPECT_EQ(result.metrics_history.size(), 0u) << config.dump();
  }
}

}  // namespace
}  // namespace cohort

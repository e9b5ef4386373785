// An optimizer as options (optim::OptimizerOptions): the algorithm's defaults where none is given,
// the same options through a config's JSON, and make_optimizer building what they say (a flat
// optimizer or libtorch's) or naming what is wrong.
#include "cohort/optim/optimizer_options.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "cohort/error.h"
#include "cohort/optim/flat_optimizer.h"
#include "support/expect.h"

namespace cohort::optim {
namespace {

TEST(OptimizerOptions, DefaultsAreTheAlgorithms) {
  const OptimizerOptions sgd, adam{.algorithm = "adam"}, adamw{.algorithm = "adamw"};
  const OptimizerOptions no_decay{.algorithm = "adamw", .weight_decay = 0.0};
  const OptimizerOptions no_momentum{.momentum = 0};
  EXPECT_DOUBLE_EQ(sgd.learning_rate(), 0.02);
  EXPECT_DOUBLE_EQ(adam.learning_rate(), 1e-3);
  EXPECT_DOUBLE_EQ(adamw.weight_decay_or_default(), 0.01);
  EXPECT_DOUBLE_EQ(no_decay.weight_decay_or_default(), 0.0);
  EXPECT_EQ(no_momentum.state_buffers(), 0);
  EXPECT_EQ(adam.state_buffers(), 2);
}

TEST(OptimizerOptions, TheSameOptionsComeBackFromJson) {
  const OptimizerOptions written{
      .algorithm = "adamw", .betas = std::make_pair(0.8, 0.99), .eps = 1e-7, .flat = false};
  const Json json = written;
  EXPECT_EQ(json["optimizer"], "adamw");
  EXPECT_DOUBLE_EQ(json["lr"].get<double>(), 1e-3) << "the learning rate used";
  const auto read = json.get<OptimizerOptions>();
  EXPECT_EQ(read.algorithm, "adamw");
  EXPECT_DOUBLE_EQ(read.learning_rate(), 1e-3);
  EXPECT_DOUBLE_EQ(read.weight_decay_or_default(), 0.01);
  EXPECT_EQ(read.betas, written.betas);
  EXPECT_EQ(read.eps, written.eps);
  EXPECT_FALSE(read.flat);
  // A Tune trial's keys are the same flat keys.
  const auto trial =
      Json{{"optimizer", "sgd"}, {"lr", 0.1}, {"momentum", 0.5}}.get<OptimizerOptions>();
  EXPECT_DOUBLE_EQ(trial.learning_rate(), 0.1);
  EXPECT_DOUBLE_EQ(trial.momentum, 0.5);
  cohort::testing::expect_error<UsageError>(
      [] {
        Json{{"betas", {0.9}}}.get<OptimizerOptions>();
      },
      "field 'betas' is [0.9], not two numbers");
  cohort::testing::expect_error<UsageError>(
      [] {
        Json{{"lr", "fast"}}.get<OptimizerOptions>();
      },
      "field 'lr' is string");
}

TEST(OptimizerOptions, MakeOptimizerBuildsWhatTheOptionsSay) {
  const auto w = torch::zeros({4}, torch::requires_grad());
  const auto adamw = make_optimizer({.algorithm = "adamw", .lr = 0.5}, {w});
  ASSERT_NE(dynamic_cast<FlatAdamW*>(adamw.get()), nullptr);
  const auto& options =
      static_cast<const torch::optim::AdamWOptions&>(adamw->param_groups()[0].options());
  EXPECT_DOUBLE_EQ(options.lr(), 0.5);
  EXPECT_DOUBLE_EQ(options.weight_decay(), 0.01);
  const auto sgd = make_optimizer({.nesterov = true, .flat = false}, {w});
  ASSERT_NE(dynamic_cast<torch::optim::SGD*>(sgd.get()), nullptr);
  EXPECT_TRUE(
      static_cast<const torch::optim::SGDOptions&>(sgd->param_groups()[0].options()).nesterov());
  const std::vector<std::pair<OptimizerOptions, std::string>> bad = {
      {{.algorithm = "rmsprop"}, "unknown optimizer 'rmsprop' (--optimizer"},
      {{.lr = -1}, "the learning rate (--lr) -1 is negative"},
      {{.eps = 1e-8}, "betas and eps are Adam's and AdamW's hyperparameters: sgd has none"},
      {{.algorithm = "adam", .nesterov = true}, "Nesterov momentum is SGD's: adam has none"},
      {{.momentum = 0, .nesterov = true}, "SGD nesterov needs a momentum > 0"},
      {{.algorithm = "adam", .betas = std::make_pair(1.0, 0.9)}, "Adam beta1 1 must be in [0, 1)"},
  };
  for (const auto& [o, fragment] : bad)
    cohort::testing::expect_error<UsageError>([&] { make_optimizer(o, {w}); }, fragment);
}

}  // namespace
}  // namespace cohort::optim

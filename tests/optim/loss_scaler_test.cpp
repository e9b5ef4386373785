#include "cohort/optim/loss_scaler.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>

#include "cohort/error.h"
#include "cohort/optim/flat_optimizer.h"
#include "support/expect.h"
#include "support/local_group.h"

namespace cohort {
namespace {

// One step of a one-parameter model whose gradient is `gradient` times the scale.
bool scaled_step(optim::LossScaler& scaler, torch::optim::Optimizer& optimizer, torch::Tensor& w,
                 float gradient) {
  optimizer.zero_grad();
  scaler.scale((w * gradient).sum()).backward();
  const bool stepped = scaler.step(optimizer);
  scaler.update();
  return stepped;
}

TEST(LossScaler, UnscalesGradientsBeforeTheStep) {
  auto w = torch::zeros({3}, torch::requires_grad());
  torch::optim::SGD optimizer({w}, torch::optim::SGDOptions(1.0));
  optim::LossScaler scaler({.initial_scale = 1024});
  EXPECT_TRUE(scaled_step(scaler, optimizer, w, 0.5f));
  EXPECT_TRUE(torch::allclose(w, torch::full({3}, -0.5)));
  EXPECT_EQ(scaler.get_scale(), 1024);
}

TEST(LossScaler, AnOverflowSkipsTheStepAndTheScaleHalvesAfterHysteresis) {
  auto w = torch::zeros({3}, torch::requires_grad());
  optim::FlatSGD optimizer({w}, torch::optim::SGDOptions(1.0));
  optim::LossScaler scaler({.initial_scale = 256, .hysteresis = 2, .min_scale = 64});
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_FALSE(scaled_step(scaler, optimizer, w, inf));
  EXPECT_TRUE(torch::equal(w, torch::zeros({3}))) << "an overflowing step must not move anything";
  EXPECT_EQ(scaler.get_scale(), 256) << "the first overflow only uses up hysteresis";
  EXPECT_FALSE(scaled_step(scaler, optimizer, w, std::nanf("")));
  EXPECT_EQ(scaler.get_scale(), 128);
  EXPECT_FALSE(scaled_step(scaler, optimizer, w, inf));
  EXPECT_EQ(scaler.get_scale(), 64);
  EXPECT_FALSE(scaled_step(scaler, optimizer, w, inf));
  EXPECT_EQ(scaler.get_scale(), 64) << "never below min_scale";
  EXPECT_EQ(scaler.skipped_steps(), 4);
  // The skipped steps' gradients did not leak into this one.
  EXPECT_TRUE(scaled_step(scaler, optimizer, w, 1.0f));
  EXPECT_TRUE(torch::allclose(w, torch::full({3}, -1.0)));
}

TEST(LossScaler, AfterASkippedStepTheFlatOptimizerStepsWithTheNewGradients) {
  // DDP's way: .grad is an alias into a bucket that the next backward refills in place.
  auto w = torch::zeros({3}, torch::requires_grad());
  auto bucket = torch::zeros({8});
  auto alias = torch::empty({0});
  alias.set_(bucket.storage(), 0, {3}, {1});
  w.mutable_grad() = alias;
  optim::FlatSGD optimizer({w}, torch::optim::SGDOptions(1.0));
  optim::LossScaler scaler({.initial_scale = 4});
  torch::NoGradGuard no_grad;
  bucket.fill_(std::numeric_limits<float>::infinity());
  EXPECT_FALSE(scaler.step(optimizer));
  scaler.update();
  // The next backward: DDP points .grad at its bucket again (libtorch 2.x's zero_grad() left it
  // undefined) and fills it with the scaled gradient, 1 after unscaling by 4.
  if (!w.grad().defined()) w.mutable_grad() = alias;
  bucket.fill_(4.0f);
  EXPECT_TRUE(scaler.step(optimizer));
  scaler.update();
  EXPECT_TRUE(torch::allclose(w, torch::full({3}, -1.0))) << w;
}

TEST(LossScaler, TheScaleGrowsAfterGrowthIntervalCleanSteps) {
  auto w = torch::zeros({1}, torch::requires_grad());
  torch::optim::SGD optimizer({w}, torch::optim::SGDOptions(0.0));
  optim::LossScaler scaler({.initial_scale = 8, .growth_interval = 3, .growth_factor = 2});
  for (int i = 0; i < 2; ++i) scaled_step(scaler, optimizer, w, 1.0f);
  EXPECT_EQ(scaler.get_scale(), 8);
  scaled_step(scaler, optimizer, w, 1.0f);
  EXPECT_EQ(scaler.get_scale(), 16);
  // An overflow restarts the count.
  scaled_step(scaler, optimizer, w, std::numeric_limits<float>::infinity());
  for (int i = 0; i < 2; ++i) scaled_step(scaler, optimizer, w, 1.0f);
  EXPECT_EQ(scaler.get_scale(), 16);
  scaled_step(scaler, optimizer, w, 1.0f);
  EXPECT_EQ(scaler.get_scale(), 32);
  // The state round-trips (a checkpoint).
  optim::LossScaler restored({.initial_scale = 8, .growth_interval = 3});
  const auto state = scaler.state_dict();
  EXPECT_TRUE(state.tensors.empty());
  restored.load_state_dict(state);
  EXPECT_EQ(restored.get_scale(), 32);
  EXPECT_EQ(restored.skipped_steps(), 1);
  // Another part's values, or an altered scale, are refused before anything changes.
  testing::expect_error<UsageError>(
      [&] {
        restored.check_state(Json{{"steps", 3}});
      },
      "loss scaler state is malformed");
  auto altered = state;
  altered.values["scale"] = 0;
  testing::expect_error<UsageError>([&] { restored.load_state_dict(altered); },
                                    "loss scaler state has scale 0");
  EXPECT_EQ(restored.get_scale(), 32);
}

TEST(LossScaler, AnOverflowOnOneRankSkipsTheStepOnEveryRank) {
  testing::run_ranks(2, [](comm::ProcessGroup& group) {
    auto w = torch::zeros({4}, torch::requires_grad());
    torch::optim::SGD optimizer({w}, torch::optim::SGDOptions(1.0));
    optim::LossScaler scaler({.initial_scale = 16, .hysteresis = 1}, group);
    // No DDP here: only rank 1's own gradient overflows.
    const float gradient = group.rank() == 1 ? std::numeric_limits<float>::infinity() : 1.0f;
    EXPECT_FALSE(scaled_step(scaler, optimizer, w, gradient)) << "rank " << group.rank();
    EXPECT_TRUE(torch::equal(w, torch::zeros({4}))) << "rank " << group.rank();
    EXPECT_EQ(scaler.get_scale(), 8) << "rank " << group.rank();
    EXPECT_TRUE(scaled_step(scaler, optimizer, w, 1.0f)) << "rank " << group.rank();
  });
}

TEST(LossScaler, ADisabledScalerPassesThrough) {
  auto w = torch::zeros({1}, torch::requires_grad());
  torch::optim::SGD optimizer({w}, torch::optim::SGDOptions(1.0));
  optim::LossScaler scaler({}, std::nullopt, /*enabled=*/false);
  const auto loss = (w + 2).sum();
  EXPECT_TRUE(scaler.scale(loss).is_same(loss));
  EXPECT_TRUE(scaled_step(scaler, optimizer, w, 3.0f));
  EXPECT_TRUE(torch::allclose(w, torch::full({1}, -3.0)));
}

TEST(LossScaler, OptionsOutOfRangeAreNamed) {
  using testing::expect_error;
  expect_error<UsageError>([] { optim::LossScaler({.initial_scale = 0}); }, "initial_scale 0");
  expect_error<UsageError>([] { optim::LossScaler({.growth_interval = 0}); }, "growth_interval 0");
  expect_error<UsageError>([] { optim::LossScaler({.growth_factor = 1}); }, "growth_factor 1");
  expect_error<UsageError>([] { optim::LossScaler({.backoff_factor = 1.5}); },
                           "backoff_factor 1.5");
  expect_error<UsageError>([] { optim::LossScaler({.hysteresis = 0}); }, "hysteresis 0");
  expect_error<UsageError>([] { optim::LossScaler({.min_scale = -1}); }, "min_scale -1");
  expect_error<UsageError>([] { optim::LossScaler({.initial_scale = 4, .min_scale = 8}); },
                           "must not exceed initial_scale 4");
}

}  // namespace
}  // namespace cohort

// A rank's random generators as a checkpoint's part: the same rank of the same world size draws
// on where the saved run stood; another world size restores nothing, and says so.
#include "cohort/optim/random_state.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <mutex>

#include "cohort/error.h"
#include "support/expect.h"
#include "support/local_group.h"

namespace cohort {
namespace {

// What loading a checkpoint does with `saved`: the pieces `part` asks for, filled from the saved
// ones of the same names (the files hold exactly these: one rank wrote them).
optim::StateDict filled_from(const optim::RandomState& part, const optim::StateDict& saved) {
  auto wanted = part.state_to_load(saved.values);
  for (auto& [name, piece] : wanted.tensors) piece.values.copy_(saved.tensors.at(name).values);
  return wanted;
}

TEST(RandomState, TheSameRankDrawsOnWhereTheSavedRunStood) {
  std::lock_guard lock(testing::generator_mutex());
  torch::manual_seed(11);
  optim::RandomState part(1, 2);
  torch::rand({3});
  const auto saved = part.state_dict();
  ASSERT_EQ(saved.shard, 1);
  ASSERT_EQ(saved.shards, 2);
  const auto& cpu = saved.tensors.at("cpu");
  EXPECT_EQ(cpu.offset, cpu.values.numel());
  EXPECT_EQ(cpu.numel, 2 * cpu.values.numel());
  EXPECT_EQ(saved.values["cuda_bytes"], 0);
  const auto expected = torch::rand({5});
  // Another seed in between, as a resumed run's model initialisation.
  torch::manual_seed(12);
  part.load_state_dict(filled_from(part, saved));
  EXPECT_TRUE(part.restored());
  EXPECT_TRUE(torch::equal(torch::rand({5}), expected));
}

TEST(RandomState, AnotherWorldSizeRestoresNothingAndSaysSo) {
  std::lock_guard lock(testing::generator_mutex());
  torch::manual_seed(11);
  const auto saved = optim::RandomState(0, 2).state_dict();
  torch::manual_seed(12);
  const auto expected = torch::rand({5});
  torch::manual_seed(12);
  optim::RandomState three(0, 3);
  const auto wanted = three.state_to_load(saved.values);
  EXPECT_TRUE(wanted.tensors.empty());
  three.load_state_dict(wanted);
  EXPECT_FALSE(three.restored());
  EXPECT_TRUE(torch::equal(torch::rand({5}), expected));
}

TEST(RandomState, AlteredValuesAndBadRanksAreRefused) {
  using testing::expect_error;
  const optim::RandomState part(0, 1);
  expect_error<UsageError>(
      [&] {
        part.check_state(Json{{"world_size", 2}});
      },
      "the random generators' state is malformed");
  expect_error<UsageError>(
      [&] {
        part.check_state(Json{{"world_size", 0}, {"cpu_bytes", 8}, {"cuda_bytes", 0}});
      },
      "says world size 0, 8 CPU and 0 CUDA bytes per rank: the checkpoint was altered");
  expect_error<UsageError>([] { optim::RandomState(2, 2); },
                           "RandomState: rank 2 of world size 2: a rank is in [0, world size)");
  expect_error<UsageError>([] { optim::RandomState(0, 1, c10::Device(c10::kCPU)); },
                           "cpu is not a CUDA device");
}

}  // namespace
}  // namespace cohort

// ZeRO checkpoints: written as shards by N ranks, loaded by M.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <mutex>
#include <tuple>

#include "cohort/error.h"
#include "cohort/parallel/zero_optimizer.h"
#include "cohort/train/checkpoint.h"
#include "support/expect.h"
#include "support/local_group.h"
#include "support/tiny_mnist.h"

namespace cohort::train {
namespace {

using parallel::ZeroOptimizer;
using parallel::ZeroOptions;

// Sizes that split unevenly over 2, 3, 4 and 5 ranks; two units of ZeRO stage 3.
torch::nn::Sequential make_checkpoint_net() {
  std::lock_guard lock(cohort::testing::generator_mutex());
  torch::manual_seed(21);
  return torch::nn::Sequential(parallel::FullyShard(torch::nn::Linear(7, 23)), torch::nn::ReLU(),
                               parallel::FullyShard(torch::nn::Linear(23, 3)));
}

// The global batch of step s: 60 examples, split evenly over 1 to 5 ranks.
std::pair<torch::Tensor, torch::Tensor> global_batch(int step) {
  std::lock_guard lock(cohort::testing::generator_mutex());
  torch::manual_seed(500 + step);
  return {torch::randn({60, 7}), torch::randint(0, 3, {60})};
}

void train_step(torch::nn::Sequential& net, ZeroOptimizer& zero, int step) {
  const auto& g = zero.process_group();
  auto [x, y] = global_batch(step);
  const int64_t n = 60 / g.world_size();
  zero.zero_grad();
  torch::nn::functional::cross_entropy(net->forward(x.narrow(0, g.rank() * n, n)),
                                       y.narrow(0, g.rank() * n, n))
      .backward();
  zero.step();
}

std::unique_ptr<ZeroOptimizer> make_zero(torch::nn::Sequential& net, comm::ProcessGroup& g,
                                         int stage) {
  torch::optim::AdamW plain(net->parameters(), torch::optim::AdamWOptions(0.01));
  return std::make_unique<ZeroOptimizer>(
      net.ptr(), plain, g,
      ZeroOptions{.stage = stage, .reduce_bucket_size = 40, .param_persistence_threshold = 0});
}

// Rank 0's parameters (every rank takes part: stage 3 gathers them).
void copy_parameters(torch::nn::Sequential& net, const ZeroOptimizer& zero,
                     std::vector<torch::Tensor>& out) {
  ZeroOptimizer::GatheredParameters whole(zero);
  if (zero.process_group().rank() == 0)
    for (const auto& p : net->parameters()) out.push_back(p.detach().clone());
}

using cohort::testing::run_ranks;

// N ranks train two steps and save; the parameters after one more step taken at M ranks from
// the checkpoint (at another stage too).
std::vector<torch::Tensor> resume_at(const std::filesystem::path& dir, int world, int stage) {
  std::vector<torch::Tensor> result;
  run_ranks(world, [&](comm::ProcessGroup& g) {
    auto net = make_checkpoint_net();
    auto zero = make_zero(net, g, stage);
    load_checkpoint(Checkpoint::from_directory(dir), *net, *zero);
    train_step(net, *zero, 2);
    copy_parameters(net, *zero, result);  // rank 0 writes it
  });
  return result;
}

TEST(ZeroCheckpoint, WrittenByNRanksReloadsOnMRanksAsOneUninterruptedStep) {
  const auto root = cohort::testing::temp_dir("zero_checkpoint");
  for (const auto& [n, m, written_at] : std::vector<std::tuple<int, int, int>>{
           {2, 4, 2}, {4, 2, 2}, {3, 5, 2}, {2, 4, 3}, {3, 5, 3}}) {
    const auto dir = root / ("from" + std::to_string(n) + "_stage" + std::to_string(written_at));
    std::vector<torch::Tensor> straight;
    run_ranks(n, [&](comm::ProcessGroup& g) {
      auto net = make_checkpoint_net();
      auto zero = make_zero(net, g, written_at);
      train_step(net, *zero, 0);
      train_step(net, *zero, 1);
      save_checkpoint(dir, *net, *zero);
      g.barrier();
      train_step(net, *zero, 2);
      copy_parameters(net, *zero, straight);
    });
    EXPECT_TRUE(std::filesystem::exists(dir / "zero_manifest.json"));
    EXPECT_TRUE(std::filesystem::exists(
        dir / ("zero-rank" + std::to_string(n - 1) + "-of-" + std::to_string(n) + ".safetensors")));
    // At M ranks (stages 1 and 3), and on one rank (the whole state in one shard): the same
    // step.
    for (const auto& [world, stage] : std::vector<std::pair<int, int>>{{m, 1}, {m, 3}, {1, 2}}) {
      const auto resumed = resume_at(dir, world, stage);
      ASSERT_EQ(resumed.size(), straight.size());
      for (size_t i = 0; i < straight.size(); ++i) {
        EXPECT_TRUE(torch::allclose(resumed[i], straight[i], 1e-5, 1e-6))
            << n << " ranks at stage " << written_at << " -> " << world << " at stage " << stage
            << ": parameter " << i << " differs by "
            << (resumed[i] - straight[i]).abs().max().item<double>();
      }
    }
  }
  std::filesystem::remove_all(root);
}

TEST(ZeroCheckpoint, AMissingOrAlteredShardOrAnotherOptimizerIsNamed) {
  using cohort::testing::expect_error;
  const auto dir = cohort::testing::temp_dir("zero_checkpoint_bad");
  run_ranks(2, [&](comm::ProcessGroup& g) {
    auto net = make_checkpoint_net();
    auto zero = make_zero(net, g, 2);
    train_step(net, *zero, 0);
    save_checkpoint(dir, *net, *zero);
  });
  auto load_at_one = [&](const std::string& fragment) {
    run_ranks(1, [&](comm::ProcessGroup& g) {
      auto net = make_checkpoint_net();
      auto zero = make_zero(net, g, 2);
      expect_error<UsageError>(
          [&] { load_checkpoint(Checkpoint::from_directory(dir), *net, *zero); }, fragment);
    });
  };
  // A shard with one piece removed no longer covers the state.
  const auto shard = dir / "zero-rank1-of-2.safetensors";
  auto tensors = safetensors::read(shard);
  tensors.erase(tensors.begin());
  safetensors::write(shard, tensors);
  load_at_one("a shard file is missing or altered, or the model differs");
  std::filesystem::remove(shard);
  load_at_one("the shard file zero-rank1-of-2.safetensors named by zero_manifest.json is missing");
  // Into a DDP optimizer, and a DDP checkpoint into ZeRO.
  auto net = make_checkpoint_net();
  torch::optim::AdamW plain(net->parameters(), torch::optim::AdamWOptions(0.01));
  expect_error<UsageError>([&] { load_checkpoint(Checkpoint::from_directory(dir), *net, plain); },
                           "holds ZeRO optimizer shards");
  const auto ddp_dir = dir / "ddp";
  save_checkpoint(ddp_dir, *net, plain);
  run_ranks(1, [&](comm::ProcessGroup& g) {
    auto other = make_checkpoint_net();
    auto zero = make_zero(other, g, 1);
    expect_error<UsageError>(
        [&] { load_checkpoint(Checkpoint::from_directory(ddp_dir), *other, *zero); },
        "was written without ZeRO");
  });
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace cohort::train

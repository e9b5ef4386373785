// Local SGD and DiLoCo checkpoints: each rank's own state, the global parameters and the outer
// momentum; reloaded by as many ranks exactly, by another number from the global parameters.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <mutex>

#include "cohort/error.h"
#include "cohort/parallel/local_sgd.h"
#include "cohort/parallel/zero_optimizer.h"
#include "cohort/train/checkpoint.h"
#include "support/expect.h"
#include "support/local_group.h"
#include "support/tiny_mnist.h"

namespace cohort::train {
namespace {

using parallel::DiLoCo;
using parallel::LocalSgdOptimizer;

torch::nn::Sequential make_local_sgd_net() {
  std::lock_guard lock(cohort::testing::generator_mutex());
  torch::manual_seed(8);
  return torch::nn::Sequential(torch::nn::Linear(6, 10), torch::nn::ReLU(),
                               torch::nn::Linear(10, 3));
}

const DiLoCo kMode{.inner_steps = 3, .outer_lr = 0.7, .outer_momentum = 0.9, .nesterov = true};

std::unique_ptr<LocalSgdOptimizer> make_optimizer(torch::nn::Sequential& net,
                                                  comm::ProcessGroup& g) {
  return std::make_unique<LocalSgdOptimizer>(
      net.ptr(),
      std::make_unique<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(0.01)), g,
      kMode);
}

void train_step(torch::nn::Sequential& net, torch::optim::Optimizer& optimizer, int rank,
                int step) {
  torch::Tensor x, y;
  {
    std::lock_guard lock(cohort::testing::generator_mutex());
    torch::manual_seed(700 + 10 * rank + step);
    x = torch::randn({5, 6});
    y = torch::randint(0, 3, {5});
  }
  optimizer.zero_grad();
  torch::nn::functional::cross_entropy(net->forward(x), y).backward();
  optimizer.step();
}

std::vector<torch::Tensor> parameters_of(torch::nn::Sequential& net) {
  std::vector<torch::Tensor> out;
  for (const auto& p : net->parameters()) out.push_back(p.detach().clone());
  return out;
}

using cohort::testing::run_ranks;

// The first format of a local SGD checkpoint, as cohort 0.1.0 wrote it: every rank its module
// and inner optimizer's archive, rank 0 the global parameters, the outer momentum and
// local_sgd.json.
void write_first_format(const std::filesystem::path& dir, torch::nn::Sequential& net,
                        const LocalSgdOptimizer& optimizer) {
  const int rank = optimizer.process_group().rank();
  const int world = optimizer.process_group().world_size();
  const std::string of = "-rank" + std::to_string(rank) + "-of-" + std::to_string(world);
  std::filesystem::create_directories(dir);
  save_model(*net, dir / ("local" + of + ".safetensors"));
  save_optimizer(optimizer, dir / ("optimizer" + of + ".pt"));
  if (rank != 0) return;
  safetensors::write(dir / "model.safetensors", optimizer.global_state(), {{"format", "pt"}});
  safetensors::write(dir / "outer_momentum.safetensors", optimizer.outer_momentum());
  std::ofstream(dir / "local_sgd.json") << Json{
      {"format", "cohort.local_sgd.v1"},
      {"world_size", world},
      {"sync", parallel::to_string(optimizer.mode())},
      {"steps_since_sync", optimizer.steps_since_sync()},
      {"inner_steps", optimizer.stats().inner_steps},
      {"outer_steps",
       optimizer.stats().outer_steps}}.dump(2);
}

// Two ranks: 4 steps (one synchronisation, then one step into the next period), a checkpoint
// (or the first format's files), 4 more steps. Returns each rank's parameters at the end.
std::vector<std::vector<torch::Tensor>> straight_run(const std::filesystem::path& dir,
                                                     bool first_format = false) {
  std::vector<std::vector<torch::Tensor>> result(2);
  run_ranks(2, [&](comm::ProcessGroup& g) {
    auto net = make_local_sgd_net();
    auto optimizer = make_optimizer(net, g);
    for (int s = 0; s < 4; ++s) train_step(net, *optimizer, g.rank(), s);
    EXPECT_EQ(optimizer->steps_since_sync(), 1);
    if (first_format) {
      write_first_format(dir, net, *optimizer);
    } else {
      save_checkpoint(dir, *net, *optimizer);
    }
    g.barrier();  // every rank's files are there before anyone goes on
    for (int s = 4; s < 8; ++s) train_step(net, *optimizer, g.rank(), s);
    result[static_cast<size_t>(g.rank())] = parameters_of(net);
  });
  return result;
}

// Every rank's replica is its piece of the part local_sgd; reloaded by two ranks, each goes on
// as if never stopped.
void expect_exact_continuation(const std::filesystem::path& dir,
                               const std::vector<std::vector<torch::Tensor>>& straight) {
  run_ranks(2, [&](comm::ProcessGroup& g) {
    auto net = make_local_sgd_net();
    auto optimizer = make_optimizer(net, g);
    load_checkpoint(Checkpoint::from_directory(dir), *net, *optimizer);
    EXPECT_EQ(optimizer->steps_since_sync(), 1);
    EXPECT_EQ(optimizer->stats().outer_steps, 1);
    for (int s = 4; s < 8; ++s) train_step(net, *optimizer, g.rank(), s);
    const auto resumed = parameters_of(net);
    const auto& expected = straight[static_cast<size_t>(g.rank())];
    for (size_t i = 0; i < resumed.size(); ++i)
      EXPECT_TRUE(torch::equal(resumed[i], expected[i])) << "rank " << g.rank() << " param " << i;
  });
}

// Loaded by three ranks: each starts a new period from the global parameters (model.safetensors)
// with an inner state, and after H steps the three replicas agree again.
void expect_new_period_at_three_ranks(const std::filesystem::path& dir) {
  const auto global = safetensors::read(dir / "model.safetensors");
  run_ranks(3, [&](comm::ProcessGroup& g) {
    auto net = make_local_sgd_net();
    auto optimizer = make_optimizer(net, g);
    load_checkpoint(Checkpoint::from_directory(dir), *net, *optimizer);
    EXPECT_EQ(optimizer->steps_since_sync(), 0);
    EXPECT_EQ(optimizer->inner().state().size(), net->parameters().size());
    for (const auto& p : net->named_parameters())
      EXPECT_TRUE(torch::equal(p.value(), global.at(p.key()))) << p.key();
    for (int s = 0; s < kMode.inner_steps; ++s) train_step(net, *optimizer, g.rank(), s);
    const auto all = g.allgather(net->parameters()[0].detach().clone());
    EXPECT_TRUE(torch::equal(all[0], all[1]) && torch::equal(all[0], all[2]));
  });
}

TEST(LocalSgdCheckpoint, ReloadedByAsManyRanksEveryRankContinuesExactly) {
  const auto dir = cohort::testing::temp_dir("local_sgd_checkpoint");
  const auto straight = straight_run(dir);
  EXPECT_TRUE(std::filesystem::exists(dir / "local_sgd-rank1-of-2.safetensors"));
  const Json manifest = Json::parse(std::ifstream(dir / "local_sgd_manifest.json"));
  EXPECT_EQ(manifest["values"]["world_size"], 2);
  EXPECT_EQ(manifest["values"]["momentum"], true) << "DiLoCo's outer momentum";
  EXPECT_EQ(manifest["values"]["algorithm"], "adamw");
  expect_exact_continuation(dir, straight);
  // The replicas are the state: the optimizer's part alone neither saves nor loads them.
  run_ranks(1, [&](comm::ProcessGroup& g) {
    auto net = make_local_sgd_net();
    auto optimizer = make_optimizer(net, g);
    cohort::testing::expect_error<UsageError>(
        [&] { save_optimizer_state(dir / "alone", *optimizer, *net); },
        "save_optimizer_state: local SGD and DiLoCo keep their optimizer state with their "
        "parameters: use save_checkpoint");
    // An inner optimizer whose state has no names here trains, and saving says why it cannot.
    LocalSgdOptimizer rmsprop(net.ptr(), std::make_unique<torch::optim::RMSprop>(net->parameters()),
                              g, kMode);
    cohort::testing::expect_error<UsageError>(
        [&] { save_checkpoint(dir / "rmsprop", *net, rmsprop); },
        "a checkpoint keeps the inner optimizer's state by parameter name, for SGD, Adam or AdamW");
    cohort::testing::expect_error<UsageError>([&] { load_optimizer_state(dir, *optimizer, *net); },
                                              "holds local SGD's replicas with their parameters: "
                                              "use load_checkpoint");
  });
  std::filesystem::remove_all(dir);
}

// The first format still loads: exactly at as many ranks, a new period at another number, and
// into a synchronous run.
TEST(LocalSgdCheckpoint, TheFirstFormatStillLoads) {
  const auto dir = cohort::testing::temp_dir("local_sgd_first_format");
  const auto straight = straight_run(dir, /*first_format=*/true);
  ASSERT_TRUE(std::filesystem::exists(dir / "local_sgd.json"));
  expect_exact_continuation(dir, straight);
  expect_new_period_at_three_ranks(dir);
  run_ranks(1, [&](comm::ProcessGroup&) {
    auto net = make_local_sgd_net();
    torch::optim::AdamW adamw(net->parameters(), torch::optim::AdamWOptions(0.01));
    load_checkpoint(Checkpoint::from_directory(dir), *net, adamw);
    EXPECT_EQ(adamw.state().size(), net->parameters().size());
  });
  // A rank's missing file is named.
  std::filesystem::remove(dir / "local-rank1-of-2.safetensors");
  run_ranks(2, [&](comm::ProcessGroup& g) {
    auto net = make_local_sgd_net();
    auto optimizer = make_optimizer(net, g);
    if (g.rank() == 1) {
      cohort::testing::expect_error<UsageError>(
          [&] { load_checkpoint(Checkpoint::from_directory(dir), *net, *optimizer); },
          "lacks local-rank1-of-2.safetensors, which its local_sgd.json lists");
    }
  });
  std::filesystem::remove_all(dir);
}

TEST(LocalSgdCheckpoint, ReloadedByAnotherNumberEveryRankStartsFromTheGlobalParameters) {
  const auto dir = cohort::testing::temp_dir("local_sgd_checkpoint_elastic");
  straight_run(dir);
  expect_new_period_at_three_ranks(dir);
  const auto global = safetensors::read(dir / "model.safetensors");
  // Synchronous training picks up the global parameters and a rank's inner state.
  run_ranks(1, [&](comm::ProcessGroup&) {
    auto net = make_local_sgd_net();
    torch::optim::AdamW adamw(net->parameters(), torch::optim::AdamWOptions(0.01));
    load_checkpoint(Checkpoint::from_directory(dir), *net, adamw);
    EXPECT_EQ(adamw.state().size(), net->parameters().size());
    for (const auto& p : net->named_parameters())
      EXPECT_TRUE(torch::equal(p.value(), global.at(p.key()))) << p.key();
  });
  // A missing rank file is named, on every rank.
  std::filesystem::remove(dir / "local_sgd-rank1-of-2.safetensors");
  run_ranks(2, [&](comm::ProcessGroup& g) {
    auto net = make_local_sgd_net();
    auto optimizer = make_optimizer(net, g);
    cohort::testing::expect_error<UsageError>(
        [&] { load_checkpoint(Checkpoint::from_directory(dir), *net, *optimizer); },
        "local_sgd-rank1-of-2.safetensors named by local_sgd_manifest.json is missing");
  });
  std::filesystem::remove_all(dir);
}

// A checkpoint of synchronous training starts local SGD: its model, its optimizer state.
TEST(LocalSgdCheckpoint, ACheckpointOfSynchronousTrainingStartsAPeriod) {
  const auto dir = cohort::testing::temp_dir("local_sgd_from_ddp");
  run_ranks(1, [&](comm::ProcessGroup& g) {
    auto net = make_local_sgd_net();
    torch::optim::AdamW adamw(net->parameters(), torch::optim::AdamWOptions(0.01));
    train_step(net, adamw, 0, 0);
    save_checkpoint(dir, *net, adamw);
    auto other = make_local_sgd_net();
    auto optimizer = make_optimizer(other, g);
    load_checkpoint(Checkpoint::from_directory(dir), *other, *optimizer);
    EXPECT_EQ(optimizer->inner().state().size(), other->parameters().size());
    const auto expected = parameters_of(net);
    const auto loaded = parameters_of(other);
    for (size_t i = 0; i < expected.size(); ++i) EXPECT_TRUE(torch::equal(loaded[i], expected[i]));
  });
  std::filesystem::remove_all(dir);
}

// A synchronous run's replicas must step alike: every rank takes the same (the first rank's) inner
// state of a local SGD checkpoint, however its ranks' states differ.
TEST(LocalSgdCheckpoint, ASynchronousRunTakesTheFirstRanksInnerStateOnEveryRank) {
  const auto dir = cohort::testing::temp_dir("local_sgd_into_ddp");
  straight_run(dir);
  run_ranks(2, [&](comm::ProcessGroup& g) {
    auto net = make_local_sgd_net();
    torch::optim::AdamW adamw(net->parameters(), torch::optim::AdamWOptions(0.01));
    load_checkpoint(Checkpoint::from_directory(dir), *net, adamw);
    // The same batch on both: with the same state, the same step.
    train_step(net, adamw, 0, 0);
    const auto all = g.allgather(net->parameters()[0].detach().clone());
    EXPECT_TRUE(torch::equal(all[0], all[1]));
  });
  std::filesystem::remove_all(dir);
}

// ZeRO's shards start local SGD too: every rank's inner optimizer takes the whole state, as a
// whole optimizer loading them does.
TEST(LocalSgdCheckpoint, ZeroShardsStartAPeriodWithTheWholeState) {
  const auto dir = cohort::testing::temp_dir("local_sgd_from_zero");
  run_ranks(2, [&](comm::ProcessGroup& g) {
    auto net = make_local_sgd_net();
    torch::optim::AdamW plain(net->parameters(), torch::optim::AdamWOptions(0.01));
    parallel::ZeroOptimizer zero(net.ptr(), plain, g, {.stage = 2, .reduce_bucket_size = 40});
    train_step(net, zero, g.rank(), 0);
    save_checkpoint(dir, *net, zero);
    g.barrier();  // every shard is there before anyone loads
    auto other = make_local_sgd_net();
    auto local = make_optimizer(other, g);
    load_checkpoint(Checkpoint::from_directory(dir), *other, *local);
    auto whole = make_local_sgd_net();
    torch::optim::AdamW adamw(whole->parameters(), torch::optim::AdamWOptions(0.01));
    load_checkpoint(Checkpoint::from_directory(dir), *whole, adamw);
    EXPECT_EQ(local->inner().state().size(), other->parameters().size());
    // One inner step on the same batch: the same as the whole optimizer's.
    train_step(other, local->inner(), 0, 1);
    train_step(whole, adamw, 0, 1);
    const auto got = parameters_of(other), want = parameters_of(whole);
    for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(torch::equal(got[i], want[i])) << i;
  });
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace cohort::train

// ZeRO checkpoints: written as shards by N ranks, loaded by M.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <tuple>

#include "cohort/error.h"
#include "cohort/optim/flat_optimizer.h"
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

// At `stage` on the group: two steps, a checkpoint in `dir`, then the third step, whose
// parameters (rank 0's) go to `straight`: what a run resumed from `dir` must take.
void save_between_steps(const std::filesystem::path& dir, comm::ProcessGroup& g, int stage,
                        std::vector<torch::Tensor>& straight) {
  auto net = make_checkpoint_net();
  auto zero = make_zero(net, g, stage);
  train_step(net, *zero, 0);
  train_step(net, *zero, 1);
  save_checkpoint(dir, *net, *zero);
  g.barrier();
  train_step(net, *zero, 2);
  copy_parameters(net, *zero, straight);
}

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
    run_ranks(n, [&](comm::ProcessGroup& g) { save_between_steps(dir, g, written_at, straight); });
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

// The previous release's ZeRO checkpoints (manifest format cohort.zero.v1: the values at its top,
// the same shard files) still load, as the next step shows.
TEST(ZeroCheckpoint, ThePreviousReleasesShardsStillLoad) {
  const auto dir = cohort::testing::temp_dir("zero_checkpoint_v1");
  std::vector<torch::Tensor> straight;
  run_ranks(2, [&](comm::ProcessGroup& g) { save_between_steps(dir, g, 1, straight); });
  // The manifest as the previous release wrote it.
  const auto manifest_file = dir / "zero_manifest.json";
  const Json manifest = Json::parse(std::ifstream(manifest_file));
  ASSERT_EQ(manifest.at("format"), "cohort.state.v1");
  Json previous{{"format", "cohort.zero.v1"}, {"world_size", 2}};
  previous.update(manifest.at("values"));
  previous["files"] = manifest.at("files");
  std::ofstream(manifest_file) << previous.dump(2);
  const auto resumed = resume_at(dir, 3, 1);
  ASSERT_EQ(resumed.size(), straight.size());
  for (size_t i = 0; i < straight.size(); ++i)
    EXPECT_TRUE(torch::allclose(resumed[i], straight[i], 1e-5, 1e-6)) << "parameter " << i;
  std::filesystem::remove_all(dir);
}

// Stage 3 writes the model one unit at a time: no rank gathers more than the largest unit (the
// 7 x 23 layer, 184 floats), where gathering the whole model would hold both (256). Loading
// gathers nothing: each rank reads its shards' ranges of the file.
TEST(ZeroCheckpoint, StageThreeSavesOneUnitAtATimeAndLoadsEachRanksShardsAlone) {
  const auto dir = cohort::testing::temp_dir("zero_checkpoint_units");
  // Its gathered buffer, padded to split evenly over the ranks.
  auto largest_unit_bytes = [](int64_t world) {
    constexpr int64_t kNumel = 7 * 23 + 23;
    return (kNumel + world - 1) / world * world * 4;
  };
  std::vector<torch::Tensor> saved;
  run_ranks(2, [&](comm::ProcessGroup& g) {
    auto net = make_checkpoint_net();
    auto zero = make_zero(net, g, 3);
    EXPECT_EQ(zero->unit_names(), (std::vector<std::string>{"0", "2"}));
    ASSERT_EQ(zero->stats().gathered_bytes_peak, 0);
    save_checkpoint(dir, *net, *zero);
    EXPECT_EQ(zero->stats().gathered_bytes_peak, largest_unit_bytes(2)) << "rank " << g.rank();
    copy_parameters(net, *zero, saved);
    // A module that names the parameters otherwise (a parent of the model) is saved whole.
    auto parent = std::make_shared<torch::nn::Module>();
    parent->register_module("net", net.ptr());
    save_checkpoint(dir / "parent", *parent, *zero);
  });
  EXPECT_TRUE(torch::equal(
      safetensors::read(dir / "parent" / "model.safetensors").at("net.0.weight"), saved[0]));
  // The file is the whole model, as save_model writes it.
  const auto file = safetensors::read(dir / "model.safetensors");
  ASSERT_EQ(file.size(), 4U);
  EXPECT_TRUE(torch::equal(file.at("0.weight"), saved[0]));
  EXPECT_TRUE(torch::equal(file.at("2.bias"), saved[3]));
  run_ranks(3, [&](comm::ProcessGroup& g) {
    torch::nn::Sequential net = [] {
      std::lock_guard lock(cohort::testing::generator_mutex());
      torch::manual_seed(99);  // other weights than the checkpoint's
      return torch::nn::Sequential(parallel::FullyShard(torch::nn::Linear(7, 23)),
                                   torch::nn::ReLU(),
                                   parallel::FullyShard(torch::nn::Linear(23, 3)));
    }();
    auto zero = make_zero(net, g, 3);
    // Each parameter's pieces over the ranks tile it.
    const auto pieces = zero->parameter_shards();
    ASSERT_EQ(pieces.size(), 4U);
    const auto& bias = pieces.at("0.bias");
    EXPECT_EQ(bias.numel, 23);
    EXPECT_LE(bias.offset + bias.values.numel(), 23);
    int64_t covered = bias.values.numel();
    std::vector<at::Tensor> counts{at::scalar_tensor(covered, at::kLong)};
    g.allreduce(counts);
    EXPECT_EQ(counts[0].item<int64_t>(), 23);
    load_checkpoint(Checkpoint::from_directory(dir), *net, *zero);
    EXPECT_EQ(zero->stats().gathered_bytes_peak, 0) << "rank " << g.rank();
    std::vector<torch::Tensor> loaded;
    copy_parameters(net, *zero, loaded);
    if (g.rank() != 0) return;
    ASSERT_EQ(loaded.size(), saved.size());
    for (size_t i = 0; i < saved.size(); ++i) EXPECT_TRUE(torch::equal(loaded[i], saved[i])) << i;
  });
  // Into a parent of the model (other names than the engine's): gathered whole, the same values.
  run_ranks(2, [&](comm::ProcessGroup& g) {
    auto net = [] {
      std::lock_guard lock(cohort::testing::generator_mutex());
      torch::manual_seed(99);
      return torch::nn::Sequential(parallel::FullyShard(torch::nn::Linear(7, 23)),
                                   torch::nn::ReLU(),
                                   parallel::FullyShard(torch::nn::Linear(23, 3)));
    }();
    auto zero = make_zero(net, g, 3);
    auto parent = std::make_shared<torch::nn::Module>();
    parent->register_module("net", net.ptr());
    load_checkpoint(Checkpoint::from_directory(dir / "parent"), *parent, *zero);
    EXPECT_GT(zero->stats().gathered_bytes_peak, 0) << "rank " << g.rank();
    std::vector<torch::Tensor> loaded;
    copy_parameters(net, *zero, loaded);
    if (g.rank() != 0) return;
    for (size_t i = 0; i < saved.size(); ++i) EXPECT_TRUE(torch::equal(loaded[i], saved[i])) << i;
  });
  // Another model's file is named, on every rank alike, before any gather.
  safetensors::write(dir / "model.safetensors", {{"0.weight", torch::zeros({23, 7})}});
  run_ranks(2, [&](comm::ProcessGroup& g) {
    auto net = make_checkpoint_net();
    auto zero = make_zero(net, g, 3);
    cohort::testing::expect_error<UsageError>(
        [&] { load_checkpoint(Checkpoint::from_directory(dir), *net, *zero); },
        "has no tensor '0.bias': it was saved from a different model");
  });
  std::filesystem::remove_all(dir);
}

// The bytes resident in this process of the mappings that hold `tensors`' data, and their size
// (/proc/self/smaps).
std::pair<int64_t, int64_t> mapped_bytes(const std::vector<torch::Tensor>& tensors) {
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool holds = false;
  int64_t resident = 0, size = 0;
  while (std::getline(smaps, line)) {
    uintptr_t begin = 0, end = 0;
    char dash = 0;
    std::istringstream header(line);
    if (header >> std::hex >> begin >> dash >> end && dash == '-') {
      holds = std::any_of(tensors.begin(), tensors.end(), [&](const torch::Tensor& t) {
        const auto at = reinterpret_cast<uintptr_t>(t.data_ptr());
        return at >= begin && at < end;
      });
      if (holds) size += static_cast<int64_t>(end - begin);
    } else if (holds && line.rfind("Rss:", 0) == 0) {
      resident += std::stoll(line.substr(4)) * 1024;
    }
  }
  return {resident, size};
}

// Optimizer state offloaded to disk passes through memory a piece at a time when a checkpoint
// writes or reads it, ZeRO's and DDP's flat optimizer's: after either, next to none of it is in
// the process's memory (holding it whole would undo the offload: a 1.2 B GPT's workers peaked
// 1.4 GB higher while they saved), and the resumed step is the uninterrupted one's.
TEST(ZeroCheckpoint, StateOnDiskPassesThroughMemoryAPieceAtATime) {
  const auto root = cohort::testing::temp_dir("zero_checkpoint_disk");
  std::filesystem::create_directories(root / "offload");
  const auto make_net = [](int seed) {
    std::lock_guard lock(cohort::testing::generator_mutex());
    torch::manual_seed(seed);
    return torch::nn::Sequential(parallel::FullyShard(torch::nn::Linear(64, 2048)),
                                 torch::nn::ReLU(),
                                 parallel::FullyShard(torch::nn::Linear(2048, 3)));
  };
  const auto make_offloaded = [&](torch::nn::Sequential& net, comm::ProcessGroup& g) {
    auto zero = make_zero(net, g, 3);
    zero->offload_state(root / "offload");
    return zero;
  };
  const auto step = [](torch::nn::Sequential& net, ZeroOptimizer& zero, int s) {
    const auto& g = zero.process_group();
    torch::Tensor x, y;
    {
      std::lock_guard lock(cohort::testing::generator_mutex());
      torch::manual_seed(700 + 10 * s + g.rank());
      x = torch::randn({12, 64});
      y = torch::randint(0, 3, {12});
    }
    zero.zero_grad();
    torch::nn::functional::cross_entropy(net->forward(x), y).backward();
    zero.step();
  };
  // The state's pages in this process's memory, against the size of its files' mappings.
  const auto expect_paged_out = [](const std::vector<torch::Tensor>& state,
                                   const std::string& after) {
    const auto [resident, size] = mapped_bytes(state);
    EXPECT_GE(size, 500'000) << "the state's files, mapped";
    EXPECT_LE(resident * 16, size)
        << after << ": " << resident << " of the state's " << size << " bytes are in memory";
  };
  const auto expect_state_paged_out = [&](const ZeroOptimizer& zero, const std::string& after) {
    std::vector<torch::Tensor> state;
    for (const auto& [name, piece] : zero.state_dict().tensors) {
      state.push_back(piece.values);
      EXPECT_TRUE(piece.release) << name << ": its state is on disk";
    }
    expect_paged_out(state, after + " on rank " + std::to_string(zero.process_group().rank()));
  };
  std::vector<torch::Tensor> straight, resumed;
  run_ranks(2, [&](comm::ProcessGroup& g) {
    auto net = make_net(31);
    auto zero = make_offloaded(net, g);
    step(net, *zero, 0);
    step(net, *zero, 1);
    save_checkpoint(root / "checkpoint", *net, *zero);
    expect_state_paged_out(*zero, "the save");
    g.barrier();
    step(net, *zero, 2);
    copy_parameters(net, *zero, straight);
  });
  run_ranks(2, [&](comm::ProcessGroup& g) {
    auto net = make_net(99);
    auto zero = make_offloaded(net, g);
    load_checkpoint(Checkpoint::from_directory(root / "checkpoint"), *net, *zero);
    expect_state_paged_out(*zero, "the load");
    step(net, *zero, 2);
    copy_parameters(net, *zero, resumed);
  });
  ASSERT_EQ(resumed.size(), straight.size());
  for (size_t i = 0; i < straight.size(); ++i)
    EXPECT_TRUE(torch::equal(resumed[i], straight[i])) << "parameter " << i;
  // DDP's flat optimizer: its checkpoint holds the state as state files, not libtorch's archive
  // (which reads all of it in), written and read a parameter at a time.
  const auto whole_step = [](torch::nn::Sequential& net, torch::optim::Optimizer& optimizer,
                             int s) {
    torch::Tensor x, y;
    {
      std::lock_guard lock(cohort::testing::generator_mutex());
      torch::manual_seed(800 + s);
      x = torch::randn({12, 64});
      y = torch::randint(0, 3, {12});
    }
    optimizer.zero_grad();
    torch::nn::functional::cross_entropy(net->forward(x), y).backward();
    optimizer.step();
  };
  const auto views = [](optim::FlatOptimizer& flat, const torch::nn::Sequential& net) {
    std::vector<torch::Tensor> state;
    for (size_t i = 0; i < net->parameters().size(); ++i)
      for (const auto& v : flat.parameter_state_views(0, i).values) state.push_back(v);
    return state;
  };
  std::vector<torch::Tensor> whole_straight;
  {
    auto net = make_net(31);
    optim::FlatAdamW flat(net->parameters(), torch::optim::AdamWOptions(0.01));
    flat.offload_state(root / "offload");
    whole_step(net, flat, 0);
    whole_step(net, flat, 1);
    save_checkpoint(root / "ddp", *net, flat);
    EXPECT_TRUE(std::filesystem::exists(root / "ddp" / "zero_manifest.json"));
    EXPECT_FALSE(std::filesystem::exists(root / "ddp" / "optimizer.pt"));
    expect_paged_out(views(flat, net), "DDP's save");
    whole_step(net, flat, 2);
    for (const auto& p : net->parameters()) whole_straight.push_back(p.detach().clone());
  }
  {
    auto net = make_net(99);
    optim::FlatAdamW flat(net->parameters(), torch::optim::AdamWOptions(0.01));
    flat.offload_state(root / "offload");
    load_checkpoint(Checkpoint::from_directory(root / "ddp"), *net, flat);
    expect_paged_out(views(flat, net), "DDP's load");
    whole_step(net, flat, 2);
    const auto whole_resumed = net->parameters();
    for (size_t i = 0; i < whole_straight.size(); ++i)
      EXPECT_TRUE(torch::equal(whole_resumed[i], whole_straight[i])) << "DDP's parameter " << i;
  }
  // In memory, nothing to give back.
  run_ranks(1, [&](comm::ProcessGroup& g) {
    auto net = make_net(31);
    auto zero = make_zero(net, g, 3);
    for (const auto& [name, piece] : zero->state_dict().tensors)
      EXPECT_FALSE(piece.release) << name;
  });
  std::filesystem::remove_all(root);
}

TEST(ZeroCheckpoint, AMissingOrAlteredShardIsNamed) {
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
  std::filesystem::remove_all(dir);
}

// One step of a whole optimizer (DDP's, on one rank) on the whole global batch: what N ZeRO
// ranks step together.
void whole_step(torch::nn::Sequential& net, torch::optim::Optimizer& optimizer, int step) {
  auto [x, y] = global_batch(step);
  optimizer.zero_grad();
  torch::nn::functional::cross_entropy(net->forward(x), y).backward();
  optimizer.step();
}

std::unique_ptr<torch::optim::Optimizer> whole_adamw(torch::nn::Sequential& net, bool flat) {
  if (flat)
    return std::make_unique<optim::FlatAdamW>(net->parameters(), torch::optim::AdamWOptions(0.01));
  return std::make_unique<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(0.01));
}

void expect_same_parameters(const std::vector<torch::Tensor>& a,
                            const std::vector<torch::Tensor>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(torch::allclose(a[i], b[i], 1e-5, 1e-6))
        << what << ": parameter " << i << " differs by "
        << (a[i] - b[i]).abs().max().item<double>();
  }
}

TEST(ZeroCheckpoint, MovesBetweenZeroAndTheWholeOptimizersOfDdp) {
  const auto root = cohort::testing::temp_dir("zero_checkpoint_ddp");
  // Two ranks at stage 3 write; DDP's optimizer (torch::optim's and the flat one) on one rank
  // takes the next step as the two ranks do.
  std::vector<torch::Tensor> straight;
  run_ranks(2, [&](comm::ProcessGroup& g) { save_between_steps(root / "zero", g, 3, straight); });
  for (const bool flat : {false, true}) {
    auto net = make_checkpoint_net();
    auto optimizer = whole_adamw(net, flat);
    load_checkpoint(Checkpoint::from_directory(root / "zero"), *net, *optimizer);
    whole_step(net, *optimizer, 2);
    std::vector<torch::Tensor> resumed;
    for (const auto& p : net->parameters()) resumed.push_back(p.detach().clone());
    expect_same_parameters(
        resumed, straight,
        std::string("ZeRO stage 3 into DDP's ") + (flat ? "FlatAdamW" : "AdamW"));
  }
  // DDP's checkpoints (optimizer.pt of either optimizer) into ZeRO at stages 3 and 1.
  for (const bool flat : {false, true}) {
    const auto dir = root / (flat ? "ddp_flat" : "ddp");
    std::vector<torch::Tensor> reference;
    {
      auto net = make_checkpoint_net();
      auto optimizer = whole_adamw(net, flat);
      whole_step(net, *optimizer, 0);
      whole_step(net, *optimizer, 1);
      save_checkpoint(dir, *net, *optimizer);
      whole_step(net, *optimizer, 2);
      for (const auto& p : net->parameters()) reference.push_back(p.detach().clone());
    }
    for (int stage : {3, 1}) {
      expect_same_parameters(resume_at(dir, 2, stage), reference,
                             std::string("DDP's ") + (flat ? "FlatAdamW" : "AdamW") +
                                 " into ZeRO stage " + std::to_string(stage));
    }
  }
  // Another algorithm's state is refused by name.
  auto net = make_checkpoint_net();
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  cohort::testing::expect_error<UsageError>(
      [&] { load_checkpoint(Checkpoint::from_directory(root / "zero"), *net, sgd); },
      "holds adamw state");
  std::filesystem::remove_all(root);
}

// A model's optimizer state in parts, as a pipeline of two stages keeps it: the first layer's by
// a whole AdamW (optimizer.pt), the last's sharded by ZeRO over two ranks, each under its
// stage's own names. Loaded by the whole model's names into DDP's optimizer (torch::optim's and
// the flat one) on one rank, or into ZeRO on three, the next step is the uncut model's; a
// missing part is named.
TEST(OptimizerParts, AModelsStagesLoadIntoAnyCutByTheWholeModelsNames) {
  const auto root = cohort::testing::temp_dir("optimizer_parts");
  const auto checkpoint = root / "checkpoint";
  std::vector<torch::Tensor> reference;  // the uncut model's third step
  {
    auto net = make_checkpoint_net();
    auto optimizer = whole_adamw(net, false);
    for (int step = 0; step < 3; ++step) whole_step(net, *optimizer, step);
    for (const auto& p : net->parameters()) reference.push_back(p.detach().clone());
  }
  run_ranks(2, [&](comm::ProcessGroup& g) {
    auto net = make_checkpoint_net();
    const auto first = net->ptr(0), last = net->ptr(2);
    torch::optim::AdamW first_optimizer(first->parameters(), torch::optim::AdamWOptions(0.01));
    torch::optim::AdamW plain(last->parameters(), torch::optim::AdamWOptions(0.01));
    ZeroOptimizer last_optimizer(last, plain, g, ZeroOptions{.stage = 2, .reduce_bucket_size = 40});
    for (int step = 0; step < 2; ++step) {
      // Every rank the whole batch: ZeRO's average is its gradient.
      auto [x, y] = global_batch(step);
      first_optimizer.zero_grad();
      last_optimizer.zero_grad();
      torch::nn::functional::cross_entropy(net->forward(x), y).backward();
      first_optimizer.step();
      last_optimizer.step();
    }
    auto part = [](const std::shared_ptr<torch::nn::Module>& stage, const std::string& prefix,
                   const std::filesystem::path& dir) {
      OptimizerPart out{.dir = dir, .parameters = {}};
      for (const auto& p : stage->named_parameters())
        out.parameters.push_back({p.key(), prefix + p.key(), p.value().sizes().vec()});
      return out;
    };
    save_optimizer_state(checkpoint / "stage1", last_optimizer, *last);  // every rank its shard
    if (g.rank() == 0) {
      save_optimizer_state(checkpoint / "stage0", first_optimizer, *first);
      save_optimizer_part(part(first, "0.", checkpoint / "stage0"));
      save_optimizer_part(part(last, "2.", checkpoint / "stage1"));
      save_model(*net, checkpoint / "model.safetensors");
    }
  });
  ASSERT_EQ(find_optimizer_parts(checkpoint).size(), 2u);
  for (const bool flat : {false, true}) {
    auto net = make_checkpoint_net();
    load_model(*net, checkpoint / "model.safetensors");
    auto optimizer = whole_adamw(net, flat);
    load_optimizer_state(checkpoint, *optimizer, *net);  // finds the parts
    whole_step(net, *optimizer, 2);
    std::vector<torch::Tensor> resumed;
    for (const auto& p : net->parameters()) resumed.push_back(p.detach().clone());
    expect_same_parameters(resumed, reference,
                           std::string("parts into DDP's ") + (flat ? "FlatAdamW" : "AdamW"));
  }
  std::vector<torch::Tensor> sharded;
  run_ranks(3, [&](comm::ProcessGroup& g) {
    auto net = make_checkpoint_net();
    load_model(*net, checkpoint / "model.safetensors");
    auto zero = make_zero(net, g, 1);
    load_optimizer_parts(find_optimizer_parts(checkpoint), *zero, *net);
    train_step(net, *zero, 2);
    copy_parameters(net, *zero, sharded);
  });
  expect_same_parameters(sharded, reference, "parts into ZeRO stage 1 on 3 ranks");
  // Without the last stage's part its parameters are named.
  std::filesystem::remove_all(checkpoint / "stage1");
  auto net = make_checkpoint_net();
  auto optimizer = whole_adamw(net, false);
  cohort::testing::expect_error<UsageError>(
      [&] { load_optimizer_state(checkpoint, *optimizer, *net); },
      "holds no optimizer state for parameter '2.");
  std::filesystem::remove_all(root);
}

}  // namespace
}  // namespace cohort::train

#include "cohort/parallel/zero_optimizer.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <mutex>
#include <sstream>

#include "cohort/error.h"
#include "cohort/optim/flat_optimizer.h"
#include "cohort/optim/loss_scaler.h"
#include "cohort/parallel/distributed_data_parallel.h"
#include "support/cuda.h"
#include "support/expect.h"
#include "support/local_group.h"

namespace cohort::parallel {
namespace {

// Layers of different sizes (13 x 37, 37, 11 are multiples of no world size in the tests),
// batch norm statistics, and a parameter that gets no gradient. `first` and `second` are stage
// 3's units (whole at the other stages, as is everything else at stage 3).
struct NetImpl : torch::nn::Module {
  NetImpl() {
    // No bias before batch norm: its gradient would be rounding noise, which Adam's
    // normalisation turns into full steps of either sign.
    first = register_module(
        "first", FullyShard(torch::nn::Linear(torch::nn::LinearOptions(13, 37).bias(false))));
    norm = register_module("norm", torch::nn::BatchNorm1d(37));
    second = register_module("second", FullyShard(torch::nn::Linear(37, 11)));
    head = register_module("head", torch::nn::Linear(11, 5));
    unused = register_parameter("unused", torch::randn({3}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return head->forward(
        torch::relu(second->forward(torch::relu(norm->forward(first->forward(x))))));
  }
  torch::Tensor first_weight() { return first->module_as<torch::nn::LinearImpl>()->weight; }
  FullyShard first{nullptr}, second{nullptr};
  torch::nn::Linear head{nullptr};
  torch::nn::BatchNorm1d norm{nullptr};
  torch::Tensor unused;
};
TORCH_MODULE(Net);

Net make_zero_net() {
  std::lock_guard lock(testing::generator_mutex());
  torch::manual_seed(11);
  return Net();
}

using cohort::testing::run_ranks;

// Rank r's micro-batch m of step s: the same on every run.
std::pair<torch::Tensor, torch::Tensor> batch(int rank, int step, int micro) {
  std::lock_guard lock(testing::generator_mutex());
  torch::manual_seed(1000 + 100 * rank + 10 * step + micro);
  return {torch::randn({6, 13}), torch::randint(0, 5, {6})};
}

torch::Tensor loss_of(Net& net, int rank, int step, int micro, int micro_batches,
                      torch::Device device = torch::kCPU) {
  auto [x, y] = batch(rank, step, micro);
  return torch::nn::functional::cross_entropy(net->forward(x.to(device)), y.to(device)) /
         micro_batches;
}

std::unique_ptr<torch::optim::Optimizer> adamw(Net& net) {
  return std::make_unique<torch::optim::AdamW>(net->parameters(),
                                               torch::optim::AdamWOptions(0.01).weight_decay(0.05));
}

// The losses of `steps` steps (each of `micro_batches` micro-batches) of a run with DDP and
// torch::optim::AdamW, or with ZeRO at `stage`; and the parameters after them.
struct Run {
  std::vector<double> losses;
  std::vector<torch::Tensor> parameters;
  std::vector<std::string> names;
};

// Stage 3 with both units sharded (they are smaller than the default persistence threshold).
ZeroOptions zero_options(int stage, int64_t bucket = 200, bool reshard_after_forward = true,
                         int shard_group_size = 0) {
  return {.stage = stage,
          .reduce_bucket_size = bucket,
          .allgather_bucket_size = bucket,
          .param_persistence_threshold = 0,
          .shard_group_size = shard_group_size,
          .reshard_after_forward = reshard_after_forward};
}

Run train(comm::ProcessGroup& g, int stage, int steps, int micro_batches, int64_t bucket = 200,
          bool reshard_after_forward = true, torch::Device device = torch::kCPU,
          int shard_group_size = 0, bool host_offload = false) {
  auto net = make_zero_net();
  net->to(device);
  std::unique_ptr<DistributedDataParallel> ddp;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  if (stage == 0) {
    ddp = std::make_unique<DistributedDataParallel>(net.ptr(), g);
    optimizer = adamw(net);
  } else {
    auto plain = adamw(net);
    optimizer = std::make_unique<ZeroOptimizer>(
        net.ptr(), *plain, g, zero_options(stage, bucket, reshard_after_forward, shard_group_size));
  }
  auto* zero = dynamic_cast<ZeroOptimizer*>(optimizer.get());
  if (zero && host_offload) zero->offload_to_host();
  Run run;
  for (int step = 0; step < steps; ++step) {
    optimizer->zero_grad();
    double loss_sum = 0;
    for (int micro = 0; micro < micro_batches; ++micro) {
      const bool last = micro + 1 == micro_batches;
      std::optional<DistributedDataParallel::NoSyncGuard> ddp_guard;
      std::optional<ZeroOptimizer::NoSyncGuard> zero_guard;
      if (!last && ddp) ddp_guard.emplace(*ddp);
      if (!last && zero) zero_guard.emplace(*zero);
      auto loss = loss_of(net, g.rank(), step, micro, micro_batches, device);
      loss.backward();
      loss_sum += loss.item<double>();
    }
    run.losses.push_back(loss_sum);
    optimizer->step();
  }
  std::optional<ZeroOptimizer::GatheredParameters> whole;  // stage 3's units
  if (zero) whole.emplace(*zero);
  for (const auto& p : net->named_parameters()) {
    run.names.push_back(p.key());
    run.parameters.push_back(p.value().detach().cpu().clone());
  }
  return run;
}

void expect_same_run(const Run& a, const Run& b, const std::string& what) {
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t s = 0; s < a.losses.size(); ++s)
    EXPECT_NEAR(a.losses[s], b.losses[s], 1e-5 * std::abs(b.losses[s])) << what << " step " << s;
  ASSERT_EQ(a.parameters.size(), b.parameters.size());
  for (size_t i = 0; i < a.parameters.size(); ++i) {
    EXPECT_TRUE(torch::allclose(a.parameters[i], b.parameters[i], 1e-5, 1e-6))
        << what << " parameter " << a.names[i] << " differs by "
        << (a.parameters[i] - b.parameters[i]).abs().max().item<double>();
  }
}

// `host_offload`: ZeRO's optimizer state and update in host memory (ZeroOptimizer's
// offload_to_host), the parameters on `device`.
void expect_parity_with_ddp(int world, int micro_batches, torch::Device device = torch::kCPU,
                            comm::Backend backend = comm::Backend::kAuto,
                            bool host_offload = false) {
  comm::ProcessGroupOptions options{.timeout = std::chrono::seconds(30)};
  options.backend = backend;
  const std::function<void(comm::ProcessGroup&)> body = [&](comm::ProcessGroup& g) {
    const auto ddp = train(g, 0, 5, micro_batches, 200, true, device);
    for (int stage : {1, 2, 3}) {
      const auto zero = train(g, stage, 5, micro_batches, 200, true, device, /*shard_group_size=*/0,
                              host_offload);
      expect_same_run(zero, ddp,
                      "stage " + std::to_string(stage) + " on rank " + std::to_string(g.rank()) +
                          " of " + std::to_string(world) + ", " + std::to_string(micro_batches) +
                          " micro-batches on " + device.str() + " over " +
                          comm::to_string(g.backend()) +
                          (host_offload ? ", the state on the host" : ""));
    }
  };
  // GPU ranks in processes of their own (see run_rank_processes).
  if (device.is_cuda()) {
    testing::run_rank_processes(world, body, options);
  } else {
    run_ranks(world, body, options);
  }
}

TEST(ZeroOptimizer, StagesOneToThreeTrainAsDdpOnTwoRanks) { expect_parity_with_ddp(2, 1); }
TEST(ZeroOptimizer, StagesOneToThreeTrainAsDdpOnThreeRanks) { expect_parity_with_ddp(3, 1); }
// HSDP: sharded inside groups of 2 (or 1: every rank a group, all-reduce only) and replicated
// across them, every stage trains as DDP over all 4 ranks, with accumulation too.
TEST(ZeroOptimizer, ShardingGroupsTrainAsDdpOnFourRanks) {
  run_ranks(4, [](comm::ProcessGroup& g) {
    for (int micro_batches : {1, 2}) {
      const auto ddp = train(g, 0, 5, micro_batches);
      for (int stage : {1, 2, 3}) {
        for (int size : {2, 1}) {
          const auto zero = train(g, stage, 5, micro_batches, 200, true, torch::kCPU, size);
          expect_same_run(zero, ddp,
                          "stage " + std::to_string(stage) + " in sharding groups of " +
                              std::to_string(size) + " on rank " + std::to_string(g.rank()) + ", " +
                              std::to_string(micro_batches) + " micro-batches");
        }
      }
    }
    // The state is sharded over the group of 2 only: each rank holds half of it, and the ranks
    // at the same place in each group hold the same half.
    auto net = make_zero_net();
    auto plain = adamw(net);
    ZeroOptimizer zero(net.ptr(), *plain, g, zero_options(2, 200, true, 2));
    EXPECT_EQ(zero.process_group().world_size(), 2);
    EXPECT_EQ(zero.process_group().rank(), g.rank() % 2);
    EXPECT_EQ(zero.replica(), g.rank() / 2);
    EXPECT_EQ(zero.stats().shard_numel * 2, zero.stats().padded_numel);
  });
}

TEST(ZeroOptimizer, AShardingGroupSizeThatDoesNotDivideIsNamed) {
  run_ranks(2, [](comm::ProcessGroup& g) {
    auto net = make_zero_net();
    auto plain = adamw(net);
    for (int size : {3, -1}) {
      try {
        ZeroOptimizer zero(net.ptr(), *plain, g, zero_options(1, 200, true, size));
        ADD_FAILURE() << "shard_group_size " << size << " was taken";
      } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find("(--shard-group-size) " + std::to_string(size)),
                  std::string::npos)
            << e.what();
      }
    }
  });
}

TEST(ZeroOptimizer, GradientAccumulationTrainsAsDdpOnTwoAndThreeRanks) {
  expect_parity_with_ddp(2, 3);
  expect_parity_with_ddp(3, 2);
}

// On the GPU: two ranks sharing it through Gloo's CUDA path, and one rank whose CUDA tensors go
// over NCCL (Backend::kAuto: the engines' few CPU tensors over Gloo).
TEST(ZeroOptimizer, StagesOneToThreeTrainAsDdpOnTheGpu) {
  COHORT_REQUIRE_CUDA();
  expect_parity_with_ddp(2, 2, torch::kCUDA, comm::Backend::kGloo);
  if (comm::nccl_available()) expect_parity_with_ddp(1, 2, torch::kCUDA, comm::Backend::kAuto);
}

// ZeRO-Offload: the shards' state and update in host memory, the parameters and gradients on the
// GPU; the same training as DDP's on the GPU.
TEST(ZeroOptimizer, StagesOneToThreeWithTheStateOnTheHostTrainAsDdpOnTheGpu) {
  COHORT_REQUIRE_CUDA();
  expect_parity_with_ddp(2, 2, torch::kCUDA, comm::Backend::kGloo, /*host_offload=*/true);
}

TEST(ZeroOptimizer, AccumulatedMicroBatchesEqualTheBigBatch) {
  // Two micro-batches of 6 with the loss halved step exactly as one batch of 12 (no batch norm
  // in the way: a linear model).
  run_ranks(2, [](comm::ProcessGroup& g) {
    auto step_with = [&](bool accumulate) {
      auto net = [] {
        std::lock_guard lock(testing::generator_mutex());
        torch::manual_seed(3);
        return torch::nn::Linear(13, 5);
      }();
      torch::optim::SGD plain(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      ZeroOptimizer zero(net.ptr(), plain, g, {.stage = 2, .reduce_bucket_size = 16});
      auto [x0, y0] = batch(g.rank(), 0, 0);
      auto [x1, y1] = batch(g.rank(), 0, 1);
      for (int step = 0; step < 3; ++step) {
        zero.zero_grad();
        if (accumulate) {
          {
            auto guard = zero.no_sync();
            (torch::nn::functional::cross_entropy(net->forward(x0), y0) / 2).backward();
          }
          (torch::nn::functional::cross_entropy(net->forward(x1), y1) / 2).backward();
        } else {
          torch::nn::functional::cross_entropy(net->forward(torch::cat({x0, x1})),
                                               torch::cat({y0, y1}))
              .backward();
        }
        zero.step();
      }
      return net->weight.detach().clone();
    };
    const auto accumulated = step_with(true);
    const auto big = step_with(false);
    EXPECT_TRUE(torch::allclose(accumulated, big, 1e-5, 1e-6))
        << (accumulated - big).abs().max().item<double>();
  });
}

TEST(ZeroOptimizer, ShardsTheStateAndTheGradientsAcrossTheRanks) {
  run_ranks(2, [](comm::ProcessGroup& g) {
    for (int stage : {1, 2}) {
      auto net = make_zero_net();
      int64_t numel = 0;
      for (const auto& p : net->parameters()) numel += p.numel();
      auto plain = adamw(net);
      ZeroOptimizer zero(net.ptr(), *plain, g, {.stage = stage, .reduce_bucket_size = 200});
      auto loss = loss_of(net, g.rank(), 0, 0, 1);
      loss.backward();
      zero.step();
      const auto stats = zero.stats();
      EXPECT_GT(stats.buckets, 3);
      EXPECT_GE(stats.padded_numel, numel);
      EXPECT_LT(stats.padded_numel, numel + stats.buckets * 2);
      EXPECT_EQ(stats.shard_numel * 2, stats.padded_numel);
      EXPECT_EQ(stats.parameter_bytes, stats.padded_numel * 4);
      // Adam's two moments, for this rank's half only.
      EXPECT_EQ(stats.optimizer_state_bytes, stats.shard_numel * 8);
      // Stage 1 keeps every gradient (the reduced shard is a piece of them); stage 2 the reduced
      // shard only, and two buckets' staging buffers.
      EXPECT_EQ(stats.gradient_bytes, stage == 1 ? stats.padded_numel * 4 : stats.shard_numel * 4);
      if (stage == 2) {
        EXPECT_GT(stats.bucket_bytes_peak, 0);
        EXPECT_LT(stats.bucket_bytes_peak, stats.padded_numel * 4);
      } else {
        EXPECT_EQ(stats.bucket_bytes_peak, 0);
      }
      // Each collective sends the half another rank owns: the reduce-scatter and the all-gather.
      EXPECT_EQ(stats.bytes_sent_last_step, stats.padded_numel / 2 * 4 * 2);
      EXPECT_EQ(stats.synchronized_steps, 1);
    }
    // Three steps of ZeRO-2 over a fresh net, `own_buckets` (indices into its parameters) each a
    // bucket of its own.
    const auto three_steps = [&](Net& net, const std::vector<size_t>& own_buckets) {
      auto plain = adamw(net);
      std::vector<torch::Tensor> own;
      for (size_t i : own_buckets) own.push_back(net->parameters()[i]);
      auto zero =
          std::make_unique<ZeroOptimizer>(net.ptr(), *plain, g, ZeroOptions{.stage = 2}, own);
      for (int step = 0; step < 3; ++step) {
        zero->zero_grad();
        loss_of(net, g.rank(), step, 0, 1).backward();
        zero->step();
      }
      return zero;
    };
    // The whole gradient in one bucket: one staging buffer, kept from step to step, not two.
    auto net = make_zero_net();
    const auto whole = three_steps(net, {});
    EXPECT_EQ(whole->stats().buckets, 1);
    EXPECT_EQ(whole->stats().bucket_bytes_peak, whole->stats().padded_numel * 4);
    // A parameter in a bucket of its own beside the rest (a pipeline's tied embedding): a buffer
    // of each bucket's size, not two of the larger's; its shard gradient is its bucket's piece.
    auto apart = make_zero_net();
    const auto small = apart->parameters().back();
    const auto split_zero = three_steps(apart, {apart->parameters().size() - 1});
    const auto& split = *split_zero;
    EXPECT_EQ(split.stats().buckets, 2);
    EXPECT_EQ(split.stats().bucket_bytes_peak, split.stats().padded_numel * 4);
    EXPECT_EQ(split.shard_gradient(small).numel(), (small.numel() + 1) / 2);
    cohort::testing::expect_error<UsageError>([&] { split.shard_gradient(apart->parameters()[0]); },
                                              "shares its bucket with others");
  });
}

TEST(ZeroOptimizer, ClipsByTheGlobalNormOverEveryRanksShard) {
  run_ranks(2, [](comm::ProcessGroup& g) {
    // The reference: DDP's averaged gradients, clipped whole.
    auto reference = make_zero_net();
    DistributedDataParallel ddp(reference.ptr(), g);
    loss_of(reference, g.rank(), 0, 0, 1).backward();
    const double expected = optim::clip_grad_norm(reference->parameters(), 1e9).item<double>();

    auto net = make_zero_net();
    auto plain = adamw(net);
    ZeroOptimizer zero(net.ptr(), *plain, g, {.stage = 2, .reduce_bucket_size = 100});
    loss_of(net, g.rank(), 0, 0, 1).backward();
    const double norm = zero.clip_grad_norm(1e9).item<double>();
    EXPECT_NEAR(norm, expected, 1e-5 * expected);
    zero.clip_grad_norm(expected / 4);
    EXPECT_NEAR(zero.clip_grad_norm(1e9).item<double>(), expected / 4, 1e-4 * expected);
  });
}

TEST(ZeroOptimizer, AnOverflowOnOneRankSkipsTheStepOnEveryRank) {
  run_ranks(2, [](comm::ProcessGroup& g) {
    auto net = make_zero_net();
    auto plain = adamw(net);
    ZeroOptimizer zero(net.ptr(), *plain, g, {.stage = 2, .reduce_bucket_size = 100});
    optim::LossScaler scaler(optim::LossScalerOptions{}, g);
    const auto before = net->first_weight().detach().clone();
    auto loss = loss_of(net, g.rank(), 0, 0, 1);
    if (g.rank() == 1) loss = loss * std::numeric_limits<float>::infinity();
    scaler.scale(loss).backward();
    EXPECT_FALSE(scaler.step(zero));
    scaler.update();
    EXPECT_TRUE(torch::equal(net->first_weight(), before));
    // The next, finite step steps.
    zero.zero_grad();
    scaler.scale(loss_of(net, g.rank(), 1, 0, 1)).backward();
    EXPECT_TRUE(scaler.step(zero));
    EXPECT_FALSE(torch::equal(net->first_weight(), before));
  });
}

TEST(ZeroOptimizer, SavedShardsResumeExactlyAtTheSameWorldSize) {
  run_ranks(2, [](comm::ProcessGroup& g) {
    const auto straight = train(g, 2, 4, 1);
    // Two steps, save, a fresh model and optimizer load the state and take the other two.
    std::stringstream saved;
    std::vector<torch::Tensor> weights;
    {
      auto net = make_zero_net();
      auto plain = adamw(net);
      ZeroOptimizer zero(net.ptr(), *plain, g, {.stage = 2, .reduce_bucket_size = 200});
      for (int step = 0; step < 2; ++step) {
        zero.zero_grad();
        loss_of(net, g.rank(), step, 0, 1).backward();
        zero.step();
      }
      torch::serialize::OutputArchive archive;
      zero.save(archive);
      archive.save_to(saved);
      for (const auto& p : net->parameters()) weights.push_back(p.detach().clone());
      for (const auto& b : net->buffers()) weights.push_back(b.detach().clone());
    }
    auto net = make_zero_net();
    {
      torch::NoGradGuard no_grad;
      size_t k = 0;
      for (auto& p : net->parameters()) p.copy_(weights[k++]);
      for (auto& b : net->buffers()) b.copy_(weights[k++]);
    }
    auto plain = adamw(net);
    ZeroOptimizer zero(net.ptr(), *plain, g, {.stage = 2, .reduce_bucket_size = 200});
    torch::serialize::InputArchive archive;
    archive.load_from(saved);
    zero.load(archive);
    for (int step = 2; step < 4; ++step) {
      zero.zero_grad();
      loss_of(net, g.rank(), step, 0, 1).backward();
      zero.step();
    }
    const auto params = net->parameters();
    for (size_t i = 0; i < params.size(); ++i)
      EXPECT_TRUE(torch::equal(params[i], straight.parameters[i])) << "parameter " << i;
  });
}

TEST(ZeroOptimizer, StageThreeKeepsUnitsWholeOnlyFromTheirForwardToTheirBackward) {
  run_ranks(2, [](comm::ProcessGroup& g) {
    // Parity with the units kept from forward to backward (one gather less per step).
    expect_same_run(train(g, 3, 5, 1, 200, /*reshard_after_forward=*/false), train(g, 0, 5, 1),
                    "stage 3 without reshard_after_forward");
    auto net = make_zero_net();
    auto plain = adamw(net);
    ZeroOptimizer zero(net.ptr(), *plain, g, zero_options(3));
    auto bytes_held = [](const torch::Tensor& t) { return t.storage().nbytes(); };
    const auto weight = net->first_weight();
    EXPECT_EQ(bytes_held(weight), 0u) << "a unit's parameters hold nothing outside a step";
    EXPECT_GE(bytes_held(net->head->weight), static_cast<size_t>(net->head->weight.numel() * 4))
        << "parameters outside the units stay whole";
    for (int step = 0; step < 3; ++step) {
      zero.zero_grad();
      auto loss = loss_of(net, g.rank(), step, 0, 1);
      EXPECT_EQ(bytes_held(weight), 0u) << "freed after its forward";
      loss.backward();
      EXPECT_EQ(bytes_held(weight), 0u) << "freed after its backward";
      zero.step();
    }
    const auto stats = zero.stats();
    EXPECT_EQ(stats.units, 2);
    // Each step: two units gathered for forward and again for backward (some of them ahead).
    EXPECT_EQ(stats.gathers, 3 * 4);
    EXPECT_GE(stats.prefetches, 3);
    EXPECT_EQ(stats.order_changes, 0);
    const int64_t first_bytes = (13 * 37 + 1) / 2 * 2 * 4, second_bytes = (37 * 11 + 11) * 4;
    EXPECT_LE(stats.gathered_bytes_peak, first_bytes + second_bytes);
    EXPECT_GE(stats.gathered_bytes_peak, second_bytes);
    // The shards: half of each unit, beside the whole head and the unused parameter.
    EXPECT_LT(stats.parameter_bytes, (13 * 37 + 37 * 11 + 11 + 11 * 5 + 5 + 3) * 4);
    {
      ZeroOptimizer::GatheredParameters whole(zero);
      EXPECT_GE(bytes_held(weight), static_cast<size_t>(13 * 37 * 4));
      const auto all = g.allgather(weight.detach().clone());
      EXPECT_TRUE(torch::equal(all[0], all[1])) << "every rank gathers the same unit";
    }
    EXPECT_EQ(bytes_held(weight), 0u);
    // Written inside a scope with write_back, the values are this rank's shard from then on.
    {
      ZeroOptimizer::GatheredParameters whole(zero, /*write_back=*/true);
      torch::NoGradGuard no_grad;
      weight.fill_(0.5);
    }
    ZeroOptimizer::GatheredParameters whole(zero);
    EXPECT_TRUE(torch::equal(weight, torch::full({37, 13}, 0.5)));
  });
}

// Two units of the same shape, run in either order.
struct TwoUnitsImpl : torch::nn::Module {
  TwoUnitsImpl() {
    a = register_module("a", FullyShard(torch::nn::Linear(8, 8)));
    b = register_module("b", FullyShard(torch::nn::Linear(8, 8)));
  }
  torch::Tensor forward(const torch::Tensor& x, bool b_first = false) {
    return b_first ? a->forward(torch::tanh(b->forward(x)))
                   : b->forward(torch::tanh(a->forward(x)));
  }
  FullyShard a{nullptr}, b{nullptr};
};
TORCH_MODULE(TwoUnits);

TEST(ZeroOptimizer, StageThreeFollowsAnOrderThatChangesOnEveryRank) {
  run_ranks(2, [](comm::ProcessGroup& g) {
    auto run = [&](int stage) {
      auto net = [] {
        std::lock_guard lock(testing::generator_mutex());
        torch::manual_seed(5);
        return TwoUnits();
      }();
      std::unique_ptr<DistributedDataParallel> ddp;
      torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      std::unique_ptr<ZeroOptimizer> zero;
      if (stage == 0) {
        ddp = std::make_unique<DistributedDataParallel>(net.ptr(), g);
      } else {
        zero = std::make_unique<ZeroOptimizer>(net.ptr(), sgd, g, zero_options(3));
      }
      torch::optim::Optimizer& optimizer =
          zero ? static_cast<torch::optim::Optimizer&>(*zero) : sgd;
      std::vector<double> losses;
      for (int step = 0; step < 5; ++step) {
        optimizer.zero_grad();
        auto [x, y] = batch(g.rank(), step, 0);
        auto out = net->forward(x.narrow(1, 0, 8), /*b_first=*/step == 2 || step == 3);
        auto loss = torch::nn::functional::cross_entropy(out, y);
        loss.backward();
        losses.push_back(loss.item<double>());
        optimizer.step();
      }
      if (zero) {
        EXPECT_EQ(zero->stats().order_changes, 2) << "at steps 2 and 4";
      }
      return losses;
    };
    const auto sharded = run(3);
    const auto ddp = run(0);
    for (size_t s = 0; s < ddp.size(); ++s)
      EXPECT_NEAR(sharded[s], ddp[s], 1e-5 * std::abs(ddp[s])) << "step " << s;
  });
}

// Two micro-batches a step in a StepOrderScope, as a pipeline's step runs them: the uses of the
// units (a, b forward; b, a backward; again) are one sequence per step, which the next step
// follows ahead without a change, and the parameters are those of steps without the scope. A
// scope that an error ends drops its order; a second scope while one is open is refused.
TEST(ZeroOptimizer, StageThreeInAStepOrderScopeFollowsTheWholeStepsUses) {
  using cohort::testing::expect_error;
  run_ranks(2, [](comm::ProcessGroup& g) {
    auto run = [&](bool scoped) {
      auto net = [] {
        std::lock_guard lock(testing::generator_mutex());
        torch::manual_seed(5);
        return TwoUnits();
      }();
      torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      ZeroOptimizer zero(net.ptr(), sgd, g, zero_options(3));
      auto micro_batch = [&](int step, int micro) {
        auto [x, y] = batch(g.rank(), step, micro);
        torch::nn::functional::cross_entropy(net->forward(x.narrow(1, 0, 8)), y).backward();
      };
      for (int step = 0; step < 4; ++step) {
        zero.zero_grad();
        std::optional<ZeroOptimizer::StepOrderScope> order;
        if (scoped) order.emplace(zero);
        {
          ZeroOptimizer::NoSyncGuard accumulate(zero);
          micro_batch(step, 0);
        }
        micro_batch(step, 1);
        if (order) order->close();
        zero.step();
      }
      if (scoped) {
        EXPECT_EQ(zero.stats().order_changes, 0);
        // After the first step every use but each step's first is gathered ahead: 3 steps of 7.
        // After the first step two uses a micro-batch are gathered ahead (b's forward and a's
        // backward: a and b are whole in the use before theirs), and none is gathered unused.
        EXPECT_EQ(zero.stats().prefetches, 3 * 2 * 2);
        EXPECT_EQ(zero.stats().gathers, 4 * 8);
        // An error ends a step's scope: what it recorded is dropped, the last whole step's order
        // stays the guide, and the units are sharded again.
        try {
          ZeroOptimizer::StepOrderScope order(zero);
          auto [x, y] = batch(g.rank(), 9, 0);
          (void)net->forward(x.narrow(1, 0, 8));
          expect_error<UsageError>([&] { ZeroOptimizer::StepOrderScope second(zero); },
                                   "one is open already; open one per step");
          throw RuntimeError("the step failed");
        } catch (const RuntimeError&) {
        }
        const int64_t prefetched = zero.stats().prefetches;
        zero.zero_grad();
        ZeroOptimizer::StepOrderScope order(zero);
        micro_batch(9, 0);
        order.close();
        EXPECT_EQ(zero.stats().order_changes, 0);
        EXPECT_GT(zero.stats().prefetches, prefetched);
        zero.zero_grad();
      }
      std::vector<at::Tensor> values;
      const ZeroOptimizer::GatheredParameters whole(zero);
      for (const auto& p : net->parameters()) values.push_back(p.detach().clone());
      return values;
    };
    const auto plain = run(false);
    const auto scoped = run(true);
    ASSERT_EQ(plain.size(), scoped.size());
    for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(torch::equal(plain[i], scoped[i]));
  });
}

// Six units of the same size, one after the other.
struct UnitChainImpl : torch::nn::Module {
  UnitChainImpl() {
    for (int i = 0; i < 6; ++i)
      units.push_back(
          register_module("unit" + std::to_string(i), FullyShard(torch::nn::Linear(16, 16))));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& unit : units) x = torch::tanh(unit->forward(x));
    return x;
  }
  std::vector<FullyShard> units;
};
TORCH_MODULE(UnitChain);

// Three steps of UnitChain at stage 3 on each of 2 ranks with `prefetch_bucket_size` elements
// ahead: rank 0's stats.
ZeroStats unit_chain_stats(int64_t prefetch_bucket_size) {
  ZeroStats stats;
  run_ranks(2, [&](comm::ProcessGroup& g) {
    auto net = UnitChain();
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
    auto options = zero_options(3);
    options.prefetch_bucket_size = prefetch_bucket_size;
    ZeroOptimizer zero(net.ptr(), sgd, g, options);
    for (int step = 0; step < 3; ++step) {
      zero.zero_grad();
      net->forward(torch::ones({4, 16}) * (g.rank() + 1)).sum().backward();
      zero.step();
    }
    if (g.rank() == 0) stats = zero.stats();
  });
  return stats;
}
constexpr int64_t kUnitChainUnitBytes = (16 * 16 + 16) * 4;

TEST(ZeroOptimizer, StageThreeGathersNoMoreAheadThanItsPrefetchBucket) {
  // Two units ahead of the one in use.
  const auto stats = unit_chain_stats(2 * kUnitChainUnitBytes / 4);
  EXPECT_GT(stats.prefetches, 0) << "the second step follows the first one's order";
  // The unit in use and two ahead: the units gathered ahead already count against the bucket
  // (they once did not, and a third unit ahead was gathered beside them).
  EXPECT_EQ(stats.gathered_bytes_peak, 3 * kUnitChainUnitBytes);
}

TEST(ZeroOptimizer, StageThreeGathersTheNextUnitAheadEvenWhereItExceedsTheBucket) {
  // A bucket smaller than one unit: the next unit still overlaps the one in use (DeepSpeed's
  // rule; such units were once never gathered ahead).
  const auto smaller = unit_chain_stats(kUnitChainUnitBytes / 4 - 1);
  EXPECT_GT(smaller.prefetches, 0);
  EXPECT_EQ(smaller.gathered_bytes_peak, 2 * kUnitChainUnitBytes);
  // A bucket of 0: none ahead.
  const auto none = unit_chain_stats(0);
  EXPECT_EQ(none.prefetches, 0);
  EXPECT_EQ(none.gathered_bytes_peak, kUnitChainUnitBytes);
}

// Rank 1 runs the units in the other order, or skips one, in its second step: the all-gathers
// of same-sized units would pair without an error. Every rank fails, naming the units it ran,
// instead of stepping mixed-up parameters (or hanging).
std::vector<std::string> errors_of_diverging_ranks(bool skip, bool scoped = false) {
  std::mutex mutex;
  std::vector<std::string> errors;
  run_ranks(2,
            [&](comm::ProcessGroup& g) {
              auto net = TwoUnits();
              torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
              ZeroOptimizer zero(net.ptr(), sgd, g, zero_options(3));
              try {
                for (int step = 0; step < 3; ++step) {
                  zero.zero_grad();
                  auto x = torch::ones({4, 8});
                  const bool diverge = step == 1 && g.rank() == 1;
                  std::optional<ZeroOptimizer::StepOrderScope> order;
                  if (scoped) order.emplace(zero);
                  auto out = diverge && skip ? net->a->forward(x) : net->forward(x, diverge);
                  out.sum().backward();
                  if (order) order->close();
                  zero.step();
                }
              } catch (const std::exception& e) {
                std::lock_guard lock(mutex);
                errors.push_back(e.what());
              }
            },
            {.timeout = std::chrono::seconds(5)});
  return errors;
}

TEST(ZeroOptimizer, StageThreeRanksRunningOtherUnitsFailNamingThem) {
  const auto swapped = errors_of_diverging_ranks(/*skip=*/false);
  ASSERT_EQ(swapped.size(), 2u) << "every rank fails";
  for (const auto& e : swapped) {
    EXPECT_NE(e.find("ranks [1] ran other FullyShard units, or in another order, than rank 0"),
              std::string::npos)
        << e;
  }
  const auto skipped = errors_of_diverging_ranks(/*skip=*/true);
  ASSERT_FALSE(skipped.empty());
  std::string all;
  for (const auto& e : skipped) all += e + "\n";
  EXPECT_NE(all.find("ZeRO"), std::string::npos) << all;
  // In a StepOrderScope, checked at its close.
  const auto scoped = errors_of_diverging_ranks(/*skip=*/false, /*scoped=*/true);
  ASSERT_EQ(scoped.size(), 2u) << "every rank fails";
  for (const auto& e : scoped) {
    EXPECT_NE(e.find("ranks [1] ran other FullyShard units, or in another order, than rank 0"),
              std::string::npos)
        << e;
  }
}

TEST(ZeroOptimizer, StageThreeNeedsUnitsThatDoNotNest) {
  using cohort::testing::expect_error;
  run_ranks(1, [](comm::ProcessGroup& g) {
    auto plain = torch::nn::Linear(4, 4);
    torch::optim::SGD sgd(plain->parameters(), torch::optim::SGDOptions(0.1));
    expect_error<UsageError>([&] { ZeroOptimizer zero(plain.ptr(), sgd, g, zero_options(3)); },
                             "has none: hold its blocks through parallel::FullyShard");
    auto nested = FullyShard(TwoUnits());
    torch::optim::SGD nested_sgd(nested->parameters(), torch::optim::SGDOptions(0.1));
    expect_error<UsageError>(
        [&] { ZeroOptimizer zero(nested.ptr(), nested_sgd, g, zero_options(3)); },
        "FullyShard unit 'a' is inside unit '(the model)': units do not nest");
  });
}

TEST(ZeroOptimizer, BadOptionsAndMisuseAreNamed) {
  using cohort::testing::expect_error;
  expect_error<UsageError>([] { ZeroOptions{.stage = 4}.validate(); }, "ZeRO stage 4 is not one");
  expect_error<UsageError>(
      [] { ZeroOptions{.stage = 3, .param_persistence_threshold = -1}.validate(); },
      "param_persistence_threshold -1 must be >= 0");
  expect_error<UsageError>([] { ZeroOptions{.stage = 2, .reduce_bucket_size = 0}.validate(); },
                           "reduce_bucket_size 0 must be > 0");
  expect_error<UsageError>([] { ZeroOptions{.stage = 1, .allgather_bucket_size = -5}.validate(); },
                           "allgather_bucket_size -5 must be > 0");
  run_ranks(2, [](comm::ProcessGroup& g) {
    auto net = make_zero_net();
    expect_error<UsageError>(
        [&] {
          torch::optim::Adagrad other(net->parameters());
          ZeroOptimizer zero(net.ptr(), other, g, {.stage = 1});
        },
        "neither SGD, Adam nor AdamW");
    expect_error<UsageError>(
        [&] {
          torch::optim::SGD partial(net->head->parameters(), torch::optim::SGDOptions(0.1));
          ZeroOptimizer zero(net.ptr(), partial, g, {.stage = 1});
        },
        "is not in the optimizer");
    auto plain = adamw(net);
    ZeroOptimizer zero(net.ptr(), *plain, g, {.stage = 2});
    expect_error<UsageError>([&] { zero.step(); }, "no synchronised backward since the last step");
    {
      auto guard = zero.no_sync();
      loss_of(net, g.rank(), 0, 0, 1).backward();
    }
    expect_error<UsageError>([&] { zero.step(); }, "run backward outside no_sync() first");
  });
}

}  // namespace
}  // namespace cohort::parallel

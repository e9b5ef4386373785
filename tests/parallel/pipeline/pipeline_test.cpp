#include "cohort/parallel/pipeline/pipeline.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <future>
#include <map>
#include <mutex>

#include "cohort/optim/precision.h"
#include "cohort/parallel/fully_shard.h"
#include "cohort/parallel/local_sgd.h"
#include "cohort/parallel/mesh.h"
#include "cohort/parallel/zero_optimizer.h"
#include "support/cuda.h"
#include "support/expect.h"
#include "support/local_group.h"

namespace cohort::parallel::pipeline {
namespace {

using cohort::testing::expect_error;
using cohort::testing::generator_mutex;
using cohort::testing::run_ranks;

// Seven layers, the same weights on every rank and run.
torch::nn::Sequential make_mlp() {
  std::lock_guard lock(generator_mutex());
  torch::manual_seed(11);
  return torch::nn::Sequential(
      torch::nn::Linear(8, 16), torch::nn::Tanh(), torch::nn::Linear(16, 16), torch::nn::Tanh(),
      torch::nn::Linear(16, 16), torch::nn::Tanh(), torch::nn::Linear(16, 4));
}

// make_mlp()'s layers and weights (the same seed and order), each linear layer a unit of ZeRO
// stage 3.
torch::nn::Sequential make_sharded_mlp() {
  std::lock_guard lock(generator_mutex());
  torch::manual_seed(11);
  return torch::nn::Sequential(FullyShard(torch::nn::Linear(8, 16)), torch::nn::Tanh(),
                               FullyShard(torch::nn::Linear(16, 16)), torch::nn::Tanh(),
                               FullyShard(torch::nn::Linear(16, 16)), torch::nn::Tanh(),
                               FullyShard(torch::nn::Linear(16, 4)));
}

std::pair<torch::Tensor, torch::Tensor> make_batch(int64_t rows) {
  std::lock_guard lock(generator_mutex());
  torch::manual_seed(12);
  return {torch::randn({rows, 8}), torch::randint(0, 4, {rows})};
}

at::Tensor cross_entropy(const at::Tensor& output, const at::Tensor& target) {
  return torch::nn::functional::cross_entropy(output, target);
}

struct Case {
  ScheduleKind schedule;
  int ranks;
  int virtual_stages;
  int micro_batches;
  int64_t rows;
  torch::Device device = torch::kCPU;  // the stages' (ranks on a GPU share it through Gloo)
};

// Every rank's stages against the whole model on the whole batch: the same loss and gradients.
void expect_same_as_unpipelined(const Case& c) {
  SCOPED_TRACE(std::string(to_string(c.schedule)) + " p=" + std::to_string(c.ranks) +
               " v=" + std::to_string(c.virtual_stages) + " m=" + std::to_string(c.micro_batches) +
               " rows=" + std::to_string(c.rows) + " on " + c.device.str());
  const auto [x, y] = make_batch(c.rows);
  torch::nn::Sequential whole = make_mlp();
  const at::Tensor expected_loss = cross_entropy(whole->forward(x), y);
  expected_loss.backward();
  std::map<std::string, at::Tensor> expected_grads;
  for (const auto& p : whole->named_parameters()) expected_grads[p.key()] = p.value().grad();

  const int stages = c.ranks * c.virtual_stages;
  const auto options = c.device.is_cuda()
                           ? testing::gpu_group_options()
                           : comm::ProcessGroupOptions{.timeout = std::chrono::seconds(30)};
  run_ranks(
      c.ranks,
      [&](comm::ProcessGroup& group) {
        auto all = split_sequential(make_mlp(), even_split(7, stages));
        std::vector<Stage> mine;
        for (int s : PipelineLayout{c.ranks, c.virtual_stages}.stages_of(group.rank())) {
          all[s]->to(c.device);
          mine.emplace_back(all[s]);
        }
        Pipeline pipeline(std::move(mine), group, cross_entropy,
                          {.schedule = c.schedule,
                           .micro_batches = c.micro_batches,
                           .virtual_stages = c.virtual_stages});
        const at::Tensor loss = pipeline.step(x.to(c.device), y.to(c.device));
        if (pipeline.is_last()) {
          ASSERT_TRUE(loss.defined());
          EXPECT_NEAR(loss.item<double>(), expected_loss.item<double>(), 1e-5);
        } else {
          EXPECT_FALSE(loss.defined());
        }
        for (const Stage& stage : pipeline.stages()) {
          for (const auto& p : stage.module().named_parameters()) {
            ASSERT_TRUE(p.value().grad().defined()) << p.key();
            EXPECT_TRUE(
                torch::allclose(p.value().grad().cpu(), expected_grads.at(p.key()), 1e-5, 1e-7))
                << p.key() << " on rank " << group.rank();
          }
        }
      },
      options);
}

TEST(Pipeline, EveryScheduleGivesTheGradientsOfTheWholeModel) {
  for (ScheduleKind kind :
       {ScheduleKind::kGPipe, ScheduleKind::kOneFOneB, ScheduleKind::kZeroBubble}) {
    expect_same_as_unpipelined({kind, 2, 1, 4, 16});
    // Fewer micro-batches than stages, and micro-batches of unequal rows (10 = 3 + 3 + 2 + 2).
    expect_same_as_unpipelined({kind, 4, 1, 1, 6});
    expect_same_as_unpipelined({kind, 4, 1, 4, 10});
  }
  expect_same_as_unpipelined({ScheduleKind::kInterleaved, 2, 2, 4, 12});
  expect_same_as_unpipelined({ScheduleKind::kInterleaved, 2, 3, 2, 8});
  // One rank: every stage local, no messages.
  expect_same_as_unpipelined({ScheduleKind::kInterleaved, 1, 3, 3, 9});
}

// Under bf16 autocast the first step (which probes the stages' shapes with a no-grad forward)
// gives every weight the gradient every later step gives: the probe's cached casts, made without
// autograd history, must not reach the step's forward.
TEST(Pipeline, TheFirstStepUnderAutocastComputesEveryGradient) {
  run_ranks(2, [](comm::ProcessGroup& group) {
    const auto stages = split_sequential(make_mlp(), {4, 3});
    torch::nn::Sequential mine = stages[size_t(group.rank())];
    Pipeline pipe({mine}, group, cross_entropy, {.micro_batches = 2});
    const auto [x, y] = make_batch(8);
    std::vector<std::vector<at::Tensor>> grads;
    for (int step = 0; step < 2; ++step) {
      for (auto& p : mine->parameters()) p.mutable_grad() = at::Tensor();
      optim::AutocastGuard autocast(optim::Precision::kBf16, c10::Device(c10::kCPU));
      pipe.step(x, y);
      grads.emplace_back();
      for (const auto& p : mine->parameters()) {
        ASSERT_TRUE(p.grad().defined()) << "step " << step + 1 << ", rank " << group.rank();
        grads.back().push_back(p.grad().clone());
      }
    }
    for (size_t i = 0; i < grads[0].size(); ++i)
      EXPECT_TRUE(torch::equal(grads[0][i], grads[1][i])) << "parameter " << i;
  });
}

// Stages on the GPU, activations and gradients between ranks through Gloo's host copies.
TEST(Pipeline, EveryScheduleRunsOnTheGpu) {
  COHORT_REQUIRE_CUDA();
  for (ScheduleKind kind :
       {ScheduleKind::kGPipe, ScheduleKind::kOneFOneB, ScheduleKind::kZeroBubble}) {
    expect_same_as_unpipelined({kind, 2, 1, 4, 16, torch::kCUDA});
  }
  expect_same_as_unpipelined({ScheduleKind::kInterleaved, 2, 2, 4, 12, torch::kCUDA});
}

TEST(Pipeline, RepeatedStepsAccumulateTheOptimizerStepRunsOnceAndTheTimelineIsKept) {
  run_ranks(2, [](comm::ProcessGroup& group) {
    const auto all = split_sequential(make_mlp(), {4, 3});
    int steps = 0;
    Pipeline pipeline(
        {all[group.rank()]}, group, cross_entropy,
        {.micro_batches = 2, .optimizer_step = [&] { ++steps; }, .record_timeline = true});
    const auto [x, y] = make_batch(8);
    pipeline.step(x, y);
    // The timeline: every action of this rank's list, in order, one after the other.
    const auto& timeline = pipeline.timeline();
    const auto& actions = pipeline.program().ranks[group.rank()];
    ASSERT_EQ(timeline.size(), actions.size());
    for (size_t i = 0; i < timeline.size(); ++i) {
      EXPECT_EQ(timeline[i].action, actions[i]);
      EXPECT_LE(timeline[i].start, timeline[i].end);
      if (i > 0) {
        EXPECT_GE(timeline[i].start, timeline[i - 1].end);
      }
    }
    const double bubble = measured_bubble({timeline});
    EXPECT_GE(bubble, 0.0);
    EXPECT_LT(bubble, 1.0);
    std::vector<at::Tensor> once;
    for (const auto& p : pipeline.parameters()) once.push_back(p.grad().clone());
    pipeline.step(x, y);
    EXPECT_EQ(steps, 2);
    const auto params = pipeline.parameters();
    for (size_t i = 0; i < params.size(); ++i)
      EXPECT_TRUE(torch::allclose(params[i].grad(), 2 * once[i], 1e-5, 1e-7));
  });
}

// The timeline's heap readings show what a schedule keeps alive: on one rank, GPipe holds every
// micro-batch's activations before the first backward, 1F1B one at a time.
TEST(Pipeline, TheTimelinesHeapShowsGPipeHoldingEveryMicroBatch) {
  if (heap_bytes_in_use() < 0) GTEST_SKIP() << "the C library does not report its heap";
  constexpr int kMicroBatches = 8;
  std::map<ScheduleKind, int64_t> peak;
  run_ranks(1, [&](comm::ProcessGroup& group) {
    torch::nn::Sequential wide = [] {
      std::lock_guard lock(generator_mutex());
      torch::manual_seed(3);
      return torch::nn::Sequential(torch::nn::Linear(64, 1024), torch::nn::Tanh(),
                                   torch::nn::Linear(1024, 1024), torch::nn::Tanh(),
                                   torch::nn::Linear(1024, 4));
    }();
    const at::Tensor x = torch::ones({kMicroBatches * 32, 64});
    const at::Tensor y = torch::zeros({kMicroBatches * 32}, torch::kLong);
    for (const auto kind : {ScheduleKind::kGPipe, ScheduleKind::kOneFOneB}) {
      Pipeline pipe({wide}, group, cross_entropy,
                    {.schedule = kind, .micro_batches = kMicroBatches, .record_timeline = true});
      for (int step = 0; step < 2; ++step) {  // the second step: gradients already allocated
        const int64_t before = heap_bytes_in_use();
        pipe.step(x, y);
        int64_t most = 0;
        for (const auto& t : pipe.timeline()) most = std::max(most, t.heap_bytes - before);
        peak[kind] = most;
      }
    }
  });
  std::printf(
      "peak heap growth over a step of 8 micro-batches on one rank: gpipe %.2f MB, "
      "1f1b %.2f MB\n",
      peak[ScheduleKind::kGPipe] / 1e6, peak[ScheduleKind::kOneFOneB] / 1e6);
  // A micro-batch's activations: 32 rows x 4 x 1024 floats (two Linear outputs, two Tanh
  // outputs), about 0.5 MB.
  EXPECT_GT(peak[ScheduleKind::kGPipe], 4 * 400'000) << "GPipe: " << peak[ScheduleKind::kGPipe];
  EXPECT_GT(peak[ScheduleKind::kGPipe], 2 * peak[ScheduleKind::kOneFOneB])
      << "GPipe " << peak[ScheduleKind::kGPipe] << " B, 1F1B " << peak[ScheduleKind::kOneFOneB]
      << " B";
}

TEST(Pipeline, AStageThatCannotTakeThePreviousOutputIsNamedOnBothRanks) {
  std::mutex mutex;
  std::vector<std::string> errors;
  run_ranks(2, [&](comm::ProcessGroup& group) {
    // Stage 0 ends in 16 features; stage 1 starts with a Linear of 12 inputs.
    torch::nn::Sequential stage =
        group.rank() == 0 ? torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::Tanh())
                          : torch::nn::Sequential(torch::nn::Linear(12, 4));
    Pipeline pipeline({stage}, group, cross_entropy, {.micro_batches = 2});
    const auto [x, y] = make_batch(8);
    try {
      pipeline.step(x, y);
      ADD_FAILURE() << "no error on rank " << group.rank();
    } catch (const UsageError& e) {
      std::lock_guard lock(mutex);
      errors.push_back(e.what());
    }
  });
  ASSERT_EQ(errors.size(), 2u);
  EXPECT_EQ(errors[0], errors[1]);
  EXPECT_NE(errors[0].find("stage 1 (rank 1) cannot take stage 0's output [4, 16] Float"),
            std::string::npos)
      << errors[0];
  EXPECT_NE(errors[0].find("make stage 0's output match stage 1's input"), std::string::npos)
      << errors[0];
}

TEST(Pipeline, AWaitThatTimesOutNamesTheStageMicroBatchAndAction) {
  std::promise<void> rank0_done;
  auto done = rank0_done.get_future().share();
  run_ranks(2,
            [&](comm::ProcessGroup& group) {
              const auto all = split_sequential(make_mlp(), {4, 3});
              Pipeline pipeline({all[group.rank()]}, group, cross_entropy, {.micro_batches = 2});
              const auto [x, y] = make_batch(8);
              pipeline.step(x, y);
              if (group.rank() == 1) {
                done.wait();  // alive, but skips the second step
                return;
              }
              try {
                pipeline.step(x, y);
                ADD_FAILURE() << "no timeout";
              } catch (const TimeoutError& e) {
                EXPECT_NE(std::string(e.what()).find(
                              "recv (gloo) on rank 0 in pipeline rank 0, recv gradient of stage 0, "
                              "micro-batch 0 did not complete within 500 ms"),
                          std::string::npos)
                    << e.what();
              }
              rank0_done.set_value();
            },
            {.timeout = std::chrono::milliseconds(500)});
}

// A dp x pp mesh whose data parallelism is ZeRO: every stage's parameters after some Adam steps
// as one process's on the whole batch, with the optimizer state (stage 3: and the parameters)
// sharded over the dp group.
TEST(Pipeline, ZeroShardsTheDataParallelismOfEverySchedule) {
  constexpr int kSteps = 4, kDp = 2, kPp = 2;
  constexpr int64_t kRows = 16;  // the global batch, kRows / kDp per dp rank
  auto global_batch = [](int step) {
    std::lock_guard lock(generator_mutex());
    torch::manual_seed(100 + step);
    return std::pair{torch::randn({kRows, 8}), torch::randint(0, 4, {kRows})};
  };
  torch::nn::Sequential reference = make_mlp();
  torch::optim::Adam reference_adam(reference->parameters(), torch::optim::AdamOptions(0.01));
  for (int step = 0; step < kSteps; ++step) {
    const auto [x, y] = global_batch(step);
    reference_adam.zero_grad();
    cross_entropy(reference->forward(x), y).backward();
    reference_adam.step();
  }
  std::map<std::string, at::Tensor> expected;
  for (const auto& p : reference->named_parameters()) expected[p.key()] = p.value();

  struct ZeroCase {
    ScheduleKind schedule;
    int virtual_stages;
    int zero_stage;
  };
  for (const ZeroCase c :
       {ZeroCase{ScheduleKind::kOneFOneB, 1, 1}, ZeroCase{ScheduleKind::kInterleaved, 2, 2},
        ZeroCase{ScheduleKind::kZeroBubble, 1, 2}, ZeroCase{ScheduleKind::kOneFOneB, 1, 3},
        ZeroCase{ScheduleKind::kInterleaved, 2, 3}, ZeroCase{ScheduleKind::kZeroBubble, 1, 3},
        ZeroCase{ScheduleKind::kGPipe, 1, 3}}) {
    SCOPED_TRACE(std::string(to_string(c.schedule)) + " with ZeRO stage " +
                 std::to_string(c.zero_stage));
    run_ranks(kDp * kPp, [&](comm::ProcessGroup& world) {
      const DeviceMesh mesh = DeviceMesh::create(world, {.dp = kDp, .pp = kPp, .tp = 1});
      const auto all = split_sequential(c.zero_stage == 3 ? make_sharded_mlp() : make_mlp(),
                                        even_split(7, kPp * c.virtual_stages));
      std::vector<Stage> mine;
      for (int s : PipelineLayout{kPp, c.virtual_stages}.stages_of(mesh.pp_index()))
        mine.emplace_back(all[s]);
      Pipeline pipe(std::move(mine), mesh.pp(), cross_entropy,
                    {.schedule = c.schedule,
                     .micro_batches = 4,
                     .virtual_stages = c.virtual_stages,
                     .data_parallel_group = mesh.dp(),
                     .zero = {.stage = c.zero_stage,
                              .reduce_bucket_size = 100,
                              .param_persistence_threshold = 0}});
      // The stages' layers under the whole model's names, what the shards are named by.
      std::vector<std::string> names;
      for (const Stage& stage : pipe.stages())
        for (const auto& p : stage.module().named_parameters()) names.push_back(p.key());
      EXPECT_EQ(pipe.module()->named_parameters().keys(), names);
      auto optimizer = pipe.prepare_optimizer(
          std::make_unique<torch::optim::Adam>(pipe.parameters(), torch::optim::AdamOptions(0.01)));
      const auto& zero = dynamic_cast<const ZeroOptimizer&>(*optimizer);
      EXPECT_EQ(zero.stats().shard_numel * kDp, zero.stats().padded_numel);
      for (int step = 0; step < kSteps; ++step) {
        const auto [x, y] = global_batch(step);
        optimizer->zero_grad();
        pipe.step(x.chunk(kDp)[mesh.dp_index()], y.chunk(kDp)[mesh.dp_index()]);
        optimizer->step();
      }
      EXPECT_EQ(zero.stats().synchronized_steps, kSteps);
      if (c.zero_stage == 3) {
        // Each rank's two linear layers are units, held as their shards between steps.
        EXPECT_EQ(zero.stats().units, 2);
        EXPECT_EQ(zero.stats().parameter_bytes * kDp,
                  zero.stats().padded_numel * static_cast<int64_t>(sizeof(float)));
        // The step's whole order guides the next (Pipeline::step's StepOrderScope): it never
        // changes, after the first step at least one use a micro-batch is gathered ahead, and
        // no more than one gather a step goes unused. A unit's uses: a forward and a backward per
        // micro-batch (zero-bubble's last stage: a backward in two passes, inputs and weights).
        // With the order of the forwards since the last backward instead, interleaved's changed
        // 4 times on the first stage and 12 on the last, gathering 4 units ahead in 4 steps
        // there, and the first stages gathered 70 times for 64 uses.
        const bool two_passes =
            c.schedule == ScheduleKind::kZeroBubble && mesh.pp_index() == kPp - 1;
        const int64_t uses = kSteps * 2 * 4 * (two_passes ? 3 : 2);
        EXPECT_EQ(zero.stats().order_changes, 0);
        EXPECT_GE(zero.stats().prefetches, (kSteps - 1) * 4);
        EXPECT_LE(zero.stats().gathers, uses + kSteps);
      }
      const ZeroOptimizer::GatheredParameters whole(zero);
      for (const auto& p : pipe.module()->named_parameters()) {
        EXPECT_TRUE(torch::allclose(p.value(), expected.at(p.key()), 1e-5, 1e-6))
            << p.key() << " on rank " << world.rank() << ": largest difference "
            << (p.value() - expected.at(p.key())).abs().max().item<double>();
      }
    });
  }
}

TEST(Pipeline, ZeroAndLocalSgdBadInputIsNamed) {
  run_ranks(2, [](comm::ProcessGroup& group) {
    const auto all = split_sequential(make_mlp(), {4, 3});
    const comm::ProcessGroup alone = group.split({{0}, {1}}, "dp");
    expect_error<UsageError>(
        [&] { Pipeline({all[group.rank()]}, group, cross_entropy, {.zero = {.stage = 1}}); },
        "needs the data-parallel group it shards over");
    Pipeline pipe({all[group.rank()]}, group, cross_entropy,
                  {.micro_batches = 2, .data_parallel_group = alone, .zero = {.stage = 2}});
    const auto [x, y] = make_batch(8);
    expect_error<UsageError>([&] { pipe.step(x, y); },
                             "pass the optimizer through Pipeline::prepare_optimizer");
    auto optimizer =
        pipe.prepare_optimizer(std::make_unique<torch::optim::SGD>(pipe.parameters(), 0.1));
    expect_error<UsageError>(
        [&] {
          pipe.prepare_optimizer(std::make_unique<torch::optim::SGD>(pipe.parameters(), 0.1));
        },
        "called twice");
    // A dp group of one: ZeRO shards nothing, and the pipeline trains.
    optimizer->zero_grad();
    pipe.step(x, y);
    optimizer->step();
    EXPECT_EQ(dynamic_cast<const ZeroOptimizer&>(*optimizer).stats().synchronized_steps, 1);
    // Local SGD and DiLoCo instead.
    expect_error<UsageError>(
        [&] {
          Pipeline({all[group.rank()]}, group, cross_entropy,
                   {.data_parallel_group = alone, .zero = {.stage = 1}, .sync = LocalSgd{}});
        },
        "sync local-sgd:8 cannot be combined with ZeRO stage 1");
    expect_error<UsageError>(
        [&] {
          Pipeline({all[group.rank()]}, group, cross_entropy,
                   {.data_parallel_group = alone, .sync = AsyncParameterServer{}});
        },
        "serves whole models, not a pipeline's stages");
    expect_error<UsageError>(
        [&] { Pipeline({all[group.rank()]}, group, cross_entropy, {.sync = DiLoCo{}}); },
        "needs the data-parallel group whose replicas it averages");
    expect_error<UsageError>(
        [&] {
          Pipeline({all[group.rank()]}, group, cross_entropy,
                   {.data_parallel_group = alone, .sync = LocalSgd{.every = 0}});
        },
        "local SGD: every 0");
    Pipeline local_pipe({all[group.rank()]}, group, cross_entropy,
                        {.micro_batches = 2, .data_parallel_group = alone, .sync = DiLoCo{}});
    expect_error<UsageError>([&] { local_pipe.step(x, y); },
                             "pass the optimizer through Pipeline::prepare_optimizer");
    auto local_optimizer = local_pipe.prepare_optimizer(
        std::make_unique<torch::optim::SGD>(local_pipe.parameters(), 0.1));
    EXPECT_NE(dynamic_cast<LocalSgdOptimizer*>(local_optimizer.get()), nullptr);
    expect_error<UsageError>(
        [&] {
          local_pipe.prepare_optimizer(
              std::make_unique<torch::optim::SGD>(local_pipe.parameters(), 0.1));
        },
        "called twice");
    local_optimizer->zero_grad();
    local_pipe.step(x, y);
    local_optimizer->step();
    EXPECT_EQ(dynamic_cast<const LocalSgdOptimizer&>(*local_optimizer).stats().inner_steps, 1);
  });
}

// A first layer whose weight the last layer reads again, transposed: a tied embedding and head.
struct TiedHeadImpl : torch::nn::Module {
  explicit TiedHeadImpl(torch::nn::Linear first_layer)
      : first(register_module("first", std::move(first_layer))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return torch::nn::functional::linear(x, first->weight.t());
  }
  torch::nn::Linear first;
};
TORCH_MODULE(TiedHead);

// Six layers, 8 -> 16 -> 16 -> 16 -> 8, whose first and last share the first's weight; the two
// in the middle (and with `first_in_unit` the first) units of ZeRO stage 3, one in each half.
torch::nn::Sequential make_tied_mlp(bool first_in_unit = false) {
  std::lock_guard lock(generator_mutex());
  torch::manual_seed(13);
  torch::nn::Linear first(torch::nn::LinearOptions(8, 16).bias(false));
  torch::nn::Sequential net;
  if (first_in_unit) {
    net->push_back(FullyShard(first));
  } else {
    net->push_back(first);
  }
  net->push_back(torch::nn::Tanh());
  net->push_back(FullyShard(torch::nn::Linear(16, 16)));
  net->push_back(torch::nn::Tanh());
  net->push_back(FullyShard(torch::nn::Linear(16, 16)));
  net->push_back(TiedHead(first));
  return net;
}

// A weight that the first stage and the last share, on a 2 x 2 mesh (dp x pp) with DDP or ZeRO
// 1-3 and clipping by the global norm: each copy takes the step of one process that trains the
// whole model, and the two copies stay equal bit for bit.
TEST(Pipeline, ATiedParameterStepsAsOneAcrossItsStagesRanks) {
  constexpr int kSteps = 4;
  constexpr double kLr = 0.2, kMaxNorm = 0.5;
  // One process: the shared weight once in the optimizer, its gradient from both layers.
  torch::nn::Sequential reference = make_tied_mlp();
  std::vector<at::Tensor> unique;
  for (const auto& p : reference->named_parameters())
    if (p.key() != "5.first.weight") unique.push_back(p.value());
  torch::optim::SGD reference_sgd(unique, kLr);
  std::vector<double> reference_norms;
  for (int step = 0; step < kSteps; ++step) {
    const auto [x, y] = make_batch(8);
    reference_sgd.zero_grad();
    cross_entropy(reference->forward(x * (step + 1)), y).backward();
    reference_norms.push_back(torch::nn::utils::clip_grad_norm_(unique, kMaxNorm));
    reference_sgd.step();
  }
  ASSERT_GT(*std::max_element(reference_norms.begin(), reference_norms.end()), kMaxNorm)
      << "the test must clip";
  for (const int zero_stage : {0, 1, 2, 3}) {
    SCOPED_TRACE("ZeRO stage " + std::to_string(zero_stage));
    std::mutex mutex;
    std::map<int, at::Tensor> copies;  // by world rank: the shared weight after the steps
    run_ranks(4, [&](comm::ProcessGroup& world) {
      const DeviceMesh mesh = DeviceMesh::create(world, {.dp = 2, .pp = 2, .tp = 1});
      const auto all = split_sequential(make_tied_mlp(), even_split(6, 2));
      const auto tied = find_tied_parameters(all, {.ranks = 2}, mesh.pp_index());
      ASSERT_EQ(tied.size(), 1u);
      EXPECT_EQ(tied[0].name, "0.weight");
      EXPECT_EQ(tied[0].ranks, (std::vector<int>{0, 1}));
      const auto stage = all[static_cast<size_t>(mesh.pp_index())];
      // Named, the tied parameters set apart: GCC 12 warns of a designated temporary's
      // DdpOptions. Small buckets: the tied weight's is its own, the others' apart from it.
      PipelineOptions options{.micro_batches = 2, .data_parallel_group = mesh.dp()};
      options.zero = {
          .stage = zero_stage, .reduce_bucket_size = 64, .param_persistence_threshold = 0};
      options.tied_parameters = tied;
      Pipeline pipe({stage}, mesh.pp(), cross_entropy, options);
      EXPECT_EQ(pipe.tied_parameters().size(), 1u);
      auto optimizer =
          pipe.prepare_optimizer(std::make_unique<torch::optim::SGD>(stage->parameters(), kLr));
      for (int step = 0; step < kSteps; ++step) {
        const auto [x, y] = make_batch(8);
        optimizer->zero_grad();
        pipe.step((x * (step + 1)).chunk(2)[mesh.dp_index()], y.chunk(2)[mesh.dp_index()]);
        const double norm =
            clip_grad_norm(mesh, *pipe.module(), *optimizer, kMaxNorm, tied).item<double>();
        EXPECT_NEAR(norm, reference_norms[step], 1e-5 * reference_norms[step])
            << "step " << step << " on rank " << world.rank();
        optimizer->step();
      }
      std::optional<ZeroOptimizer::GatheredParameters> whole;
      if (zero_stage > 0) whole.emplace(dynamic_cast<const ZeroOptimizer&>(*optimizer));
      const auto want = reference->named_parameters();
      for (const auto& p : stage->named_parameters()) {
        EXPECT_TRUE(torch::allclose(p.value(), want[p.key()], 1e-5, 1e-6))
            << p.key() << " on rank " << world.rank() << ": largest difference "
            << (p.value() - want[p.key()]).abs().max().item<double>();
      }
      std::lock_guard lock(mutex);
      copies[world.rank()] = tied[0].parameter.detach().clone();
    });
    // World ranks 0 and 1 hold the first and the last stage of one pipeline, 2 and 3 of the
    // other.
    ASSERT_EQ(copies.size(), 4u);
    EXPECT_TRUE(torch::equal(copies[0], copies[1]));
    EXPECT_TRUE(torch::equal(copies[2], copies[3]));
    EXPECT_TRUE(torch::equal(copies[0], copies[2]));
  }
}

TEST(Pipeline, TiedParametersThatCannotStayEqualAreNamed) {
  // Both stages on one rank: its optimizer would step the weight twice.
  expect_error<UsageError>(
      [] {
        find_tied_parameters(split_sequential(make_tied_mlp(), {3, 3}),
                             {.ranks = 1, .virtual_stages = 2}, 0);
      },
      "parameter '0.weight' is in two stages of pipeline rank 0 (stages 0 and 1)");
  expect_error<UsageError>(
      [] {
        find_tied_parameters(split_sequential(make_tied_mlp(), {3, 3}), {.ranks = 1}, 0);
      },
      "2 stages given for a layout of 1");
  run_ranks(2, [](comm::ProcessGroup& group) {
    const auto all = split_sequential(make_tied_mlp(), {3, 3});
    const auto tied = find_tied_parameters(all, {.ranks = 2}, group.rank());
    // ZeRO-3 inside a unit: gathered and reduced whole with the unit, not apart.
    const comm::ProcessGroup alone = group.split({{0}, {1}}, "dp");
    const auto in_unit = split_sequential(make_tied_mlp(/*first_in_unit=*/true), {3, 3});
    PipelineOptions sharded{.data_parallel_group = alone,
                            .zero = {.stage = 3, .param_persistence_threshold = 0}};
    sharded.tied_parameters = find_tied_parameters(in_unit, {.ranks = 2}, group.rank());
    Pipeline pipe({in_unit[group.rank()]}, group, cross_entropy, sharded);
    const auto prepare = [&] {
      pipe.prepare_optimizer(std::make_unique<torch::optim::SGD>(pipe.parameters(), 0.1));
    };
    if (group.rank() == 0) {
      expect_error<UsageError>(prepare, "parameter '0.weight' is in FullyShard unit '0'");
    } else {
      prepare();  // the last stage holds its copy in the head, outside every unit
    }
    PipelineOptions elsewhere;
    elsewhere.tied_parameters = tied;
    elsewhere.tied_parameters[0].ranks = {1 - group.rank(), 2};
    expect_error<UsageError>(
        [&] { Pipeline({all[group.rank()]}, group, cross_entropy, elsewhere); },
        "tied parameter '0.weight' needs this rank's copy");
  });
}

TEST(Pipeline, BadInputIsNamed) {
  EXPECT_THROW(even_split(7, 8), UsageError);
  EXPECT_EQ(even_split(7, 3), (std::vector<int>{3, 2, 2}));
  EXPECT_THROW(split_sequential(make_mlp(), {3, 3}), UsageError);
  EXPECT_THROW(split_sequential(make_mlp(), {7, 0}), UsageError);
  run_ranks(2, [](comm::ProcessGroup& group) {
    const auto all = split_sequential(make_mlp(), {4, 3});
    EXPECT_THROW(Pipeline({all[0], all[1]}, group, cross_entropy), UsageError);
    EXPECT_THROW(Pipeline({all[group.rank()]}, group, cross_entropy, {.micro_batches = 0}),
                 UsageError);
    Pipeline pipeline({all[group.rank()]}, group, cross_entropy, {.micro_batches = 4});
    const auto [x, y] = make_batch(3);
    try {
      pipeline.step(x, y);
      ADD_FAILURE() << "no error";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("a batch of 3 rows cannot be split into 4 "
                                           "micro-batches"),
                std::string::npos)
          << e.what();
    }
  });
}

TEST(Pipeline, SplitKeepsTheLayerNamesAndBalancingFollowsTheCost) {
  const auto stages = split_sequential(make_mlp(), {2, 5});
  EXPECT_EQ(
      stages[1]->named_parameters().keys(),
      (std::vector<std::string>{"2.weight", "2.bias", "4.weight", "4.bias", "6.weight", "6.bias"}));
  // Four heavy layers, then four nearly free ones: an even cut puts all the work in stage 0.
  torch::nn::Sequential model;
  for (int i = 0; i < 4; ++i) model->push_back(torch::nn::Linear(384, 384));
  for (int i = 0; i < 4; ++i) model->push_back(torch::nn::Identity());
  // Measured on one thread, the fastest of 9 runs: on a loaded machine (CI's lanes side by side)
  // a layer's two threads wait for each other, and 3 runs once all came out slow (a {3, 5} cut).
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  const auto cut = balanced_split(model, 2, torch::randn({256, 384}), /*repeats=*/9);
  at::set_num_threads(threads);
  EXPECT_EQ(cut, (std::vector<int>{2, 6}));
}

}  // namespace
}  // namespace cohort::parallel::pipeline

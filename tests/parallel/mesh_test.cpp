#include "cohort/parallel/mesh.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <mutex>
#include <set>

#include "cohort/error.h"
#include "cohort/parallel/local_sgd.h"
#include "cohort/parallel/pipeline/pipeline.h"
#include "cohort/parallel/tensor_parallel.h"
#include "support/local_group.h"

namespace cohort::parallel {
namespace {

using cohort::testing::generator_mutex;
using cohort::testing::run_ranks;

TEST(Mesh, DegreesMultiplyToTheWorldOrTheErrorSaysHow) {
  EXPECT_EQ(resolve_mesh({.pp = 2, .tp = 2}, 8).dp, 2);
  const MeshShape full = resolve_mesh({.dp = 2, .pp = 2, .tp = 2}, 8);
  EXPECT_EQ(to_string(full), "dp 2 x pp 2 x tp 2");
  auto message = [](MeshShape shape, int world) {
    try {
      resolve_mesh(shape, world);
    } catch (const UsageError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(message({.dp = 2, .pp = 2, .tp = 3}, 8),
            "the parallel degrees dp 2 x pp 2 x tp 3 = 12 do not match the 8 workers: make them "
            "multiply to 8 (or leave dp at 0 to take the rest)");
  EXPECT_NE(message({.pp = 3}, 8).find("does not divide the 8 workers"), std::string::npos);
  EXPECT_NE(message({.pp = 0}, 8).find("must be >= 1"), std::string::npos);
}

TEST(Mesh, EachRankGetsItsDataPipelineAndTensorGroups) {
  run_ranks(8, [](comm::ProcessGroup& world) {
    const DeviceMesh mesh = DeviceMesh::create(world, {.dp = 2, .pp = 2, .tp = 2});
    const int r = world.rank();
    EXPECT_EQ(mesh.rank_of(mesh.dp_index(), mesh.pp_index(), mesh.tp_index()), r);
    EXPECT_EQ(mesh.tp_index(), r % 2);
    EXPECT_EQ(mesh.pp_index(), r / 2 % 2);
    EXPECT_EQ(mesh.dp_index(), r / 4);
    // tp: neighbours; pp: by stage; dp: the same part of the model.
    EXPECT_EQ(mesh.tp().global_ranks(), (std::vector<int>{r / 2 * 2, r / 2 * 2 + 1}));
    EXPECT_EQ(mesh.pp().global_ranks(),
              (std::vector<int>{r / 4 * 4 + r % 2, r / 4 * 4 + r % 2 + 2}));
    EXPECT_EQ(mesh.pp().rank(), mesh.pp_index());
    EXPECT_EQ(mesh.dp().global_ranks(), (std::vector<int>{r % 4, r % 4 + 4}));
    // The groups are live: a sum over each.
    for (comm::ProcessGroup g : {mesh.dp(), mesh.pp(), mesh.tp()}) {
      std::vector<at::Tensor> t{torch::full({1}, static_cast<double>(r))};
      g.allreduce(t);
      double expected = 0;
      for (int member : g.global_ranks()) expected += member;
      EXPECT_EQ(t[0].item<double>(), expected);
    }
  });
}

// Linear(16, 32), GELU, Linear(32, 16) (a Sequential cannot hold a Sequential directly).
struct DenseBlockImpl : torch::nn::Module {
  DenseBlockImpl()
      : mlp(register_module("mlp",
                            torch::nn::Sequential(torch::nn::Linear(16, 32), torch::nn::GELU(),
                                                  torch::nn::Linear(32, 16)))) {}
  at::Tensor forward(const at::Tensor& x) { return mlp->forward(x); }
  torch::nn::Sequential mlp;
};
TORCH_MODULE(DenseBlock);

// The whole model: Linear, Tanh, MLP block, Tanh, MLP block, Linear. Seeded: call it under
// generator_mutex().
torch::nn::Sequential make_dense() {
  torch::manual_seed(21);
  return torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::Tanh(), DenseBlock(),
                               torch::nn::Tanh(), DenseBlock(), torch::nn::Linear(16, 4));
}

std::pair<at::Tensor, at::Tensor> global_batch(int step) {
  std::lock_guard lock(generator_mutex());
  torch::manual_seed(100 + step);
  return {torch::randn({16, 8}), torch::randint(0, 4, {16})};
}

at::Tensor cross_entropy(const at::Tensor& output, const at::Tensor& target) {
  return torch::nn::functional::cross_entropy(output, target);
}

// This pipeline stage of the dense model, its MLP block tensor-parallel over `tp`.
torch::nn::Sequential hybrid_stage(const torch::nn::Sequential& dense, int stage,
                                   comm::ProcessGroup tp) {
  TensorParallelMlp mlp(16, 32, tp);
  mlp->load_from_dense(dense->ptr<DenseBlockImpl>(stage == 0 ? 2 : 4)->mlp);
  torch::nn::Sequential out;
  if (stage == 0) {
    torch::nn::Linear first(8, 16);
    torch::NoGradGuard no_grad;
    first->weight.copy_(dense->ptr<torch::nn::LinearImpl>(0)->weight);
    first->bias.copy_(dense->ptr<torch::nn::LinearImpl>(0)->bias);
    out->push_back(first);
    out->push_back(torch::nn::Tanh());
    out->push_back(mlp);
  } else {
    torch::nn::Linear last(16, 4);
    torch::NoGradGuard no_grad;
    last->weight.copy_(dense->ptr<torch::nn::LinearImpl>(5)->weight);
    last->bias.copy_(dense->ptr<torch::nn::LinearImpl>(5)->bias);
    out->push_back(torch::nn::Tanh());
    out->push_back(mlp);
    out->push_back(last);
  }
  return out;
}

TEST(Mesh, HybridTwoByTwoByTwoTrainsLikeOneProcess) {
  constexpr int kSteps = 5;
  constexpr double kLr = 0.2;
  // One process, the whole batch.
  torch::nn::Sequential reference = [] {
    std::lock_guard lock(generator_mutex());
    return make_dense();
  }();
  torch::optim::SGD reference_sgd(reference->parameters(), kLr);
  for (int step = 0; step < kSteps; ++step) {
    const auto [x, y] = global_batch(step);
    reference_sgd.zero_grad();
    cross_entropy(reference->forward(x), y).backward();
    reference_sgd.step();
  }
  // The whole backward in one (1F1B), and split into input and weight backwards (zero bubble).
  for (const auto schedule :
       {pipeline::ScheduleKind::kOneFOneB, pipeline::ScheduleKind::kZeroBubble}) {
    run_ranks(8, [&](comm::ProcessGroup& world) {
      const DeviceMesh mesh = DeviceMesh::create(world, {.dp = 2, .pp = 2, .tp = 2});
      // Every draw from torch's generator under its lock (the tensor-parallel layers draw their
      // initial weights too): another rank's draws would change this rank's dense model.
      std::unique_lock lock(generator_mutex());
      torch::nn::Sequential stage = hybrid_stage(make_dense(), mesh.pp_index(), mesh.tp());
      lock.unlock();
      torch::optim::SGD sgd(stage->parameters(), kLr);
      // The gradients averaged over dp by the DDP engine, in each stage's last backward.
      pipeline::Pipeline pipe({stage}, mesh.pp(), cross_entropy,
                              {.schedule = schedule,
                               .micro_batches = 2,
                               .data_parallel_group = mesh.dp(),
                               .optimizer_step = [&] { sgd.step(); }});
      for (int step = 0; step < kSteps; ++step) {
        const auto [x, y] = global_batch(step);
        sgd.zero_grad();
        pipe.step(x.chunk(2)[mesh.dp_index()], y.chunk(2)[mesh.dp_index()]);
      }
      // The reference's weights, cut the same way.
      lock.lock();
      torch::nn::Sequential expected = hybrid_stage(reference, mesh.pp_index(), mesh.tp());
      lock.unlock();
      const auto got = stage->named_parameters(), want = expected->named_parameters();
      ASSERT_EQ(got.size(), want.size());
      double worst = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        worst = std::max(worst, (got[i].value() - want[i].value()).abs().max().item<double>());
        EXPECT_TRUE(torch::allclose(got[i].value(), want[i].value(), 1e-4, 1e-5))
            << got[i].key() << " on rank " << world.rank() << " (" << to_string(schedule) << ")";
      }
      if (world.rank() == 0) {
        std::printf("hybrid 2x2x2 (%s) vs one process after %d steps: largest difference %g\n",
                    to_string(schedule), kSteps, worst);
      }
    });
  }
}

// Clipping by the global norm on a 2 x 2 x 2 mesh, with DDP and with ZeRO as the data
// parallelism: the norm and the weights of one process that clips its whole gradient. The MLP
// blocks' slices count over tp, their row-parallel bias and the dense layers once.
TEST(Mesh, ClippingByTheGlobalNormIsAsInOneProcess) {
  constexpr int kSteps = 4;
  constexpr double kLr = 0.2, kMaxNorm = 0.05;
  torch::nn::Sequential reference = [] {
    std::lock_guard lock(generator_mutex());
    return make_dense();
  }();
  torch::optim::SGD reference_sgd(reference->parameters(), kLr);
  std::vector<double> reference_norms;
  for (int step = 0; step < kSteps; ++step) {
    const auto [x, y] = global_batch(step);
    reference_sgd.zero_grad();
    cross_entropy(reference->forward(x), y).backward();
    reference_norms.push_back(torch::nn::utils::clip_grad_norm_(reference->parameters(), kMaxNorm));
    reference_sgd.step();
  }
  ASSERT_GT(reference_norms.back(), kMaxNorm) << "the test must clip";
  for (const int zero_stage : {0, 2}) {
    run_ranks(8, [&](comm::ProcessGroup& world) {
      const DeviceMesh mesh = DeviceMesh::create(world, {.dp = 2, .pp = 2, .tp = 2});
      std::unique_lock lock(generator_mutex());
      torch::nn::Sequential stage = hybrid_stage(make_dense(), mesh.pp_index(), mesh.tp());
      lock.unlock();
      EXPECT_EQ(tensor_parallel_slices(*stage),
                (std::set<std::string>{mesh.pp_index() == 0 ? "2.fc1.weight" : "1.fc1.weight",
                                       mesh.pp_index() == 0 ? "2.fc1.bias" : "1.fc1.bias",
                                       mesh.pp_index() == 0 ? "2.fc2.weight" : "1.fc2.weight"}));
      pipeline::Pipeline pipe(
          {stage}, mesh.pp(), cross_entropy,
          {.micro_batches = 2, .data_parallel_group = mesh.dp(), .zero = {.stage = zero_stage}});
      auto sgd = pipe.prepare_optimizer(
          std::make_unique<torch::optim::SGD>(stage->parameters(), torch::optim::SGDOptions(kLr)));
      for (int step = 0; step < kSteps; ++step) {
        const auto [x, y] = global_batch(step);
        sgd->zero_grad();
        pipe.step(x.chunk(2)[mesh.dp_index()], y.chunk(2)[mesh.dp_index()]);
        const double norm = clip_grad_norm(mesh, *stage, *sgd, kMaxNorm).item<double>();
        EXPECT_NEAR(norm, reference_norms[step], 1e-5 * reference_norms[step])
            << "step " << step << " on rank " << world.rank() << ", ZeRO stage " << zero_stage;
        sgd->step();
      }
      lock.lock();
      torch::nn::Sequential expected = hybrid_stage(reference, mesh.pp_index(), mesh.tp());
      lock.unlock();
      const auto got = stage->named_parameters(), want = expected->named_parameters();
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_TRUE(torch::allclose(got[i].value(), want[i].value(), 1e-4, 1e-6))
            << got[i].key() << " on rank " << world.rank() << ", ZeRO stage " << zero_stage;
      }
      EXPECT_THROW(clip_grad_norm(mesh, *stage, *sgd, 0.0), UsageError);
    });
  }
}

// Local SGD over pipelines (every 2 steps) on a 2 x 2 x 2 mesh: each dp replica steps on its half
// of the batch alone, clipped by its own norm, and the stages' replicas are averaged every 2
// steps: as two processes that each train the whole model and average every 2 steps.
TEST(Mesh, LocalSgdOverPipelinesIsEachReplicaAloneAveragedEveryHSteps) {
  constexpr int kSteps = 4, kEvery = 2;
  constexpr double kLr = 0.2, kMaxNorm = 0.05;
  std::vector<torch::nn::Sequential> replicas;
  {
    std::lock_guard lock(generator_mutex());
    replicas = {make_dense(), make_dense()};
  }
  std::vector<std::vector<double>> reference_norms(2);
  for (int step = 0; step < kSteps; ++step) {
    const auto [x, y] = global_batch(step);
    for (int r = 0; r < 2; ++r) {
      auto& replica = replicas[static_cast<size_t>(r)];
      torch::optim::SGD sgd(replica->parameters(), kLr);
      sgd.zero_grad();
      cross_entropy(replica->forward(x.chunk(2)[r]), y.chunk(2)[r]).backward();
      reference_norms[static_cast<size_t>(r)].push_back(
          torch::nn::utils::clip_grad_norm_(replica->parameters(), kMaxNorm));
      sgd.step();
    }
    if ((step + 1) % kEvery != 0) continue;
    torch::NoGradGuard no_grad;
    const auto a = replicas[0]->parameters(), b = replicas[1]->parameters();
    for (size_t i = 0; i < a.size(); ++i) {
      const at::Tensor mean = (a[i] + b[i]) / 2;
      a[i].copy_(mean);
      b[i].copy_(mean);
    }
  }
  ASSERT_NE(reference_norms[0][0], reference_norms[1][0]) << "the replicas must differ";
  run_ranks(8, [&](comm::ProcessGroup& world) {
    const DeviceMesh mesh = DeviceMesh::create(world, {.dp = 2, .pp = 2, .tp = 2});
    std::unique_lock lock(generator_mutex());
    torch::nn::Sequential stage = hybrid_stage(make_dense(), mesh.pp_index(), mesh.tp());
    lock.unlock();
    pipeline::Pipeline pipe(
        {stage}, mesh.pp(), cross_entropy,
        {.micro_batches = 2, .data_parallel_group = mesh.dp(), .sync = LocalSgd{.every = kEvery}});
    auto sgd = pipe.prepare_optimizer(
        std::make_unique<torch::optim::SGD>(stage->parameters(), torch::optim::SGDOptions(kLr)));
    const auto& mine = reference_norms[static_cast<size_t>(mesh.dp_index())];
    for (int step = 0; step < kSteps; ++step) {
      const auto [x, y] = global_batch(step);
      sgd->zero_grad();
      pipe.step(x.chunk(2)[mesh.dp_index()], y.chunk(2)[mesh.dp_index()]);
      const double norm = clip_grad_norm(mesh, *stage, *sgd, kMaxNorm).item<double>();
      EXPECT_NEAR(norm, mine[static_cast<size_t>(step)], 1e-5 * mine[static_cast<size_t>(step)])
          << "step " << step << " on rank " << world.rank();
      sgd->step();
    }
    EXPECT_EQ(dynamic_cast<const LocalSgdOptimizer&>(*sgd).stats().outer_steps, kSteps / kEvery);
    lock.lock();
    torch::nn::Sequential expected = hybrid_stage(replicas[0], mesh.pp_index(), mesh.tp());
    lock.unlock();
    const auto got = stage->named_parameters(), want = expected->named_parameters();
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_TRUE(torch::allclose(got[i].value(), want[i].value(), 1e-4, 1e-6))
          << got[i].key() << " on rank " << world.rank();
    }
  });
}

}  // namespace
}  // namespace cohort::parallel

#include "cohort/parallel/distributed_data_parallel.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <thread>

#include "cohort/error.h"

namespace cohort::parallel {
namespace {

struct TwoHeadsImpl : torch::nn::Module {
  TwoHeadsImpl() {
    body = register_module("body", torch::nn::Linear(6, 8));
    head_a = register_module("head_a", torch::nn::Linear(8, 3));
    head_b = register_module("head_b", torch::nn::Linear(8, 3));
    norm = register_module("norm", torch::nn::BatchNorm1d(8));
  }
  torch::Tensor forward(torch::Tensor x, bool use_b = false) {
    auto h = torch::relu(norm->forward(body->forward(x)));
    return use_b ? head_b->forward(h) : head_a->forward(h);
  }
  torch::nn::Linear body{nullptr}, head_a{nullptr}, head_b{nullptr};
  torch::nn::BatchNorm1d norm{nullptr};
};
TORCH_MODULE(TwoHeads);

std::vector<TwoHeads> replicas(int world, bool same_init = true) {
  std::vector<TwoHeads> models;
  for (int r = 0; r < world; ++r) {
    torch::manual_seed(same_init ? 1 : 100 + r);
    models.emplace_back();
  }
  return models;
}

TwoHeads clone_of(const TwoHeads& m) {
  TwoHeads copy;
  torch::NoGradGuard no_grad;
  auto dst = copy->named_parameters();
  for (const auto& p : m->named_parameters()) dst[p.key()].copy_(p.value());
  auto dst_buffers = copy->named_buffers();
  for (const auto& b : m->named_buffers()) dst_buffers[b.key()].copy_(b.value());
  return copy;
}

// Runs fn(rank, group) on `world` threads, each a rank of one Gloo group.
void run_ranks(int world, const std::function<void(int, comm::ProcessGroup&)>& fn) {
  auto server = comm::Store::connect({.is_server = true, .timeout = std::chrono::seconds(20)});
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(world);
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        auto store = comm::Store::connect({.port = server.port()});
        auto group = comm::ProcessGroup::create(store, rank, world,
                                                {.timeout = std::chrono::seconds(20)});
        fn(rank, group);
      } catch (...) {
        errors[rank] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

// A parameter no rank used has no reference gradient; DDP gives it zeros so that ranks agree.
at::Tensor grad_or_zeros(const at::Tensor& p) {
  return p.grad().defined() ? p.grad() : torch::zeros_like(p);
}

void expect_same_parameters(const TwoHeads& a, const TwoHeads& b, double rtol = 1e-5) {
  auto pb = b->named_parameters();
  for (const auto& p : a->named_parameters()) {
    EXPECT_TRUE(torch::allclose(p.value(), pb[p.key()], rtol, 1e-6)) << p.key();
  }
}

TEST(DistributedDataParallel, BroadcastsRankZerosWeightsAtWrap) {
  auto models = replicas(2, /*same_init=*/false);
  auto rank0_before = clone_of(models[0]);
  run_ranks(2, [&](int rank, comm::ProcessGroup& g) {
    DistributedDataParallel ddp(models[rank].ptr(), g);
  });
  expect_same_parameters(models[1], rank0_before, 0);
  expect_same_parameters(models[0], rank0_before, 0);
}

TEST(DistributedDataParallel, OneStepEqualsASingleProcessStepOnTheUnionBatch) {
  const int world = 2;
  torch::manual_seed(5);
  auto inputs = torch::randn({8, 6});
  auto targets = torch::randint(0, 3, {8});
  auto models = replicas(world);
  auto reference = clone_of(models[0]);
  run_ranks(world, [&](int rank, comm::ProcessGroup& g) {
    DistributedDataParallel ddp(models[rank].ptr(), g);
    torch::optim::SGD opt(models[rank]->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      auto x = inputs.narrow(0, rank * 4, 4);
      auto y = targets.narrow(0, rank * 4, 4);
      torch::nn::functional::cross_entropy(models[rank]->forward(x), y).backward();
      opt.step();
    }
    EXPECT_EQ(ddp.synchronized_steps(), 3);
  });
  expect_same_parameters(models[0], models[1], 0);
  // The reference sees the union batch; batch norm statistics differ between a batch of 8 and
  // two of 4, so it runs the same two halves and averages their losses.
  torch::optim::SGD opt(reference->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    auto loss = (torch::nn::functional::cross_entropy(reference->forward(inputs.narrow(0, 0, 4)),
                                                      targets.narrow(0, 0, 4)) +
                 torch::nn::functional::cross_entropy(reference->forward(inputs.narrow(0, 4, 4)),
                                                      targets.narrow(0, 4, 4))) /
                2;
    loss.backward();
    opt.step();
  }
  expect_same_parameters(models[0], reference);
}

TEST(DistributedDataParallel, NoSyncAccumulatesLocallyThenSyncsTheSum) {
  const int world = 2;
  torch::manual_seed(6);
  auto inputs = torch::randn({world, 4, 4, 6});  // rank, micro-batch, example, feature
  auto targets = torch::randint(0, 3, {world, 4, 4});
  auto models = replicas(world);
  auto reference = clone_of(models[0]);
  run_ranks(world, [&](int rank, comm::ProcessGroup& g) {
    DistributedDataParallel ddp(models[rank].ptr(), g);
    auto& m = models[rank];
    m->zero_grad();
    {
      auto guard = ddp.no_sync();
      for (int micro = 0; micro < 3; ++micro) {
        torch::nn::functional::cross_entropy(m->forward(inputs[rank][micro]), targets[rank][micro]).backward();
      }
      EXPECT_EQ(ddp.synchronized_steps(), 0);
    }
    torch::nn::functional::cross_entropy(m->forward(inputs[rank][3]), targets[rank][3]).backward();
    EXPECT_EQ(ddp.synchronized_steps(), 1);
  });
  reference->zero_grad();
  for (int rank = 0; rank < world; ++rank) {
    for (int micro = 0; micro < 4; ++micro) {
      (torch::nn::functional::cross_entropy(reference->forward(inputs[rank][micro]), targets[rank][micro]) /
       world)
          .backward();
    }
  }
  auto ref = reference->named_parameters();
  for (int rank = 0; rank < world; ++rank) {
    for (const auto& p : models[rank]->named_parameters()) {
      EXPECT_TRUE(torch::allclose(p.value().grad(), grad_or_zeros(ref[p.key()]), 1e-5, 1e-6)) << p.key();
    }
  }
}

TEST(DistributedDataParallel, AParameterUnusedOnOneRankDoesNotHang) {
  const int world = 2;
  torch::manual_seed(7);
  auto inputs = torch::randn({world, 4, 6});
  auto targets = torch::randint(0, 3, {world, 4});
  auto models = replicas(world);
  auto reference = clone_of(models[0]);
  run_ranks(world, [&](int rank, comm::ProcessGroup& g) {
    DistributedDataParallel ddp(models[rank].ptr(), g);
    models[rank]->zero_grad();
    // Rank 0 uses head a, rank 1 head b.
    torch::nn::functional::cross_entropy(models[rank]->forward(inputs[rank], rank == 1), targets[rank])
        .backward();
  });
  reference->zero_grad();
  for (int rank = 0; rank < world; ++rank) {
    (torch::nn::functional::cross_entropy(reference->forward(inputs[rank], rank == 1), targets[rank]) / world)
        .backward();
  }
  auto ref = reference->named_parameters();
  for (int rank = 0; rank < world; ++rank) {
    for (const auto& p : models[rank]->named_parameters()) {
      EXPECT_TRUE(torch::allclose(p.value().grad(), grad_or_zeros(ref[p.key()]), 1e-5, 1e-6)) << p.key();
    }
  }
}

TEST(DistributedDataParallel, BuffersFollowRankZeroAfterEachStep) {
  auto models = replicas(2);
  run_ranks(2, [&](int rank, comm::ProcessGroup& g) {
    DistributedDataParallel ddp(models[rank].ptr(), g);
    auto x = torch::randn({4, 6}) + rank * 10;  // very different batch statistics
    torch::nn::functional::cross_entropy(models[rank]->forward(x), torch::zeros({4}, torch::kLong)).backward();
  });
  EXPECT_TRUE(torch::equal(models[0]->norm->running_mean, models[1]->norm->running_mean));
  EXPECT_GT(models[0]->norm->running_mean.abs().sum().item<double>(), 0);
}

TEST(DistributedDataParallel, AShapeMismatchIsNamedOnEveryRank) {
  torch::manual_seed(1);
  std::vector<std::shared_ptr<torch::nn::Module>> models{
      torch::nn::Sequential(torch::nn::Linear(6, 8), torch::nn::Linear(8, 3)).ptr(),
      torch::nn::Sequential(torch::nn::Linear(6, 8), torch::nn::Linear(8, 4)).ptr()};
  std::vector<std::string> messages(2);
  run_ranks(2, [&](int rank, comm::ProcessGroup& g) {
    try {
      DistributedDataParallel ddp(models[rank], g);
    } catch (const UsageError& e) {
      messages[rank] = e.what();
    }
  });
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_NE(messages[rank].find("parameter '1.weight'"), std::string::npos) << messages[rank];
    EXPECT_NE(messages[rank].find("on rank " + std::to_string(1 - rank)), std::string::npos)
        << messages[rank];
  }
}

}  // namespace
}  // namespace cohort::parallel

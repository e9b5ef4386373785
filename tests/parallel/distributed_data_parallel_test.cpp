#include "cohort/parallel/distributed_data_parallel.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <barrier>
#include <mutex>
#include <tuple>

#include "cohort/error.h"
#include "cohort/models/zoo.h"
#include "support/expect.h"
#include "support/local_group.h"

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

void run_ranks(int world, const std::function<void(int, comm::ProcessGroup&)>& fn) {
  cohort::testing::run_ranks(world, [&](comm::ProcessGroup& g) { fn(g.rank(), g); },
                             {.timeout = std::chrono::seconds(30)});
}

// A parameter no rank used has no reference gradient; DDP gives it zeros so that ranks agree.
at::Tensor grad_or_zeros(const at::Tensor& p) {
  return p.grad().defined() ? p.grad() : torch::zeros_like(p);
}

// Every rank's gradients equal the reference's (computed in one process).
void expect_gradients_match(const std::vector<TwoHeads>& models, const TwoHeads& reference) {
  auto ref = reference->named_parameters();
  for (size_t rank = 0; rank < models.size(); ++rank) {
    for (const auto& p : models[rank]->named_parameters()) {
      EXPECT_TRUE(torch::allclose(p.value().grad(), grad_or_zeros(ref[p.key()]), 1e-5, 1e-6))
          << "rank " << rank << " " << p.key();
    }
  }
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

// Without rank 0's state at the wrap (a caller that loads the same state into every rank next),
// the wrap checks the layouts only, and the ranks take rank 0's state when asked.
TEST(DistributedDataParallel, TakesRankZerosStateWhenAskedWhereTheWrapDidNot) {
  auto models = replicas(2, /*same_init=*/false);
  auto rank1_before = clone_of(models[1]);
  auto rank0_before = clone_of(models[0]);
  run_ranks(2, [&](int rank, comm::ProcessGroup& g) {
    DistributedDataParallel ddp(models[rank].ptr(), g, {.take_rank0_state = false});
    g.barrier();
    if (rank == 1) expect_same_parameters(models[1], rank1_before, 0);  // its own still
    g.barrier();
    ddp.take_rank0_state();
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

TEST(DistributedDataParallel, RunsOnSubGroupsThatAverageOnlyTheirOwnRanks) {
  // Four ranks as two data-parallel pairs {0, 2} and {1, 3} (the dp groups of a 2 x 2 mesh):
  // each pair's replicas agree with each other and with a reference fed that pair's data only.
  torch::manual_seed(8);
  auto inputs = torch::randn({4, 4, 6});
  auto targets = torch::randint(0, 3, {4, 4});
  auto models = replicas(4);
  auto reference = clone_of(models[0]);
  std::vector<std::vector<int>> global_ranks(4);
  run_ranks(4, [&](int rank, comm::ProcessGroup& world) {
    auto pair = world.split({{0, 2}, {1, 3}});
    global_ranks[static_cast<size_t>(rank)] = pair.global_ranks();
    DistributedDataParallel ddp(models[rank].ptr(), pair);
    torch::optim::SGD opt(models[rank]->parameters(), torch::optim::SGDOptions(0.1));
    opt.zero_grad();
    torch::nn::functional::cross_entropy(models[rank]->forward(inputs[rank]), targets[rank])
        .backward();
    opt.step();
  });
  EXPECT_EQ(global_ranks[2], (std::vector<int>{0, 2}));
  EXPECT_EQ(global_ranks[3], (std::vector<int>{1, 3}));
  expect_same_parameters(models[0], models[2], 0);
  expect_same_parameters(models[1], models[3], 0);
  torch::optim::SGD opt(reference->parameters(), torch::optim::SGDOptions(0.1));
  opt.zero_grad();
  ((torch::nn::functional::cross_entropy(reference->forward(inputs[0]), targets[0]) +
    torch::nn::functional::cross_entropy(reference->forward(inputs[2]), targets[2])) /
   2)
      .backward();
  opt.step();
  expect_same_parameters(models[0], reference);
  // The other pair trained on other data.
  EXPECT_FALSE(torch::allclose(models[0]->body->weight, models[1]->body->weight));
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
        torch::nn::functional::cross_entropy(m->forward(inputs[rank][micro]), targets[rank][micro])
            .backward();
      }
      EXPECT_EQ(ddp.synchronized_steps(), 0);
    }
    torch::nn::functional::cross_entropy(m->forward(inputs[rank][3]), targets[rank][3]).backward();
    EXPECT_EQ(ddp.synchronized_steps(), 1);
  });
  reference->zero_grad();
  for (int rank = 0; rank < world; ++rank) {
    for (int micro = 0; micro < 4; ++micro) {
      (torch::nn::functional::cross_entropy(reference->forward(inputs[rank][micro]),
                                            targets[rank][micro]) /
       world)
          .backward();
    }
  }
  expect_gradients_match(models, reference);
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
    torch::nn::functional::cross_entropy(models[rank]->forward(inputs[rank], rank == 1),
                                         targets[rank])
        .backward();
  });
  reference->zero_grad();
  for (int rank = 0; rank < world; ++rank) {
    (torch::nn::functional::cross_entropy(reference->forward(inputs[rank], rank == 1),
                                          targets[rank]) /
     world)
        .backward();
  }
  expect_gradients_match(models, reference);
}

TEST(DistributedDataParallel, BuffersFollowRankZeroAfterEachStep) {
  auto models = replicas(2);
  run_ranks(2, [&](int rank, comm::ProcessGroup& g) {
    DistributedDataParallel ddp(models[rank].ptr(), g);
    auto x = torch::randn({4, 6}) + rank * 10;  // very different batch statistics
    torch::nn::functional::cross_entropy(models[rank]->forward(x), torch::zeros({4}, torch::kLong))
        .backward();
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

double relative_difference(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).norm().item<double>() / std::max(b.norm().item<double>(), 1e-12);
}

// k workers with batch b each and one process with batch k*b, from the same weights and data,
// hold the same parameters after 20 SGD steps.
void expect_equivalent_to_one_process(
    const std::string& model_name, int world, DdpOptions options,
    const std::function<at::Tensor(torch::nn::Module&, const at::Tensor&)>& forward) {
  const int64_t batch = 4, steps = 20;
  torch::manual_seed(11);
  auto inputs = torch::randn({steps, world * batch, 1, 28, 28});
  auto targets = torch::randint(0, 10, {steps, world * batch});
  auto make = [&] {
    torch::manual_seed(3);
    return models::create_model(model_name);
  };
  std::vector<models::ZooModel> models;
  for (int r = 0; r < world; ++r) models.push_back(make());
  run_ranks(world, [&](int rank, comm::ProcessGroup& g) {
    DistributedDataParallel ddp(models[rank], g, options);
    torch::optim::SGD opt(models[rank]->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    for (int64_t s = 0; s < steps; ++s) {
      opt.zero_grad();
      auto x = inputs[s].narrow(0, rank * batch, batch);
      auto y = targets[s].narrow(0, rank * batch, batch);
      torch::nn::functional::cross_entropy(forward(*models[rank], x), y).backward();
      opt.step();
    }
    EXPECT_TRUE(ddp.stats().buckets_rebuilt);
  });
  auto reference = make();
  torch::optim::SGD opt(reference->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  for (int64_t s = 0; s < steps; ++s) {
    opt.zero_grad();
    torch::nn::functional::cross_entropy(forward(*reference, inputs[s]), targets[s]).backward();
    opt.step();
  }
  auto expected = reference->named_parameters();
  for (int rank = 0; rank < world; ++rank) {
    for (const auto& p : models[rank]->named_parameters()) {
      EXPECT_LT(relative_difference(p.value(), expected[p.key()]), 1e-5)
          << model_name << " world " << world << " rank " << rank << " " << p.key();
    }
  }
}

at::Tensor plain_forward(torch::nn::Module& m, const at::Tensor& x) {
  return dynamic_cast<models::ZooModelImpl&>(m).forward(x);
}

TEST(DistributedDataParallel, CnnOnTwoAndThreeRanksEqualsOneProcessOver20Steps) {
  for (int world : {2, 3}) expect_equivalent_to_one_process("cnn", world, {}, plain_forward);
}

TEST(DistributedDataParallel, SmallBucketsAndCopiedGradientsGiveTheSameResult) {
  expect_equivalent_to_one_process(
      "cnn", 2,
      {.bucket_cap_mb = 0.05, .first_bucket_cap_mb = 0.01, .gradient_as_bucket_view = false},
      plain_forward);
}

// A model with a branch that never gets a gradient: under find_unused_parameters its gradient
// stays undefined, so the optimizer skips it, exactly as in one process.
struct WithUnusedBranchImpl : models::ZooModelImpl {
  WithUnusedBranchImpl() {
    mlp = register_module("mlp", std::make_shared<models::MlpImpl>());
    unused = register_module("unused", torch::nn::Linear(10, 10));
  }
  torch::Tensor forward(torch::Tensor x) override { return mlp->forward(x); }
  std::shared_ptr<models::MlpImpl> mlp;
  torch::nn::Linear unused{nullptr};
};

TEST(DistributedDataParallel, UnusedBranchUnderFindUnusedParametersEqualsOneProcess) {
  const int world = 2;
  torch::manual_seed(12);
  auto inputs = torch::randn({20, world * 4, 1, 28, 28});
  auto targets = torch::randint(0, 10, {20, world * 4});
  auto make = [] {
    torch::manual_seed(4);
    return std::make_shared<WithUnusedBranchImpl>();
  };
  std::vector<std::shared_ptr<WithUnusedBranchImpl>> models{make(), make()};
  run_ranks(world, [&](int rank, comm::ProcessGroup& g) {
    DistributedDataParallel ddp(models[rank], g, {.find_unused_parameters = true});
    torch::optim::SGD opt(models[rank]->parameters(),
                          torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(0.01));
    for (int s = 0; s < 20; ++s) {
      opt.zero_grad();
      torch::nn::functional::cross_entropy(models[rank]->forward(inputs[s].narrow(0, rank * 4, 4)),
                                           targets[s].narrow(0, rank * 4, 4))
          .backward();
      EXPECT_FALSE(models[rank]->unused->weight.grad().defined());
      opt.step();
    }
  });
  auto reference = make();
  torch::optim::SGD opt(reference->parameters(),
                        torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(0.01));
  for (int s = 0; s < 20; ++s) {
    opt.zero_grad();
    torch::nn::functional::cross_entropy(reference->forward(inputs[s]), targets[s]).backward();
    opt.step();
  }
  auto expected = reference->named_parameters();
  for (const auto& m : models) {
    for (const auto& p : m->named_parameters()) {
      EXPECT_LT(relative_difference(p.value(), expected[p.key()]), 1e-5) << p.key();
    }
  }
}

TEST(DistributedDataParallel, BucketsLaunchDuringBackward) {
  auto models =
      std::vector<models::ZooModel>{models::create_model("cnn"), models::create_model("cnn")};
  run_ranks(2, [&](int rank, comm::ProcessGroup& g) {
    DistributedDataParallel ddp(models[rank], g,
                                {.bucket_cap_mb = 0.1, .first_bucket_cap_mb = 0.01});
    for (int s = 0; s < 3; ++s) {
      models[rank]->zero_grad();
      models[rank]->forward(torch::randn({2, 1, 28, 28})).sum().backward();
    }
    auto stats = ddp.stats();
    EXPECT_GT(stats.buckets, 1);
    // Every bucket but the last can start before backward ends: communication overlaps compute.
    EXPECT_GE(stats.buckets_launched_early, 3 * (stats.buckets - 1));
    EXPECT_EQ(stats.synchronized_steps, 3);
  });
}

// Live recovery: once the group is aborted (a peer lost), a backward stops at its first gradient
// with PeerFailureError, rather than computing gradients no all-reduce will take.
TEST(DistributedDataParallel, ABackwardStopsAtItsFirstGradientOnceTheGroupIsAborted) {
  auto models =
      std::vector<models::ZooModel>{models::create_model("cnn"), models::create_model("cnn")};
  std::atomic<bool> lost{false};
  std::barrier<> both(2);
  comm::ProcessGroupOptions options{.timeout = std::chrono::seconds(30)};
  options.aborted = [&] { return lost.load(); };
  cohort::testing::run_ranks(
      2,
      [&](comm::ProcessGroup& g) {
        const int rank = g.rank();
        auto& model = models[static_cast<size_t>(rank)];
        DistributedDataParallel ddp(model, g);
        EXPECT_FALSE(g.aborted());
        model->forward(torch::randn({2, 1, 28, 28})).sum().backward();
        both.arrive_and_wait();
        if (rank == 0) lost = true;
        both.arrive_and_wait();
        EXPECT_TRUE(g.aborted());
        model->zero_grad();
        cohort::testing::expect_error<PeerFailureError>(
            [&] {
              model->forward(torch::randn({2, 1, 28, 28})).sum().backward();
            },
            "the backward stopped: a peer of the group was lost");
        // The first layer's gradient, the backward's last, was never computed.
        const auto first = model->parameters().front().grad();
        EXPECT_TRUE(!first.defined() || first.abs().sum().item<double>() == 0);
      },
      options);
}

TEST(DistributedDataParallel, CompressionHooksAverageClosely) {
  for (const auto& [hook, tolerance] : std::vector<std::pair<CommHook, double>>{
           {fp16_compress_hook(), 1e-3}, {bf16_compress_hook(), 1e-2}}) {
    auto models =
        std::vector<models::ZooModel>{models::create_model("mlp"), models::create_model("mlp")};
    std::vector<std::vector<at::Tensor>> exact(2);
    torch::manual_seed(9);
    auto inputs = torch::randn({2, 4, 1, 28, 28});
    run_ranks(2, [&](int rank, comm::ProcessGroup& g) {
      DistributedDataParallel ddp(models[rank], g, {.comm_hook = hook});
      models[rank]->forward(inputs[rank]).pow(2).mean().backward();
      for (const auto& p : models[rank]->parameters()) exact[rank].push_back(p.grad().clone());
    });
    // Reference: the plain average of each rank's own gradient.
    auto reference =
        std::vector<models::ZooModel>{models::create_model("mlp"), models::create_model("mlp")};
    std::vector<at::Tensor> averaged;
    for (int r = 0; r < 2; ++r) {
      torch::NoGradGuard no_grad;
      auto dst = reference[r]->parameters();
      auto src = models[0]->parameters();
      for (size_t i = 0; i < dst.size(); ++i) dst[i].copy_(src[i]);
    }
    for (int r = 0; r < 2; ++r) reference[r]->forward(inputs[r]).pow(2).mean().backward();
    auto p0 = reference[0]->parameters(), p1 = reference[1]->parameters();
    for (size_t i = 0; i < p0.size(); ++i) {
      auto expected = (p0[i].grad() + p1[i].grad()) / 2;
      EXPECT_TRUE(torch::equal(exact[0][i], exact[1][i]));
      EXPECT_LT(relative_difference(exact[0][i], expected), tolerance) << i;
    }
  }
}

TEST(DistributedDataParallel, WrapsEveryModelOfTheZoo) {
  for (const auto& name : models::model_names()) {
    auto models =
        std::vector<models::ZooModel>{models::create_model(name), models::create_model(name)};
    run_ranks(2, [&](int rank, comm::ProcessGroup& g) {
      DistributedDataParallel ddp(models[rank], g);
      torch::optim::SGD opt(models[rank]->parameters(), torch::optim::SGDOptions(0.01));
      opt.zero_grad();
      torch::Tensor x, y;
      {
        std::lock_guard lock(cohort::testing::generator_mutex());
        torch::manual_seed(rank);
        std::tie(x, y) = models[rank]->sample_batch(2);
      }
      models::logits_cross_entropy(models[rank]->forward(x), y).backward();
      opt.step();
    });
    auto other = models[1]->named_parameters();
    for (const auto& p : models[0]->named_parameters()) {
      EXPECT_TRUE(torch::equal(p.value(), other[p.key()])) << name << " " << p.key();
    }
  }
}

}  // namespace
}  // namespace cohort::parallel

#include "cohort/parallel/local_sgd.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <mutex>
#include <sstream>

#include "cohort/error.h"
#include "cohort/parallel/distributed_data_parallel.h"
#include "small_net.h"
#include "support/expect.h"
#include "support/local_group.h"

namespace cohort::parallel {
namespace {

using testing::batch;
using testing::make_net;
using testing::parameters_of;
using testing::train_step;

std::unique_ptr<torch::optim::Optimizer> sgd(torch::nn::Sequential& net, double momentum = 0.9) {
  return std::make_unique<torch::optim::SGD>(net->parameters(),
                                             torch::optim::SGDOptions(0.1).momentum(momentum));
}

using cohort::testing::run_ranks;

void expect_close(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b,
                  double tolerance) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_TRUE(torch::allclose(a[i], b[i], tolerance, tolerance))
        << "parameter " << i << " differs by " << (a[i] - b[i]).abs().max().item<double>();
}

TEST(SyncMode, ParsesTheCliFormsAndNamesBadOnes) {
  EXPECT_TRUE(is_synchronous(parse_sync_mode("ddp")));
  EXPECT_EQ(std::get<LocalSgd>(parse_sync_mode("local-sgd:8")).every, 8);
  const auto diloco = std::get<DiLoCo>(parse_sync_mode("diloco:32"));
  EXPECT_EQ(diloco.inner_steps, 32);
  EXPECT_EQ(diloco.outer_lr, DiLoCo{}.outer_lr);
  EXPECT_EQ(to_string(parse_sync_mode("diloco:32")), "diloco:32");
  testing::expect_error<UsageError>([&] { parse_sync_mode("local-sgd:0"); }, "must be >= 1");
  testing::expect_error<UsageError>([&] { parse_sync_mode("diloco:-3"); }, "must be >= 1");
  testing::expect_error<UsageError>([&] { parse_sync_mode("diloco:4x"); },
                                    "'4x' is not an integer");
  testing::expect_error<UsageError>([&] { parse_sync_mode("async"); },
                                    "choose ddp, local-sgd:H, diloco:H");
  testing::expect_error<UsageError>([&] { validate(DiLoCo{.outer_momentum = 1.0}); }, "[0, 1)");
  testing::expect_error<UsageError>([&] { validate(DiLoCo{.outer_lr = std::nan("")}); },
                                    "outer_lr");
}

// Only synchronous replicas step the same gradients, which ZeRO's shards need; every layer that
// checks the combination (the plan, prepare_model, the pipeline) words it from this one reason.
TEST(SyncMode, OnlySynchronousModesCombineWithZero) {
  EXPECT_FALSE(zero_conflict(Synchronous{}, 3));
  EXPECT_FALSE(zero_conflict(LocalSgd{.every = 8}, 0));
  EXPECT_EQ(zero_conflict(DiLoCo{.inner_steps = 8}, 2).value_or(""),
            "diloco:8 cannot be combined with ZeRO stage 2: ZeRO's shards need every replica to "
            "step the same gradients");
  EXPECT_TRUE(zero_conflict(AsyncParameterServer{.max_staleness = 2}, 1));
}

// DiLoCo with one inner step and an outer SGD of lr 1 without momentum is synchronous DDP (the
// inner SGD's momentum is linear in the gradients, so averaging commutes with it).
TEST(LocalSgdOptimizer, DiLoCoOfOneStepAndPlainOuterSgdIsDdp) {
  constexpr int kSteps = 5;
  std::vector<torch::Tensor> ddp_result, diloco_result;
  std::mutex mutex;
  run_ranks(2, [&](comm::ProcessGroup& g) {
    auto net = make_net();
    DistributedDataParallel ddp(net.ptr(), g);
    auto optimizer = sgd(net);
    for (int s = 0; s < kSteps; ++s) train_step(net, *optimizer, g.rank(), s);
    std::lock_guard lock(mutex);
    if (g.rank() == 0) ddp_result = parameters_of(net);
  });
  run_ranks(2, [&](comm::ProcessGroup& g) {
    auto net = make_net();
    LocalSgdOptimizer optimizer(
        net.ptr(), sgd(net), g,
        DiLoCo{.inner_steps = 1, .outer_lr = 1.0, .outer_momentum = 0.0, .nesterov = false});
    for (int s = 0; s < kSteps; ++s) train_step(net, optimizer, g.rank(), s);
    EXPECT_EQ(optimizer.stats().outer_steps, kSteps);
    std::lock_guard lock(mutex);
    if (g.rank() == 0) diloco_result = parameters_of(net);
  });
  expect_close(diloco_result, ddp_result, 1e-6);
}

// Local SGD: the replicas drift apart for H - 1 steps, then all become the mean of what each
// trained alone; communication only then.
TEST(LocalSgdOptimizer, LocalSgdAveragesTheReplicasEveryHSteps) {
  run_ranks(2, [&](comm::ProcessGroup& g) {
    auto net = make_net();
    auto alone = make_net();  // the same start, trained without communication
    auto alone_optimizer = sgd(alone);
    LocalSgdOptimizer optimizer(net.ptr(), sgd(net), g, LocalSgd{.every = 3});
    const int64_t bytes_before = g.bytes_sent();
    for (int s = 0; s < 2; ++s) {
      train_step(net, optimizer, g.rank(), s);
      train_step(alone, *alone_optimizer, g.rank(), s);
    }
    EXPECT_EQ(g.bytes_sent(), bytes_before) << "local steps must not communicate";
    expect_close(parameters_of(net), parameters_of(alone), 0);
    const auto spread = g.allgather(net->parameters()[0].detach().clone());
    EXPECT_FALSE(torch::equal(spread[0], spread[1])) << "the replicas should differ before H";
    const int64_t bytes_before_sync = g.bytes_sent();
    train_step(net, optimizer, g.rank(), 2);
    train_step(alone, *alone_optimizer, g.rank(), 2);
    EXPECT_EQ(optimizer.steps_since_sync(), 0);
    // One all-reduce of the parameters (float32): 2 (N - 1) / N x 4 bytes each, with N = 2.
    int64_t numel = 0;
    for (const auto& p : net->parameters()) numel += p.numel();
    EXPECT_EQ(g.bytes_sent() - bytes_before_sync, 4 * numel);
    auto expected = parameters_of(alone);
    std::vector<torch::Tensor> mean{torch::cat([&] {
      std::vector<torch::Tensor> flat;
      for (auto& p : expected) flat.push_back(p.reshape(-1));
      return flat;
    }())};
    g.allreduce(mean, comm::ReduceOp::kAvg);
    int64_t offset = 0;
    for (auto& p : expected) {
      p = mean[0].narrow(0, offset, p.numel()).view(p.sizes());
      offset += p.numel();
    }
    expect_close(parameters_of(net), expected, 1e-6);
  });
}

// DiLoCo's outer step: Nesterov momentum on the averaged pseudo-gradient, by hand.
TEST(LocalSgdOptimizer, DiLoCoAppliesNesterovMomentumToThePseudoGradient) {
  const DiLoCo mode{.inner_steps = 2, .outer_lr = 0.7, .outer_momentum = 0.9, .nesterov = true};
  run_ranks(2, [&](comm::ProcessGroup& g) {
    auto net = make_net();
    auto alone = make_net();
    auto alone_optimizer = sgd(alone, 0.0);
    LocalSgdOptimizer optimizer(net.ptr(), sgd(net, 0.0), g, mode);
    auto global = parameters_of(alone);
    std::vector<torch::Tensor> momentum;
    for (const auto& p : global) momentum.push_back(torch::zeros_like(p));
    int step = 0;
    for (int round = 0; round < 2; ++round) {
      for (int k = 0; k < mode.inner_steps; ++k, ++step) {
        train_step(net, optimizer, g.rank(), step);
        train_step(alone, *alone_optimizer, g.rank(), step);
      }
      auto local = parameters_of(alone);
      for (size_t i = 0; i < global.size(); ++i) {
        std::vector<torch::Tensor> delta{global[i] - local[i]};
        g.allreduce(delta, comm::ReduceOp::kAvg);
        momentum[i] = mode.outer_momentum * momentum[i] + delta[0];
        global[i] = global[i] - mode.outer_lr * (delta[0] + mode.outer_momentum * momentum[i]);
      }
      // The reference continues from the new global parameters, as every replica does.
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < global.size(); ++i) alone->parameters()[i].copy_(global[i]);
    }
    expect_close(parameters_of(net), global, 1e-5);
  });
}

// A peer lost in a synchronisation: the error reaches the step's caller; the inner step stands
// (live recovery counts the step as taken), nothing of the synchronisation is applied, and the
// next step synchronises.
TEST(LocalSgdOptimizer, ASynchronisationAPeerLeavesChangesNothingButTheInnerStepStands) {
  run_ranks(2,
            [&](comm::ProcessGroup& g) {
              auto net = make_net();
              auto alone = make_net();
              auto alone_optimizer = sgd(alone);
              LocalSgdOptimizer optimizer(net.ptr(), sgd(net), g, LocalSgd{.every = 2});
              train_step(net, optimizer, g.rank(), 0);
              train_step(alone, *alone_optimizer, g.rank(), 0);
              EXPECT_FALSE(optimizer.stepped_before_failure());
              if (g.rank() == 1) return;  // it leaves before the synchronisation
              std::map<std::string, torch::Tensor> global;
              for (const auto& [name, tensor] : optimizer.global_state())
                global[name] = tensor.clone();
              EXPECT_THROW(train_step(net, optimizer, 0, 1), PeerFailureError);
              train_step(alone, *alone_optimizer, 0, 1);
              EXPECT_TRUE(optimizer.stepped_before_failure());
              expect_close(parameters_of(net), parameters_of(alone), 0);
              for (const auto& [name, tensor] : optimizer.global_state())
                EXPECT_TRUE(torch::equal(tensor, global.at(name))) << name;
              EXPECT_EQ(optimizer.synchronizations(), 0);
              EXPECT_EQ(optimizer.steps_since_sync(), 2);  // due at the next step
            },
            {.timeout = std::chrono::seconds(60)});
}

// Live recovery's view of a replica: as another rank of another group, the outer momentum on
// every rank; and a rank given another's replica ("replica_from") asks for that rank's piece.
TEST(LocalSgdOptimizer, AReplicaAsAnotherRankOfAnotherGroupLoadsThere) {
  const DiLoCo mode{.inner_steps = 2, .outer_lr = 0.7, .outer_momentum = 0.9, .nesterov = true};
  run_ranks(2, [&](comm::ProcessGroup& g) {
    auto net = make_net();
    LocalSgdOptimizer optimizer(net.ptr(), sgd(net, 0.0), g, mode);
    for (int s = 0; s < 3; ++s) train_step(net, optimizer, g.rank(), s);
    const std::string weight = std::string(optim::kReplicaTensors) + "0.weight";
    const auto state = optimizer.replica_state_as(2, 3);
    EXPECT_EQ(state.shard, 2);
    EXPECT_EQ(state.shards, 3);
    const auto& piece = state.tensors.at(weight);
    const int64_t n = piece.values.numel();
    EXPECT_EQ(piece.offset, 2 * n);
    EXPECT_EQ(piece.numel, 3 * n);
    EXPECT_TRUE(torch::equal(piece.values, net->parameters()[0].detach().reshape(-1)));
    EXPECT_EQ(state.tensors.at(std::string(optim::kMomentumTensors) + "0.weight").offset, 0);
    EXPECT_EQ(state.values["world_size"], 3);
    EXPECT_EQ(state.values["steps_since_sync"], 1);
    testing::expect_error<UsageError>([&] { optimizer.replica_state_as(3, 3); },
                                      "a rank is in [0, world_size)");
    auto values = optimizer.state_dict().values;
    EXPECT_EQ(optimizer.state_to_load(values).tensors.at(weight).offset, g.rank() * n);
    values["replica_from"] = 1;
    EXPECT_EQ(optimizer.state_to_load(values).tensors.at(weight).offset, n);
    values["replica_from"] = 2;
    testing::expect_error<UsageError>([&] { optimizer.state_to_load(values); },
                                      "the replica of rank 2 of the 2");
  });
}

TEST(LocalSgdOptimizer, LrChangesReachTheInnerOptimizerWhoseStateIsSavedAndLoaded) {
  run_ranks(1, [&](comm::ProcessGroup& g) {
    auto net = make_net();
    LocalSgdOptimizer optimizer(net.ptr(), sgd(net), g, LocalSgd{.every = 4});
    for (auto& group : optimizer.param_groups()) group.options().set_lr(0.0);
    const auto before = parameters_of(net);
    train_step(net, optimizer, 0, 0);
    expect_close(parameters_of(net), before, 0);  // lr 0: no change
    for (auto& group : optimizer.param_groups()) group.options().set_lr(0.05);
    train_step(net, optimizer, 0, 1);
    std::stringstream saved;
    torch::save(optimizer, saved);
    auto other_net = make_net();
    LocalSgdOptimizer other(other_net.ptr(), sgd(other_net), g, LocalSgd{.every = 4});
    torch::load(other, saved);
    // The inner state comes back (SGD's momentum buffers), and this optimizer's options are the
    // inner one's after loading (libtorch's SGD keeps its own lr; cohort's flat ones load it).
    ASSERT_EQ(other.inner().state().size(), optimizer.inner().state().size());
    EXPECT_GT(other.inner().state().size(), 0u);
    EXPECT_DOUBLE_EQ(other.param_groups()[0].options().get_lr(),
                     other.inner().param_groups()[0].options().get_lr());
  });
}

TEST(LocalSgdOptimizer, RejectsAnOptimizerOverOtherParametersNamingOne) {
  run_ranks(1, [&](comm::ProcessGroup& g) {
    auto net = make_net();
    auto partial = std::make_unique<torch::optim::SGD>(
        std::vector<torch::Tensor>{net->parameters()[0]}, torch::optim::SGDOptions(0.1));
    testing::expect_error<UsageError>(
        [&] { LocalSgdOptimizer(net.ptr(), std::move(partial), g, LocalSgd{}); },
        "parameter '0.bias' of the module is not in the optimizer");
    testing::expect_error<UsageError>(
        [&] { LocalSgdOptimizer(net.ptr(), sgd(net), g, Synchronous{}); },
        "the sync mode is ddp, not local-sgd or diloco");
    testing::expect_error<UsageError>([&] { LocalSgdOptimizer(net.ptr(), nullptr, g, LocalSgd{}); },
                                      "null");
  });
}

}  // namespace
}  // namespace cohort::parallel

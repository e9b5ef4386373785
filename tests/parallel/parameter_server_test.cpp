#include "cohort/parallel/parameter_server.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <future>
#include <map>
#include <mutex>

#include "cohort/error.h"
#include "comm/handshake.h"
#include "comm/socket.h"
#include "small_net.h"
#include "support/expect.h"
#include "support/local_group.h"

namespace cohort::parallel {
namespace {

using testing::make_net;
using testing::parameters_of;
using testing::train_step;

using cohort::testing::run_ranks;

// One worker and one server: the server's optimizer is the worker's, stepped on the same
// gradients, so the trajectory is torch::optim's (SGD with momentum, and Adam).
TEST(ParameterServer, OneWorkerFollowsItsOptimizerExactly) {
  for (const bool adam : {false, true}) {
    auto reference = make_net();
    std::unique_ptr<torch::optim::Optimizer> plain =
        adam ? std::unique_ptr<torch::optim::Optimizer>(std::make_unique<torch::optim::Adam>(
                   reference->parameters(), torch::optim::AdamOptions(0.01)))
             : std::make_unique<torch::optim::SGD>(reference->parameters(),
                                                   torch::optim::SGDOptions(0.1).momentum(0.9));
    for (int step = 0; step < 6; ++step) train_step(reference, *plain, 0, step);
    run_ranks(1, [&](comm::ProcessGroup& group) {
      auto net = make_net();
      std::unique_ptr<torch::optim::Optimizer> inner =
          adam ? std::unique_ptr<torch::optim::Optimizer>(std::make_unique<torch::optim::Adam>(
                     net->parameters(), torch::optim::AdamOptions(0.01)))
               : std::make_unique<torch::optim::SGD>(net->parameters(),
                                                     torch::optim::SGDOptions(0.1).momentum(0.9));
      ParameterServerOptimizer ps(net.ptr(), std::move(inner), group,
                                  {.max_staleness = 0, .servers = 1});
      for (int step = 0; step < 6; ++step) train_step(net, ps, 0, step);
      const auto got = parameters_of(*net);
      const auto want = parameters_of(*reference);
      for (size_t i = 0; i < got.size(); ++i)
        EXPECT_TRUE(torch::allclose(got[i], want[i], 1e-6, 1e-6)) << (adam ? "adam " : "sgd ") << i;
      EXPECT_EQ(ps.stats().pushes, 6);
      EXPECT_EQ(ps.stats().staleness_max, 0) << "nobody else pushes";
    });
  }
}

// A loss whose gradient is constant makes plain SGD's updates commute: whatever order the
// servers apply the pushes in, after a synchronisation every rank holds the start minus lr times
// every gradient pushed, so every push was applied exactly once, on every shard.
// `steps` pushes of the rank's constant gradient, rank + 1 in every element (d/dp of
// sum(p * (rank + 1))), then a sync.
void push_rank_gradients(ParameterServerOptimizer& ps, torch::nn::Module& net, int rank,
                         int steps) {
  for (int step = 0; step < steps; ++step) {
    ps.zero_grad();
    torch::Tensor loss = torch::zeros({});
    for (const auto& p : net.parameters()) loss = loss + (p * (rank + 1)).sum();
    loss.backward();
    ps.step();
  }
  ps.sync();
}

TEST(ParameterServer, EveryPushIsAppliedOnceOnEveryShard) {
  constexpr int kWorld = 3;
  constexpr int kSteps = 7;
  for (const int servers : {1, 2, 3}) {
    run_ranks(kWorld, [&](comm::ProcessGroup& group) {
      auto net = make_net();
      const auto start = parameters_of(*net);
      auto inner =
          std::make_unique<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.01));
      ParameterServerOptimizer ps(net.ptr(), std::move(inner), group,
                                  {.max_staleness = 2, .servers = servers});
      push_rank_gradients(ps, *net, group.rank(), kSteps);
      // Every rank's gradient (r + 1) was applied kSteps times: 0.01 * 7 * (1 + 2 + 3).
      const auto now = parameters_of(*net);
      for (size_t i = 0; i < now.size(); ++i) {
        EXPECT_TRUE(torch::allclose(now[i], start[i] - 0.01 * kSteps * 6.0, 1e-5, 1e-5))
            << servers << " servers, parameter " << i;
      }
      EXPECT_EQ(ps.stats().pushes, kSteps);
      EXPECT_LE(ps.stats().staleness_max, (2 + 1) * (kWorld - 1));
      EXPECT_GT(ps.stats().bytes_sent, 0);
      EXPECT_EQ(ps.shard_ranges().size(), static_cast<size_t>(servers));
      EXPECT_EQ(ps.shard_ranges().back().second, ps.numel());
    });
  }
}

// What no worker of this run sends, on connections of another program: each is logged and closed,
// and the run's pushes are applied as if nobody had connected. One without the job's secret is
// closed before a byte of its request is read; the others prove it, then send what no worker does.
TEST(ParameterServer, MalformedRequestsCloseTheirConnectionAndTheRunGoesOn) {
  struct Request {  // src/parallel/parameter_server.cpp's, as a worker sends it
    uint32_t magic = 0x31535043;
    uint32_t kind = 1;
    int64_t worker = 0;
    int64_t base_version = 0;
    double lr = 0.01;
    int64_t numel = 0;
  };
  constexpr int kSteps = 5;
  run_ranks(2, [&](comm::ProcessGroup& group) {
    auto net = make_net();
    const auto start = parameters_of(*net);
    ParameterServerOptimizer ps(
        net.ptr(),
        std::make_unique<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.01)),
        group, {.max_staleness = 1, .servers = 1});
    std::vector<int> intruders;
    if (group.rank() == 0) {
      const auto connect = [&] {
        intruders.push_back(
            comm::socket::connect_to(ps.server_address(), std::chrono::seconds(5), "the server"));
        return intruders.back();
      };
      const auto send = [&](const void* data, size_t bytes) {
        const int fd = connect();
        comm::prove_secret(fd, group.secret(),
                           std::chrono::steady_clock::now() + std::chrono::seconds(5),
                           "the server");
        comm::socket::write_all(fd, data, bytes, "the server", std::chrono::seconds(5));
      };
      Request unproven;  // a well-formed pull, sent where the proof of the secret belongs
      unproven.kind = 2;
      std::string unproven_bytes(reinterpret_cast<const char*>(&unproven), sizeof unproven);
      unproven_bytes.resize(comm::kClientProofBytes);  // as long as a proof: judged at once
      comm::socket::write_all(connect(), unproven_bytes.data(), unproven_bytes.size(), "the server",
                              std::chrono::seconds(5));
      // Its challenge is all the server ever sent it.
      std::string challenge(comm::kChallengeBytes, '\0');
      comm::socket::read_all(intruders.back(), challenge.data(), challenge.size(),
                             std::chrono::seconds(5), "the server");
      const std::string garbage(sizeof(Request), 'x');
      send(garbage.data(), garbage.size());  // no magic
      Request stranger;
      stranger.worker = 99;  // no worker of this run
      send(&stranger, sizeof stranger);
      Request nan_lr;
      nan_lr.lr = std::nan("");  // a push that would poison the model
      nan_lr.numel = ps.numel();
      send(&nan_lr, sizeof nan_lr);
      Request unknown;
      unknown.kind = 77;
      send(&unknown, sizeof unknown);
      send(&stranger, 4);  // half a request, then silence
    }
    group.barrier();
    push_rank_gradients(ps, *net, group.rank(), kSteps);
    // Both ranks' gradients (1 and 2) applied kSteps times, and nothing else: 0.01 * 5 * 3.
    const auto now = parameters_of(*net);
    for (size_t i = 0; i < now.size(); ++i)
      EXPECT_TRUE(torch::allclose(now[i], start[i] - 0.01 * kSteps * 3.0, 1e-5, 1e-5)) << i;
    EXPECT_EQ(ps.stats().pushes, kSteps);
    for (int fd : intruders) {
      // Each intruder's connection was closed by the server (end of stream, nothing sent).
      pollfd closed{fd, POLLIN, 0};
      EXPECT_EQ(::poll(&closed, 1, 10'000), 1) << "an intruder's connection is still open";
      char byte = 0;
      EXPECT_EQ(::recv(fd, &byte, 1, MSG_DONTWAIT), 0);
      ::close(fd);
    }
  });
}

// Stale synchronous parallel: with max_staleness 1, a worker may push one step ahead of the
// slowest; its second push waits, here past the group's deadline, as the other (running, not
// finished: a finished worker holds nobody back) never pushes.
TEST(ParameterServer, AWorkerMoreThanKStepsAheadWaitsForTheSlowest) {
  std::promise<void> timed_out;
  auto rank0_done = timed_out.get_future().share();
  run_ranks(
      2,
      [&](comm::ProcessGroup& group) {
        auto net = make_net();
        auto inner =
            std::make_unique<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.01));
        ParameterServerOptimizer ps(net.ptr(), std::move(inner), group,
                                    {.max_staleness = 1, .servers = 2});
        if (group.rank() == 0) {
          train_step(net, ps, 0, 0);  // one ahead of rank 1: allowed
          testing::expect_error<TimeoutError>([&] { train_step(net, ps, 0, 1); },
                                              "a worker more than 1 steps behind holds it back");
          timed_out.set_value();
        } else {
          ASSERT_EQ(rank0_done.wait_for(std::chrono::seconds(30)), std::future_status::ready);
        }
      },
      {.timeout = std::chrono::milliseconds(1500)});
}

// What train::load_state does with files, from states in memory: each piece `wanted` holds is
// copied from the pieces of `saved` that overlap it; the values are the first's.
optim::StateDict fill(optim::StateDict wanted, const std::vector<optim::StateDict>& saved) {
  torch::NoGradGuard no_grad;
  for (auto& [name, piece] : wanted.tensors) {
    int64_t covered = 0;
    for (const auto& state : saved) {
      const auto found = state.tensors.find(name);
      if (found == state.tensors.end()) continue;
      const auto& from = found->second;
      const int64_t lo = std::max(piece.offset, from.offset);
      const int64_t hi =
          std::min(piece.offset + piece.values.numel(), from.offset + from.values.numel());
      if (lo >= hi) continue;
      piece.values.narrow(0, lo - piece.offset, hi - lo)
          .copy_(from.values.narrow(0, lo - from.offset, hi - lo));
      covered += hi - lo;
    }
    EXPECT_EQ(covered, piece.values.numel()) << name;
  }
  wanted.values = saved.front().values;
  return wanted;
}

// sync() brings every rank to the servers' parameters; the servers' optimizer state at that
// point is a checkpoint's part cut as ZeRO's (by parameter name), which loads exactly into as
// many servers or another number of them.
TEST(ParameterServer, StateLoadsIntoAnyNumberOfServers) {
  std::vector<optim::StateDict> saved(2);
  std::vector<torch::Tensor> synced;
  std::mutex mutex;
  run_ranks(2, [&](comm::ProcessGroup& group) {
    auto net = make_net();
    auto inner =
        std::make_unique<torch::optim::Adam>(net->parameters(), torch::optim::AdamOptions(0.01));
    ParameterServerOptimizer ps(net.ptr(), std::move(inner), group,
                                {.max_staleness = 1, .servers = 2});
    for (int step = 0; step < 5; ++step) train_step(net, ps, group.rank(), step);
    ps.prepare_checkpoint();
    EXPECT_TRUE(ps.writes_state());
    auto state = ps.state_dict();
    for (auto& [name, piece] : state.tensors) piece.values = piece.values.clone();
    std::lock_guard lock(mutex);
    saved[static_cast<size_t>(group.rank())] = std::move(state);
    if (group.rank() == 0) synced = parameters_of(*net);
  });
  EXPECT_EQ(saved[0].shard, 0);
  EXPECT_EQ(saved[1].shards, 2);
  EXPECT_EQ(saved[0].values["version"], 10) << "two workers, five pushes each";
  EXPECT_EQ(saved[0].values["pushes_by_worker"], Json::array({5, 5}));
  EXPECT_EQ(saved[0].values["steps"], 10);
  EXPECT_EQ(saved[0].values["algorithm"], "adam");
  // Every element of every parameter's state is in exactly one server's pieces.
  std::map<std::string, torch::Tensor> whole;
  for (const auto& state : saved) {
    for (const auto& [name, piece] : state.tensors) {
      auto& w = whole[name];
      if (!w.defined()) w = torch::full({piece.numel}, std::nan(""));
      w.narrow(0, piece.offset, piece.values.numel()).copy_(piece.values);
    }
  }
  ASSERT_EQ(whole.size(), 2 * synced.size()) << "exp_avg and exp_avg_sq of every parameter";
  for (const auto& [name, w] : whole) EXPECT_FALSE(w.isnan().any().item<bool>()) << name;
  for (const int world : {1, 3}) {
    run_ranks(world, [&](comm::ProcessGroup& group) {
      auto net = make_net();
      {
        torch::NoGradGuard no_grad;
        for (size_t i = 0; i < synced.size(); ++i) net->parameters()[i].copy_(synced[i]);
      }
      auto inner =
          std::make_unique<torch::optim::Adam>(net->parameters(), torch::optim::AdamOptions(0.01));
      ParameterServerOptimizer ps(net.ptr(), std::move(inner), group,
                                  {.max_staleness = 1, .servers = world});
      ps.load_state_dict(fill(ps.state_dict(), saved));
      // Loaded, synchronised again: the state is the saved one, cut for `world` servers.
      ps.prepare_checkpoint();
      const auto mine = ps.state_dict();
      EXPECT_EQ(mine.values["version"], 10);
      EXPECT_EQ(mine.values["steps"], 10);
      for (const auto& [name, piece] : mine.tensors) {
        EXPECT_TRUE(torch::equal(piece.values,
                                 whole.at(name).narrow(0, piece.offset, piece.values.numel())))
            << name << " on " << world << " servers";
      }
      for (size_t i = 0; i < synced.size(); ++i)
        EXPECT_TRUE(torch::equal(net->parameters()[i], synced[i]));
    });
  }
  // A state without a piece of this server's range, or another optimizer's, is refused.
  run_ranks(1, [&](comm::ProcessGroup& group) {
    auto net = make_net();
    auto inner =
        std::make_unique<torch::optim::Adam>(net->parameters(), torch::optim::AdamOptions(0.01));
    ParameterServerOptimizer ps(net.ptr(), std::move(inner), group, {.servers = 1});
    auto partial = fill(ps.state_dict(), saved);
    partial.tensors.erase(partial.tensors.begin());
    testing::expect_error<UsageError>([&] { ps.load_state_dict(partial); },
                                      "it was written for another model");
  });
  run_ranks(1, [&](comm::ProcessGroup& group) {
    auto net = make_net();
    auto inner = std::make_unique<torch::optim::SGD>(net->parameters(),
                                                     torch::optim::SGDOptions(0.1).momentum(0.9));
    ParameterServerOptimizer ps(net.ptr(), std::move(inner), group, {.servers = 1});
    testing::expect_error<UsageError>([&] { ps.check_state(saved[0].values); },
                                      "resume with the optimizer that wrote it");
  });
}

TEST(ParameterServer, BadConfigurationsAreNamed) {
  testing::expect_error<UsageError>([] { parse_sync_mode("async-ps:-1"); }, "must be >= 0");
  testing::expect_error<UsageError>([] { parse_sync_mode("async-ps:x"); },
                                    "K 'x' is not an integer");
  EXPECT_EQ(std::get<AsyncParameterServer>(parse_sync_mode("async-ps:3")).max_staleness, 3);
  EXPECT_EQ(to_string(parse_sync_mode("async-ps:0")), "async-ps:0");
  testing::expect_error<UsageError>(
      [] { validate(SyncMode(AsyncParameterServer{.max_staleness = -2})); },
      "max_staleness -2 must be >= 0");
  run_ranks(2, [&](comm::ProcessGroup& group) {
    auto make = [&](int servers) {
      auto net = make_net();
      auto inner =
          std::make_unique<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.1));
      ParameterServerOptimizer ps(net.ptr(), std::move(inner), group, {.servers = servers});
    };
    testing::expect_error<UsageError>([&] { make(3); },
                                      "3 parameter servers for 2 workers: the servers run in the "
                                      "worker processes, so choose 1 to 2");
    testing::expect_error<UsageError>([&] { make(0); }, "0 parameter servers");
  });
  run_ranks(1, [&](comm::ProcessGroup& group) {
    auto net = make_net();
    auto groups = std::vector<torch::optim::OptimizerParamGroup>{
        torch::optim::OptimizerParamGroup({net->parameters()[0], net->parameters()[1]}),
        torch::optim::OptimizerParamGroup({net->parameters()[2], net->parameters()[3]})};
    auto two_groups = std::make_unique<torch::optim::SGD>(groups, torch::optim::SGDOptions(0.1));
    testing::expect_error<UsageError>(
        [&] { ParameterServerOptimizer(net.ptr(), std::move(two_groups), group, {.servers = 1}); },
        "2 param groups; the parameter servers support one");
    auto doubles = make_net();
    doubles->to(torch::kDouble);
    auto inner =
        std::make_unique<torch::optim::SGD>(doubles->parameters(), torch::optim::SGDOptions(0.1));
    testing::expect_error<UsageError>(
        [&] { ParameterServerOptimizer(doubles.ptr(), std::move(inner), group, {.servers = 1}); },
        "the parameter servers hold float32 parameters");
    auto other = make_net();
    auto rms = std::make_unique<torch::optim::RMSprop>(other->parameters());
    testing::expect_error<UsageError>(
        [&] { ParameterServerOptimizer(other.ptr(), std::move(rms), group, {.servers = 1}); },
        "the parameter servers step only those");
  });
}

}  // namespace
}  // namespace cohort::parallel

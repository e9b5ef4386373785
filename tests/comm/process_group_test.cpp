#include "cohort/comm/process_group.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <future>

#include "cohort/error.h"
#include "support/local_group.h"

namespace cohort::comm {
namespace {

using cohort::testing::run_ranks;

TEST(ProcessGroup, AllreduceSumsAndAverages) {
  run_ranks(3, [](ProcessGroup& g) {
    std::vector<at::Tensor> t{torch::full({4}, g.rank() + 1.0)};
    g.allreduce(t);
    EXPECT_TRUE(torch::equal(t[0], torch::full({4}, 6.0)));
    std::vector<at::Tensor> a{torch::full({2}, g.rank() * 3.0)};
    g.allreduce(a, ReduceOp::kAvg);
    EXPECT_TRUE(torch::allclose(a[0], torch::full({2}, 3.0)));
    std::vector<at::Tensor> m{torch::full({1}, double(g.rank()))};
    g.allreduce(m, ReduceOp::kMax);
    EXPECT_EQ(m[0].item<double>(), 2.0);
  });
}

TEST(ProcessGroup, BroadcastAllgatherBarrier) {
  run_ranks(2, [](ProcessGroup& g) {
    std::vector<at::Tensor> t{g.rank() == 0 ? torch::arange(5.0) : torch::zeros({5})};
    g.broadcast(t, 0);
    EXPECT_TRUE(torch::equal(t[0], torch::arange(5.0)));
    auto all = g.allgather(torch::full({2}, double(g.rank())));
    ASSERT_EQ(all.size(), 2u);
    EXPECT_EQ(all[1][0].item<double>(), 1.0);
    g.barrier();
  });
}

TEST(ProcessGroup, SetupTimeoutNamesTheMissingRanks) {
  auto server = Store::connect({.is_server = true, .timeout = std::chrono::seconds(5)});
  try {
    ProcessGroup::create(server, 0, 3, {.setup_timeout = std::chrono::milliseconds(300)});
    FAIL() << "setup should time out";
  } catch (const TimeoutError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("ranks [1, 2] of 3 did not join"), std::string::npos) << what;
    EXPECT_NE(what.find("127.0.0.1:" + std::to_string(server.port())), std::string::npos) << what;
  }
}

TEST(ProcessGroup, CollectiveTimeoutWhenAPeerSkipsTheCall) {
  std::promise<void> rank0_done;
  auto done = rank0_done.get_future().share();
  run_ranks(
      2,
      [&](ProcessGroup& g) {
        if (g.rank() == 1) {
          // Alive but never enters the collective; leaves once rank 0 has given up.
          done.wait();
          return;
        }
        std::vector<at::Tensor> t{torch::ones({1})};
        EXPECT_THROW(g.allreduce(t), TimeoutError);
        rank0_done.set_value();
      },
      {.timeout = std::chrono::milliseconds(500)});
}

TEST(ProcessGroup, RejectsARankOutsideTheWorld) {
  auto server = Store::connect({.is_server = true});
  EXPECT_THROW(ProcessGroup::create(server, 2, 2), UsageError);
}

}  // namespace
}  // namespace cohort::comm

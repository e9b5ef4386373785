// Collectives on CUDA tensors: NCCL at world size 1 (it refuses two ranks on one GPU), and two
// ranks sharing one GPU through Gloo's CUDA path. Skipped without a GPU.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "cohort/comm/process_group.h"
#include "cohort/error.h"
#include "support/cuda.h"
#include "support/expect.h"
#include "support/local_group.h"

namespace cohort::comm {
namespace {

using cohort::testing::expect_error;
using cohort::testing::run_ranks;

const torch::Device kGpu(torch::kCUDA, 0);

// The same checks on any group whose ranks all use GPU 0.
void check_collectives_on_the_gpu(ProcessGroup& g) {
  const int n = g.world_size();
  const double r = g.rank();
  std::vector<at::Tensor> sum{torch::full({1000}, r + 1, kGpu)};
  g.allreduce(sum);
  EXPECT_TRUE(sum[0].is_cuda());
  EXPECT_EQ(sum[0][999].item<double>(), n * (n + 1) / 2.0);
  std::vector<at::Tensor> avg{torch::full({4}, r, kGpu)};
  g.allreduce(avg, ReduceOp::kAvg);
  EXPECT_NEAR(avg[0][0].item<double>(), (n - 1) / 2.0, 1e-6);

  std::vector<at::Tensor> b{g.rank() == 0 ? torch::arange(5.0, kGpu) : torch::zeros({5}, kGpu)};
  g.broadcast(b, 0);
  EXPECT_TRUE(torch::equal(b[0].cpu(), torch::arange(5.0)));

  auto gathered = torch::empty({n, 3}, kGpu);
  g.allgather_into(gathered, torch::full({3}, r, kGpu));
  for (int k = 0; k < n; ++k) EXPECT_EQ(gathered[k][2].item<double>(), k);

  auto part = torch::empty({2}, kGpu);
  g.reduce_scatter_tensor(part, torch::arange(2.0 * n, kGpu));
  EXPECT_TRUE(torch::equal(part.cpu(), torch::arange(2.0 * r, 2.0 * r + 2) * n));

  // The work is stream-ordered: a kernel queued after wait() sees the result.
  std::vector<at::Tensor> t{torch::ones({1 << 20}, kGpu)};
  auto work = g.allreduce_async(t);
  work.wait();
  auto doubled = t[0] * 2;
  work.synchronize();
  EXPECT_EQ(doubled[0].item<double>(), 2.0 * n);
}

TEST(CudaCollectives, NcclAtWorldSizeOne) {
  COHORT_REQUIRE_CUDA();
  if (!nccl_available()) GTEST_SKIP() << "this CUDA libtorch has no NCCL group";
  run_ranks(1, [](ProcessGroup& g) {
    check_collectives_on_the_gpu(g);
    auto out = torch::empty({4}, kGpu);
    g.all_to_all(out, torch::arange(4.0, kGpu));
    EXPECT_TRUE(torch::equal(out.cpu(), torch::arange(4.0)));
    // CPU tensors still go through Gloo in an auto group.
    std::vector<at::Tensor> cpu{torch::ones({2})};
    g.allreduce(cpu);
    EXPECT_EQ(cpu[0][0].item<double>(), 1.0);
  });
  run_ranks(1,
            [](ProcessGroup& g) {
              std::vector<at::Tensor> cpu{torch::ones({2})};
              expect_error<UsageError>([&] { g.allreduce(cpu); },
                                       "a CPU tensor given to a NCCL group");
            },
            {.backend = Backend::kNccl});
}

TEST(CudaCollectives, TwoRanksShareOneGpuThroughGloo) {
  COHORT_REQUIRE_CUDA();
  run_ranks(2,
            [](ProcessGroup& g) {
              check_collectives_on_the_gpu(g);
              // Point to point from device memory (staged through the host for Gloo).
              if (g.rank() == 0) {
                g.send(torch::full({3}, 7.0, kGpu), 1, 3);
              } else {
                auto got = torch::empty({3}, kGpu);
                g.recv(got, 0, 3);
                EXPECT_EQ(got[1].item<double>(), 7.0);
              }
            },
            {.backend = Backend::kGloo});
}

TEST(CudaCollectives, SubGroupsOnTheGpu) {
  COHORT_REQUIRE_CUDA();
  run_ranks(3,
            [](ProcessGroup& g) {
              auto pair = g.new_group({0, 2});
              if (!pair.valid()) return;
              check_collectives_on_the_gpu(pair);
            },
            {.backend = Backend::kGloo});
}

}  // namespace
}  // namespace cohort::comm

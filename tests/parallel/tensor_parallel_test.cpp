#include "cohort/parallel/tensor_parallel.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <algorithm>
#include <iostream>
#include <limits>
#include <mutex>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "cohort/error.h"
#include "support/cuda.h"
#include "support/local_group.h"

namespace cohort::parallel {
namespace {

using cohort::testing::generator_mutex;
using cohort::testing::run_ranks;

template <typename Make>
auto seeded(int seed, Make make) {
  std::lock_guard lock(generator_mutex());
  torch::manual_seed(seed);
  return make();
}

void expect_same_parameters(torch::nn::Module& a, torch::nn::Module& b, double tol) {
  const auto pa = a.named_parameters(), pb = b.named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_TRUE(torch::allclose(pa[i].value(), pb[i].value(), tol, tol))
        << pa[i].key() << ": largest difference "
        << (pa[i].value() - pb[i].value()).abs().max().item<double>();
  }
}

// A tensor-parallel module against its dense version: the same output, the same input gradient,
// and after one SGD step the slices of the dense module's new weights.
template <typename Parallel, typename Dense>
void expect_matches_dense(comm::ProcessGroup& group, Parallel parallel, Dense dense, Parallel fresh,
                          const at::Tensor& x) {
  parallel->load_from_dense(dense);
  // tensor_parallel_cuts names every slice and its cut (the dense module lists its parameters in
  // the same order): each is that slice of the dense parameter, and set_tensor_parallel_slice
  // writes it back into that region only; the other parameters are whole.
  {
    const auto cuts = tensor_parallel_cuts(*parallel);
    const auto sliced = parallel->named_parameters(), whole = dense->named_parameters();
    // fc1's weight and bias and fc2's weight; in_proj's weight and bias and out_proj's weight.
    EXPECT_EQ(cuts.size(), 3u);
    ASSERT_EQ(sliced.size(), whole.size());
    for (size_t i = 0; i < sliced.size(); ++i) {
      const auto cut = cuts.find(sliced[i].key());
      if (cut == cuts.end()) {
        EXPECT_TRUE(torch::equal(sliced[i].value(), whole[i].value())) << sliced[i].key();
        continue;
      }
      const at::Tensor slice = tensor_parallel_slice(whole[i].value().detach(), cut->second,
                                                     group.rank(), group.world_size());
      EXPECT_TRUE(torch::equal(slice, sliced[i].value())) << sliced[i].key();
      at::Tensor region = torch::zeros_like(whole[i].value().detach());
      set_tensor_parallel_slice(region, cut->second, group.rank(), group.world_size(), slice);
      EXPECT_TRUE(torch::equal(
          tensor_parallel_slice(region, cut->second, group.rank(), group.world_size()), slice));
      EXPECT_EQ(region.ne(0).sum().item<int64_t>(), slice.ne(0).sum().item<int64_t>());
    }
  }
  const at::Tensor xp = x.clone().requires_grad_(true), xd = x.clone().requires_grad_(true);
  const at::Tensor yp = parallel->forward(xp);
  at::Tensor yd;
  if constexpr (std::is_same_v<Dense, torch::nn::MultiheadAttention>) {
    yd = std::get<0>(dense->forward(xd, xd, xd, {}, /*need_weights=*/false));
  } else {
    yd = dense->forward(xd);
  }
  EXPECT_TRUE(torch::allclose(yp, yd, 1e-5, 1e-6)) << "output on rank " << group.rank();
  // A loss that weighs every output element differently.
  const at::Tensor w = seeded(9, [&] { return torch::randn(yd.sizes()); }).to(yd.device());
  (yp * w).sum().backward();
  (yd * w).sum().backward();
  EXPECT_TRUE(torch::allclose(xp.grad(), xd.grad(), 1e-5, 1e-6)) << "input gradient";
  torch::optim::SGD(parallel->parameters(), 1.0).step();
  torch::optim::SGD(dense->parameters(), 1.0).step();
  fresh->load_from_dense(dense);
  expect_same_parameters(*parallel, *fresh, 1e-5);
  // Gathered from the ranks' slices, the weights are the dense module's (load_from_dense's
  // inverse, e.g. for a checkpoint of the unsplit model).
  Dense gathered(std::dynamic_pointer_cast<typename Dense::ContainedType>(dense->clone()));
  {
    torch::NoGradGuard no_grad;
    for (auto& p : gathered->parameters()) p.zero_();
  }
  parallel->copy_to_dense(gathered);
  expect_same_parameters(*gathered, *dense, 1e-5);
}

void expect_mlp_matches_dense(torch::Device device, comm::ProcessGroupOptions options) {
  // Each rank a process of its own, as GPU ranks must be (see run_rank_processes).
  testing::run_rank_processes(
      2,
      [&](comm::ProcessGroup& group) {
        auto dense = seeded(3, [] {
          return torch::nn::Sequential(torch::nn::Linear(12, 32), torch::nn::GELU(),
                                       torch::nn::Linear(32, 12));
        });
        const at::Tensor x = seeded(4, [] { return torch::randn({5, 12}); }).to(device);
        // Every draw from torch's generator under its lock: another rank's draws would change
        // this rank's dense weights.
        auto [parallel, fresh] = seeded(0, [&] {
          return std::pair{TensorParallelMlp(12, 32, group), TensorParallelMlp(12, 32, group)};
        });
        dense->to(device);
        parallel->to(device);
        fresh->to(device);
        expect_matches_dense(group, parallel, dense, fresh, x);
      },
      options);
}

TEST(TensorParallel, MlpMatchesTheDenseMlp) {
  expect_mlp_matches_dense(torch::kCPU, {.timeout = std::chrono::seconds(30)});
}

// On the GPU, two ranks sharing it: the all-reduces through Gloo's CUDA path.
TEST(TensorParallel, MlpMatchesTheDenseMlpOnTheGpu) {
  COHORT_REQUIRE_CUDA();
  expect_mlp_matches_dense(torch::kCUDA, testing::gpu_group_options());
}

TEST(TensorParallel, SelfAttentionMatchesMultiheadAttention) {
  run_ranks(2, [](comm::ProcessGroup& group) {
    auto dense = seeded(5, [] { return torch::nn::MultiheadAttention(16, 4); });
    const at::Tensor x = seeded(6, [] { return torch::randn({7, 3, 16}); });  // tokens, batch
    auto [parallel, fresh] = seeded(0, [&] {
      return std::pair{TensorParallelSelfAttention(16, 4, group),
                       TensorParallelSelfAttention(16, 4, group)};
    });
    expect_matches_dense(group, parallel, dense, fresh, x);
  });
}

#if TORCH_VERSION_MAJOR >= 2
// The names of the nodes of y's autograd graph.
std::set<std::string> graph_node_names(const at::Tensor& y) {
  std::set<std::string> names;
  // The type grad_fn() gives (an intrusive_ptr on libtorch 2.x).
  std::vector<std::decay_t<decltype(y.grad_fn())>> open{y.grad_fn()};
  std::set<const torch::autograd::Node*> seen;
  while (!open.empty()) {
    const auto node = open.back();
    open.pop_back();
    if (!node || !seen.insert(node.get()).second) continue;
    names.insert(node->name());
    for (const auto& edge : node->next_edges()) open.push_back(edge.function);
  }
  return names;
}
#endif

// A ViT's and a GPT's attention (the zoo's blocks call self_attention_heads) on `device`: the
// values of torch::nn::MultiheadAttention, with a decoder's mask as a tensor where causal, and on
// libtorch 2.x a fused kernel, so that backward keeps no [tokens, tokens] weights of its own: no
// softmax in the graph. CUDA's fused kernels take q, k and v in four dimensions only; given
// three, libtorch runs its math kernel there (on the CPU, 2.14 runs flash attention either way).
void expect_attention_heads_through_a_fused_kernel(torch::Device device) {
  auto dense = seeded(10, [] { return torch::nn::MultiheadAttention(32, 4); });
  dense->to(device);
  const at::Tensor x = seeded(11, [] { return torch::randn({24, 3, 32}); }).to(device);
  for (const bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "every token");
    const at::Tensor xa = x.clone().requires_grad_(true), xd = x.clone().requires_grad_(true);
    const at::Tensor y = self_attention_heads(xa, dense->in_proj_weight, dense->in_proj_bias,
                                              /*heads=*/4, causal);
    at::Tensor mask;
    if (causal) {
      mask = torch::full({24, 24}, -std::numeric_limits<float>::infinity(), x.options()).triu(1);
    }
    const at::Tensor yd = std::get<0>(dense->forward(xd, xd, xd, {}, false, mask));
    EXPECT_TRUE(torch::allclose(dense->out_proj->forward(y), yd, 1e-5, 1e-5))
        << "largest difference " << (dense->out_proj->forward(y) - yd).abs().max().item<double>();
    const at::Tensor w = seeded(12, [&] { return torch::randn(yd.sizes()); }).to(device);
    (dense->out_proj->forward(y) * w).sum().backward();
    (yd * w).sum().backward();
    EXPECT_TRUE(torch::allclose(xa.grad(), xd.grad(), 1e-5, 1e-5)) << "input gradient";
#if TORCH_VERSION_MAJOR >= 2
    const auto names = graph_node_names(y);
    std::string listed;
    for (const auto& name : names) listed += " " + name;
    EXPECT_TRUE(std::any_of(names.begin(), names.end(),
                            [](const std::string& name) {
                              return name.find("ScaledDotProduct") != std::string::npos &&
                                     name.find("Math") == std::string::npos;
                            }))
        << "no fused attention node among:" << listed;
    EXPECT_TRUE(std::none_of(
        names.begin(), names.end(),
        [](const std::string& name) { return name.find("Softmax") != std::string::npos; }))
        << "the math kernel ran:" << listed;
#else
    std::cout << "Not checked: a fused kernel. libtorch " << TORCH_VERSION
              << " has no scaled_dot_product_attention; the explicit softmax runs.\n";
#endif
  }
}

TEST(TensorParallel, SelfAttentionHeadsAreMultiheadAttentionThroughAFusedKernel) {
  expect_attention_heads_through_a_fused_kernel(torch::kCPU);
}

TEST(TensorParallel, SelfAttentionHeadsAreMultiheadAttentionThroughAFusedKernelOnTheGpu) {
  COHORT_REQUIRE_CUDA();
  expect_attention_heads_through_a_fused_kernel(torch::kCUDA);
}

TEST(TensorParallel, ColumnThenRowIsTheDenseProductWithOneAllReduceEachWay) {
  run_ranks(2, [](comm::ProcessGroup& group) {
    auto [a, b] = seeded(7, [] {
      return std::pair{torch::nn::Linear(6, 8), torch::nn::Linear(8, 6)};
    });
    auto [column, row] = seeded(0, [&] {
      return std::pair{ColumnParallelLinear(6, 8, group), RowParallelLinear(8, 6, group)};
    });
    column->load_from_dense(a);
    row->load_from_dense(b);
    EXPECT_EQ(column->weight.sizes(), (std::vector<int64_t>{4, 6}));
    EXPECT_EQ(row->weight.sizes(), (std::vector<int64_t>{6, 4}));
    const at::Tensor x = seeded(8, [] { return torch::randn({3, 6}); }).requires_grad_(true);
    const int64_t before = group.collectives_entered();
    const at::Tensor y = row->forward(column->forward(x));
    EXPECT_EQ(group.collectives_entered() - before, 1);
    y.sum().backward();
    EXPECT_EQ(group.collectives_entered() - before, 2);
    EXPECT_TRUE(torch::allclose(y, b->forward(a->forward(x)), 1e-5, 1e-6));
  });
}

TEST(TensorParallel, ADegreeThatDoesNotDivideIsNamed) {
  run_ranks(2, [](comm::ProcessGroup& group) {
    try {
      TensorParallelSelfAttention(15, 3, group);
      ADD_FAILURE() << "no error";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("heads: 3 is not divisible by the tensor-parallel "
                                           "degree 2"),
                std::string::npos)
          << e.what();
    }
    EXPECT_THROW(ColumnParallelLinear(4, 7, group), UsageError);
    EXPECT_THROW(TensorParallelMlp(4, 9, group), UsageError);
  });
}

}  // namespace
}  // namespace cohort::parallel

#include "parallel/gradient_buckets.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <mutex>
#include <string>
#include <vector>

namespace cohort::parallel::detail {
namespace {

std::vector<at::Tensor> tensors_of(const std::vector<int64_t>& numels,
                                   at::ScalarType dtype = at::kFloat) {
  std::vector<at::Tensor> params;
  for (int64_t n : numels) params.push_back(torch::zeros({n}, torch::dtype(dtype)));
  return params;
}

std::vector<std::vector<size_t>> members(const BucketLayout& layout) {
  std::vector<std::vector<size_t>> out;
  for (const auto& b : layout.buckets) out.push_back(b.params);
  return out;
}

TEST(LayOutBuckets, ClosesABucketBeforeTheParameterThatWouldTakeItOverItsCap) {
  // float32: 4 bytes an element. The first bucket's cap is 40 bytes, the others' 100.
  const auto params = tensors_of({6, 6, 10, 10, 20});
  const auto layout =
      lay_out_buckets(params, {4, 3, 2, 1, 0}, {.first_bucket_bytes = 40, .bucket_bytes = 100});
  // 20 elements (80 bytes) over the first cap still makes a bucket of its own: a parameter is
  // never split.
  EXPECT_EQ(members(layout), (std::vector<std::vector<size_t>>{{4}, {3, 2}, {1, 0}}));
  EXPECT_EQ(layout.offsets, (std::vector<int64_t>{46, 40, 30, 20, 0}));
  EXPECT_EQ(layout.bucket_of, (std::vector<size_t>{2, 2, 1, 1, 0}));
  EXPECT_EQ(layout.numel, 52);
}

TEST(LayOutBuckets, PadsEachBucketToAMultipleSoThatEveryRankGetsAnEqualPiece) {
  const auto params = tensors_of({3, 5, 2});
  const auto layout =
      lay_out_buckets(params, {2, 1, 0}, {.first_bucket_bytes = 8, .bucket_bytes = 8, .pad_to = 4});
  ASSERT_EQ(layout.buckets.size(), 3u);
  EXPECT_EQ(layout.buckets[0].numel, 4);  // 2 -> 4
  EXPECT_EQ(layout.buckets[1].offset, 4);
  EXPECT_EQ(layout.buckets[1].numel, 8);  // 5 -> 8
  EXPECT_EQ(layout.buckets[2].offset, 12);
  EXPECT_EQ(layout.offsets[0], 12);
  EXPECT_EQ(layout.numel, 16);
}

TEST(LayOutBuckets, KeepsAUnitWholeAndApartWhateverTheCap) {
  const auto params = tensors_of({4, 4, 4, 4, 4});
  const auto layout =
      lay_out_buckets(params, {0, 1, 2, 3, 4},
                      {.first_bucket_bytes = 1e9, .bucket_bytes = 8, .unit_of = {-1, 0, 0, 0, -1}});
  EXPECT_EQ(members(layout), (std::vector<std::vector<size_t>>{{0}, {1, 2, 3}, {4}}));
  EXPECT_EQ(layout.buckets[1].unit, 0);
  EXPECT_EQ(layout.buckets[0].unit, -1);
}

// A tied parameter alone in its bucket, with the buckets padded: its elements are the bucket's
// first, so that every engine holding a copy cuts the same pieces of it for the same ranks.
TEST(LayOutBuckets, PutsAParameterMarkedAloneInABucketOfItsOwn) {
  const auto params = tensors_of({3, 5, 2, 2});
  const auto layout = lay_out_buckets(
      params, {0, 1, 2, 3},
      {.first_bucket_bytes = 1e9, .bucket_bytes = 1e9, .pad_to = 2, .alone = {0, 1, 0, 0}});
  EXPECT_EQ(members(layout), (std::vector<std::vector<size_t>>{{0}, {1}, {2, 3}}));
  EXPECT_EQ(layout.buckets[1].offset, 4);
  EXPECT_EQ(layout.buckets[1].numel, 6);
  EXPECT_EQ(layout.offsets[1], layout.buckets[1].offset);
}

TEST(LayOutBuckets, NeverMixesDtypesInABucket) {
  auto params = tensors_of({2, 2});
  params.push_back(torch::zeros({2}, torch::kDouble));
  const auto layout =
      lay_out_buckets(params, {0, 1, 2}, {.first_bucket_bytes = 1e9, .bucket_bytes = 1e9});
  EXPECT_EQ(members(layout), (std::vector<std::vector<size_t>>{{0, 1}, {2}}));
}

TEST(StageGradient, CopiesIntoTheSlotAndPointsTheGradientThere) {
  auto param = torch::zeros({2, 3}).requires_grad_();
  auto flat = torch::full({8}, 7.0);
  auto slot = alias_into(flat, 1, param.sizes());
  param.mutable_grad() = torch::ones({2, 3});
  stage_gradient(param, slot, /*point_grad_at_slot=*/true);
  EXPECT_TRUE(torch::equal(flat, torch::tensor({7.F, 1.F, 1.F, 1.F, 1.F, 1.F, 1.F, 7.F})));
  EXPECT_EQ(param.grad().data_ptr(), slot.data_ptr());
  // Already in place: nothing is copied (the flat tensor's change shows through).
  flat.fill_(3.0);
  stage_gradient(param, slot, true);
  EXPECT_TRUE(torch::equal(param.grad(), torch::full({2, 3}, 3.0)));
}

TEST(StageGradient, ZeroesTheSlotOfAParameterWithoutAGradient) {
  auto param = torch::zeros({4}).requires_grad_();
  auto slot = torch::full({4}, 5.0);
  stage_gradient(param, slot, /*point_grad_at_slot=*/false);
  EXPECT_TRUE(torch::equal(slot, torch::zeros({4})));
  EXPECT_FALSE(param.grad().defined());
}

// Three parameters used in a chain, so that backward produces their gradients in reverse order:
// c first, then b, then a.
struct Chain {
  at::Tensor a = torch::full({1}, 2.0).requires_grad_();
  at::Tensor b = torch::full({1}, 3.0).requires_grad_();
  at::Tensor c = torch::full({1}, 4.0).requires_grad_();
  at::Tensor unused = torch::full({1}, 5.0).requires_grad_();
  std::vector<at::Tensor> params() const { return {a, b, c, unused}; }
  void backward() const { ((a * 2) * b * c).sum().backward(); }
};

struct Recorder {
  std::mutex mutex;
  std::vector<std::string> events;
  GradientBuckets::Callbacks callbacks() {
    return {.on_gradient = [this](size_t i) { events.push_back("grad " + std::to_string(i)); },
            .launch =
                [this](size_t b, bool early) {
                  events.push_back("launch " + std::to_string(b) + (early ? " early" : " late"));
                },
            .finish = [this] { events.push_back("finish"); }};
  }
};

TEST(GradientBuckets, LaunchesEachBucketOnceItsGradientsAreInAndInOrder) {
  Chain chain;
  Recorder recorder;
  // Bucket 0: c; bucket 1: a and b; bucket 2: the unused parameter, launched at the end.
  GradientBuckets gradients(chain.params(), {0, 1, 2, 3}, recorder.mutex, recorder.callbacks());
  gradients.set_layout({1, 1, 0, 2}, 3);
  chain.backward();
  EXPECT_EQ(recorder.events,
            (std::vector<std::string>{"grad 2", "launch 0 early", "grad 1", "grad 0",
                                      "launch 1 early", "launch 2 late", "finish"}));
  EXPECT_EQ(gradients.arrival(), (std::vector<size_t>{2, 1, 0}));
}

TEST(GradientBuckets, HoldsALaterBucketUntilTheEarlierOnesAreLaunched) {
  Chain chain;
  Recorder recorder;
  // Bucket 0 waits for a, the last gradient: bucket 1 (c) is ready first but launches after it.
  GradientBuckets gradients(chain.params(), {0, 1, 2}, recorder.mutex, recorder.callbacks());
  gradients.set_layout({0, 0, 1, 0}, 2);
  chain.backward();
  EXPECT_EQ(recorder.events,
            (std::vector<std::string>{"grad 2", "grad 1", "grad 0", "launch 0 early",
                                      "launch 1 early", "finish"}));
}

TEST(GradientBuckets, LaunchesNothingWithoutSyncAndEverythingLateWhenNotEarly) {
  Chain chain;
  Recorder recorder;
  GradientBuckets gradients(chain.params(), {0, 1, 2}, recorder.mutex, recorder.callbacks(),
                            /*launch_early=*/false);
  gradients.set_layout({0, 0, 1, 0}, 2);
  gradients.set_sync(false);
  chain.backward();
  EXPECT_EQ(recorder.events, (std::vector<std::string>{"grad 2", "grad 1", "grad 0"}));
  recorder.events.clear();
  gradients.set_sync(true);
  chain.backward();
  EXPECT_EQ(recorder.events,
            (std::vector<std::string>{"grad 2", "grad 1", "grad 0", "launch 0 late",
                                      "launch 1 late", "finish"}));
}

TEST(GradientBuckets, RemovedHooksCallNothing) {
  Chain chain;
  Recorder recorder;
  GradientBuckets gradients(chain.params(), {0, 1, 2}, recorder.mutex, recorder.callbacks());
  gradients.set_layout({0, 0, 0, 0}, 1);
  gradients.remove_hooks();
  chain.backward();
  EXPECT_TRUE(recorder.events.empty());
  EXPECT_TRUE(chain.a.grad().defined());
}

}  // namespace
}  // namespace cohort::parallel::detail

#include "cohort/data/data_loader.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <set>

#include "cohort/error.h"

namespace cohort::data {
namespace {

TensorDataset numbered(int64_t n) {
  TensorDataset d;
  d.inputs = torch::arange(n, torch::kLong).view({n, 1});
  d.targets = torch::arange(n, torch::kLong);
  d.transform = [](const at::Tensor& x) { return x.to(torch::kFloat).mul(2); };
  return d;
}

TEST(DataLoader, YieldsThisRanksShardInBatches) {
  std::set<int64_t> seen;
  for (int rank = 0; rank < 2; ++rank) {
    DataLoader loader(numbered(10), {.batch_size = 4, .shuffle = true, .seed = 3}, rank, 2);
    EXPECT_EQ(loader.num_batches(), 2);  // 5 examples per rank: 4 + 1
    std::vector<int64_t> sizes;
    for (auto& batch : loader) {
      sizes.push_back(batch.target.size(0));
      EXPECT_TRUE(torch::equal(batch.data.view(-1), batch.target.to(torch::kFloat) * 2));
      for (int64_t i = 0; i < batch.target.size(0); ++i) {
        EXPECT_TRUE(seen.insert(batch.target[i].item<int64_t>()).second);
      }
    }
    EXPECT_EQ(sizes, (std::vector<int64_t>{4, 1}));
  }
  EXPECT_EQ(seen.size(), 10u);
}

TEST(DataLoader, SetEpochChangesOrderAndEarlyBreakIsSafe) {
  DataLoader loader(numbered(256), {.batch_size = 8, .shuffle = true, .prefetch_batches = 2});
  auto first_batch = [&](int64_t epoch) {
    loader.set_epoch(epoch);
    for (auto& batch : loader) return batch.target.clone();  // leaves the producer mid-epoch
    return at::Tensor();
  };
  auto a = first_batch(0);
  auto b = first_batch(1);
  EXPECT_FALSE(torch::equal(a, b));
  EXPECT_TRUE(torch::equal(a, first_batch(0)));
  int64_t count = 0;
  for (auto& batch : loader) count += batch.target.size(0);
  EXPECT_EQ(count, 256);
}

TEST(DataLoader, ProducerErrorsReachTheConsumer) {
  auto d = numbered(16);
  d.transform = [](const at::Tensor&) -> at::Tensor { throw std::runtime_error("bad transform"); };
  DataLoader loader(d, {.batch_size = 4});
  EXPECT_THROW(
      {
        for (auto& batch : loader) (void)batch;
      },
      std::runtime_error);
}

TEST(DataLoader, RejectsBatchLargerThanShardWithDropLast) {
  EXPECT_THROW(DataLoader(numbered(10), {.batch_size = 8, .drop_last = true}, 0, 2), UsageError);
  EXPECT_THROW(DataLoader(numbered(10), {.batch_size = 0}), UsageError);
}

}  // namespace
}  // namespace cohort::data

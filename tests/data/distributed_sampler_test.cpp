#include "cohort/data/distributed_sampler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "cohort/error.h"

namespace cohort::data {
namespace {

std::vector<std::vector<int64_t>> shards(int64_t n, int replicas, int64_t epoch,
                                         bool shuffle = true, bool drop_last = false,
                                         bool equal = true) {
  std::vector<std::vector<int64_t>> out;
  for (int r = 0; r < replicas; ++r) {
    DistributedSampler s({.dataset_size = n,
                          .num_replicas = replicas,
                          .rank = r,
                          .shuffle = shuffle,
                          .seed = 7,
                          .drop_last = drop_last,
                          .equal_shards = equal});
    s.set_epoch(epoch);
    out.push_back(s.indices());
    EXPECT_EQ(static_cast<int64_t>(out.back().size()), s.num_samples());
  }
  return out;
}

TEST(DistributedSampler, ShardsAreDisjointCompleteAndEqual) {
  for (int replicas : {1, 2, 3, 4}) {
    for (int64_t n : {12, 13, 101}) {
      auto parts = shards(n, replicas, 0);
      std::multiset<int64_t> seen;
      for (const auto& p : parts) {
        EXPECT_EQ(p.size(), parts[0].size()) << "n=" << n << " replicas=" << replicas;
        seen.insert(p.begin(), p.end());
      }
      // Complete: every index appears; padding repeats only as many as needed to even out.
      for (int64_t i = 0; i < n; ++i) EXPECT_GE(seen.count(i), 1u) << i;
      const int64_t padded = static_cast<int64_t>(seen.size()) - n;
      EXPECT_EQ(padded, (replicas - n % replicas) % replicas);
      if (n % replicas == 0) {
        // Disjoint when nothing needs padding.
        EXPECT_EQ(std::set<int64_t>(seen.begin(), seen.end()).size(), seen.size());
      }
    }
  }
}

TEST(DistributedSampler, DropLastGivesDisjointEqualShards) {
  auto parts = shards(103, 4, 3, true, /*drop_last=*/true);
  std::set<int64_t> seen;
  for (const auto& p : parts) {
    EXPECT_EQ(p.size(), 25u);
    for (auto i : p) EXPECT_TRUE(seen.insert(i).second) << "index " << i << " twice";
  }
}

TEST(DistributedSampler, EvaluationShardsCoverEachExampleOnce) {
  auto parts = shards(10, 3, 0, /*shuffle=*/false, false, /*equal=*/false);
  EXPECT_EQ(parts[0], (std::vector<int64_t>{0, 3, 6, 9}));
  EXPECT_EQ(parts[1], (std::vector<int64_t>{1, 4, 7}));
  EXPECT_EQ(parts[2], (std::vector<int64_t>{2, 5, 8}));
}

TEST(DistributedSampler, ReshufflesPerEpochAndRepeatsPerSeed) {
  auto epoch0 = shards(1000, 2, 0);
  auto epoch1 = shards(1000, 2, 1);
  EXPECT_NE(epoch0[0], epoch1[0]);
  EXPECT_EQ(epoch0, shards(1000, 2, 0));
  // The union per epoch is still the whole data set.
  for (const auto& e : {epoch0, epoch1}) {
    std::set<int64_t> all(e[0].begin(), e[0].end());
    all.insert(e[1].begin(), e[1].end());
    EXPECT_EQ(all.size(), 1000u);
  }
  // Not the identity order.
  std::vector<int64_t> sorted = epoch0[0];
  std::sort(sorted.begin(), sorted.end());
  EXPECT_NE(sorted, epoch0[0]);
}

TEST(DistributedSampler, RejectsBadOptions) {
  EXPECT_THROW(DistributedSampler({.dataset_size = 10, .num_replicas = 0}), UsageError);
  EXPECT_THROW(DistributedSampler({.dataset_size = 10, .num_replicas = 2, .rank = 2}), UsageError);
  EXPECT_THROW(
      DistributedSampler({.dataset_size = 1, .num_replicas = 2, .rank = 0, .drop_last = true}),
      UsageError);
}

}  // namespace
}  // namespace cohort::data

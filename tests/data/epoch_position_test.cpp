#include "cohort/data/epoch_position.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <set>

#include "cohort/data/data_iterator.h"
#include "cohort/data/data_loader.h"
#include "cohort/data/dataset.h"

namespace cohort::data {
namespace {

Dataset rows_of_x(int64_t n) {
  return Dataset::from_tensors({{"x", torch::arange(n, torch::kFloat).unsqueeze(1)}});
}

std::vector<int64_t> ids_in(const Block& block) {
  auto id = block[kIdColumn].contiguous();
  return {id.data_ptr<int64_t>(), id.data_ptr<int64_t>() + id.numel()};
}

// The ids of the first `batches` batches (all with -1) of each shard's pass of `epoch`, and where
// each shard stood then.
struct Taken {
  std::vector<std::vector<int64_t>> ids;
  std::vector<EpochPosition> positions;
};
Taken take(const Dataset& dataset, int shards, int64_t epoch, int64_t batches,
           IterBatchesOptions options, const std::vector<EpochStart>& starts = {}) {
  Taken taken;
  for (int s = 0; s < shards; ++s) {
    DataIterator it(dataset.shard(s, shards));
    if (!starts.empty()) it.start_at(starts[static_cast<size_t>(s)]);
    it.set_epoch(epoch);
    std::vector<int64_t> mine;
    int64_t b = 0;
    for (Block& block : it.iter_batches(options)) {
      for (auto id : ids_in(block)) mine.push_back(id);
      if (++b == batches) break;  // as a loop stops: after the batch it took
    }
    taken.ids.push_back(mine);
    taken.positions.push_back(it.position());
  }
  return taken;
}

std::vector<EpochStart> starts_for(const std::vector<EpochPosition>& positions, int shards,
                                   std::string* warning = nullptr) {
  std::vector<EpochStart> out;
  for (int s = 0; s < shards; ++s) out.push_back(resume_start(positions, s, shards, warning));
  return out;
}

TEST(EpochPosition, ResumeStartContinuesEachShardOrSplitsTheRestAnew) {
  const EpochPosition at_20{.epoch = 3, .yielded_rows = 20};
  // As many shards: each its own rows.
  auto start = resume_start({at_20, at_20}, 1, 2);
  EXPECT_EQ(start.epoch, 3);
  EXPECT_EQ(start.unsharded_rows, 0);
  EXPECT_EQ(start.yielded_rows, 20);
  // Three shards from two in order at one place: the first 40 rows of the order are taken.
  std::string warning;
  start = resume_start({at_20, at_20}, 2, 3, &warning);
  EXPECT_EQ(start.unsharded_rows, 40);
  EXPECT_EQ(start.yielded_rows, 0);
  EXPECT_EQ(warning, "");
  // Out of order (a filter) and now cut otherwise: the prefix both covered, and a warning.
  EpochPosition filtered = at_20;
  filtered.in_order = false;
  EpochPosition behind = filtered;
  behind.yielded_rows = 12;
  start = resume_start({filtered, behind}, 0, 3, &warning);
  EXPECT_EQ(start.unsharded_rows, 24);
  EXPECT_NE(warning.find("epoch 3 resumes on 3 shards from 2"), std::string::npos) << warning;
  // An epoch every shard finished, or none begun: nothing to leave out.
  EpochPosition done = at_20;
  done.finished = true;
  EXPECT_EQ(resume_start({done, done}, 0, 3).epoch, -1);
  EXPECT_EQ(resume_start({EpochPosition{}, EpochPosition{}}, 0, 2).epoch, -1);
  // Positions round-trip through JSON (a checkpoint's meta.json).
  const auto back = Json(filtered).get<EpochPosition>();
  EXPECT_EQ(back.epoch, 3);
  EXPECT_EQ(back.yielded_rows, 20);
  EXPECT_FALSE(back.in_order);
}

TEST(DataIterator, AnEpochResumedOnAsManyShardsYieldsExactlyTheRowsNotTaken) {
  const auto dataset = rows_of_x(103).random_shuffle(5);
  const IterBatchesOptions options{.batch_size = 5};
  const auto whole = take(dataset, 3, 1, -1, options);
  const auto stopped = take(dataset, 3, 1, 2, options);
  for (const auto& p : stopped.positions) {
    EXPECT_EQ(p.epoch, 1);
    EXPECT_EQ(p.yielded_rows, 10);
    EXPECT_TRUE(p.in_order);
    EXPECT_FALSE(p.finished);
  }
  const auto resumed = take(dataset, 3, 1, -1, options, starts_for(stopped.positions, 3));
  for (size_t s = 0; s < 3; ++s) {
    auto joined = stopped.ids[s];
    joined.insert(joined.end(), resumed.ids[s].begin(), resumed.ids[s].end());
    EXPECT_EQ(joined, whole.ids[s]) << "shard " << s;
    EXPECT_TRUE(resumed.positions[s].finished);
    EXPECT_EQ(resumed.positions[s].yielded_rows, static_cast<int64_t>(whole.ids[s].size()));
  }
}

TEST(DataIterator, AnEpochResumedOnOtherShardsLosesAndRepeatsNoRow) {
  const auto dataset = rows_of_x(103).random_shuffle(5);
  const IterBatchesOptions options{.batch_size = 5};
  const auto stopped = take(dataset, 3, 0, 2, options);  // 30 rows of the epoch's order
  for (int shards : {2, 4}) {
    std::string warning;
    const auto resumed =
        take(dataset, shards, 0, -1, options, starts_for(stopped.positions, shards, &warning));
    EXPECT_EQ(warning, "");
    std::multiset<int64_t> seen;
    for (const auto& part : {stopped.ids, resumed.ids})
      for (const auto& shard : part) seen.insert(shard.begin(), shard.end());
    // Every row once, but the last (73 % shards) that equal shards leave out, as any epoch does.
    EXPECT_EQ(static_cast<int64_t>(seen.size()), 30 + 73 / shards * shards) << shards;
    EXPECT_EQ(std::set<int64_t>(seen.begin(), seen.end()).size(), seen.size()) << shards;
  }
}

TEST(DataIterator, AFilteredOrLocallyShuffledEpochResumesExactlyOnAsManyShards) {
  const auto dataset = rows_of_x(90).random_shuffle(2).filter(
      [](const Block& b) { return b["x"].squeeze(1).fmod(4).ne(1); });
  for (const IterBatchesOptions options :
       {IterBatchesOptions{.batch_size = 4},
        IterBatchesOptions{.batch_size = 4, .local_shuffle_buffer_size = 6}}) {
    const auto whole = take(dataset, 2, 0, -1, options);
    const auto stopped = take(dataset, 2, 0, 3, options);
    EXPECT_FALSE(stopped.positions[0].in_order);
    const auto resumed = take(dataset, 2, 0, -1, options, starts_for(stopped.positions, 2));
    for (size_t s = 0; s < 2; ++s) {
      auto joined = stopped.ids[s];
      joined.insert(joined.end(), resumed.ids[s].begin(), resumed.ids[s].end());
      EXPECT_EQ(joined, whole.ids[s]) << "shard " << s;
    }
  }
}

TEST(DataLoader, AnEpochResumedOnAsManyRanksOrOthersGoesOnWithTheRowsNotTaken) {
  // 10 examples on 3 ranks: padded to 12 by wrapping around.
  const TensorDataset examples{.inputs = torch::arange(10, torch::kLong),
                               .targets = torch::arange(10, torch::kLong)};
  const auto pass = [&](int rank, int world, int64_t batches, const EpochStart& start) {
    DataLoader loader(examples, {.batch_size = 2, .seed = 4}, rank, world);
    loader.start_at(start);
    loader.set_epoch(2);
    std::vector<int64_t> out;
    int64_t b = 0;
    for (auto& batch : loader) {
      for (int64_t i = 0; i < batch.data.size(0); ++i) out.push_back(batch.data[i].item<int64_t>());
      if (++b == batches) break;
    }
    return std::make_pair(out, loader.position());
  };
  std::vector<EpochPosition> positions;
  std::vector<std::vector<int64_t>> before;
  for (int r = 0; r < 3; ++r) {
    auto [rows, position] = pass(r, 3, 1, {});
    before.push_back(rows);
    positions.push_back(position);
    EXPECT_EQ(position.yielded_rows, 2);
  }
  for (int r = 0; r < 3; ++r) {
    auto joined = before[static_cast<size_t>(r)];
    auto rest = pass(r, 3, -1, resume_start(positions, r, 3)).first;
    joined.insert(joined.end(), rest.begin(), rest.end());
    EXPECT_EQ(joined, pass(r, 3, -1, {}).first) << "rank " << r;
  }
  // On 2 ranks: the 4 rows left of the 10 once each.
  std::multiset<int64_t> seen;
  for (const auto& rows : before) seen.insert(rows.begin(), rows.end());
  for (int r = 0; r < 2; ++r) {
    const auto rest = pass(r, 2, -1, resume_start(positions, r, 2)).first;
    seen.insert(rest.begin(), rest.end());
  }
  EXPECT_EQ(seen, std::multiset<int64_t>({0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
}

}  // namespace
}  // namespace cohort::data

// The data positions a checkpoint's meta.json keeps (train/data_positions.h): what the ranks hand
// over, merged by shard or replicated, and read back as each shard's start of a resumed epoch.
#include "train/data_positions.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cohort/error.h"
#include "cohort/train/parallel_model.h"
#include "support/expect.h"

namespace cohort::train {
namespace {

data::EpochPosition taken(int64_t epoch, int64_t rows) {
  return {.epoch = epoch, .yielded_rows = rows};
}

TEST(DataPositions, RanksMergeByShardAndEachShardResumesWhereItStood) {
  // Four ranks, two shards of two ranks each (a pipeline's two stages read the same rows).
  const std::vector<std::string> ranks = {
      rank_positions({{"dataset:train", taken(2, 48)}}, 1, 2).dump(),
      rank_positions({{"dataset:train", taken(2, 32)}}, 0, 2).dump(),
      rank_positions({{"dataset:train", taken(2, 32)}}, 0, 2).dump(),
      rank_positions({{"dataset:train", taken(2, 48)}}, 1, 2).dump()};
  const Json meta{{kDataPositionsKey, positions_by_shard(ranks)}};
  ASSERT_EQ(meta[kDataPositionsKey]["dataset:train"].size(), 2u);
  std::string warning;
  const auto first = resume_start_from(meta, "/ckpt", "dataset:train", 0, 2, warning);
  const auto second = resume_start_from(meta, "/ckpt", "dataset:train", 1, 2, warning);
  EXPECT_EQ(first.epoch, 2);
  EXPECT_EQ(first.yielded_rows, 32);
  EXPECT_EQ(second.epoch, 2);
  EXPECT_EQ(second.yielded_rows, 48);
  EXPECT_EQ(warning, "");
  // A stream the checkpoint did not keep starts afresh.
  EXPECT_EQ(resume_start_from(meta, "/ckpt", "loader:0", 0, 2, warning).epoch, -1);
}

TEST(DataPositions, ReplicatedPositionsGiveEveryShardTheSameStart) {
  const Json meta{{kDataPositionsKey, replicated_positions({{"loader:0", taken(0, 16)}}, 3)}};
  ASSERT_EQ(meta[kDataPositionsKey]["loader:0"].size(), 3u);
  std::string warning;
  for (int shard = 0; shard < 3; ++shard) {
    const auto start = resume_start_from(meta, "/ckpt", "loader:0", shard, 3, warning);
    EXPECT_EQ(start.epoch, 0);
    EXPECT_EQ(start.yielded_rows, 16);
  }
}

TEST(DataPositions, AnOlderOrAlteredCheckpointIsSaidOrRefused) {
  std::string warning;
  // Written inside an epoch by a release without positions: the epoch starts again, said once.
  const Json old{{"metrics", {{kEpochStepMetric, 5}}}};
  EXPECT_EQ(resume_start_from(old, "/ckpt", "loader:0", 0, 1, warning).epoch, -1);
  EXPECT_NE(warning.find("kept no data positions"), std::string::npos) << warning;
  // At an epoch's end there is nothing to say.
  warning.clear();
  resume_start_from(Json{{"metrics", {{kEpochStepMetric, 0}}}}, "/ckpt", "loader:0", 0, 1, warning);
  EXPECT_EQ(warning, "");
  const Json altered{{kDataPositionsKey, {{"loader:0", "somewhere"}}}};
  cohort::testing::expect_error<UsageError>(
      [&] { resume_start_from(altered, "/runs/r/checkpoint_000002", "loader:0", 0, 1, warning); },
      "checkpoint /runs/r/checkpoint_000002: meta.json's data_positions of 'loader:0' is "
      "malformed");
}

}  // namespace
}  // namespace cohort::train

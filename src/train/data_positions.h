// Where a worker's data streams stand (a data::EpochPosition per stream: a loader of
// prepare_data_loader, a dataset shard of get_dataset_shard), as a checkpoint's meta.json keeps
// them and a resumed run reads them back: the one format of every writer (a report's checkpoint,
// a snapshot, the state a live regroup hands over) and of the reader.
#pragma once
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "cohort/data/epoch_position.h"
#include "cohort/json.h"

namespace cohort::train {

// A worker's streams by key ("loader:0", "dataset:train", ...).
using StreamPositions = std::map<std::string, data::EpochPosition>;

// The meta.json key that holds them: by stream, one position per data-parallel shard.
inline constexpr const char* kDataPositionsKey = "data_positions";

// One rank's streams as it hands them to the rank that writes meta.json: its data-parallel shard
// `shard` of `shards` and its positions.
Json rank_positions(const StreamPositions& positions, int shard, int shards);

// Ranks' rank_positions() (as text, in any order) as meta.json's kDataPositionsKey: one list per
// stream, by shard. The ranks of one shard (a pipeline's, a tensor-parallel group's) read the
// same rows, so any one of them says where the shard stands.
Json positions_by_shard(const std::vector<std::string>& ranks);

// Every one of `shards` shards standing where `positions` do, as meta.json's kDataPositionsKey:
// a DDP group whose ranks all took the same batches (live recovery's state).
Json replicated_positions(const StreamPositions& positions, int shards);

// Where stream `key` of shard `shard` of `shards` starts in a run resumed from the checkpoint at
// `checkpoint`, whose meta.json is `meta`; epoch -1 when it kept no position for the stream.
// `warning` says why the epoch cannot resume exactly (written inside an epoch by a release that
// kept no positions; another world size). UsageError naming the checkpoint when the positions are
// malformed.
data::EpochStart resume_start_from(const Json& meta, const std::filesystem::path& checkpoint,
                                   const std::string& key, int shard, int shards,
                                   std::string& warning);

}  // namespace cohort::train

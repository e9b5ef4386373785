/// \file
/// Where a consumer of a sharded epoch stands, and where a resumed one starts: the data's part of
/// a checkpoint, so that a run stopped inside an epoch goes on with exactly the rows it had not
/// consumed (DataIterator and DataLoader keep and take it).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "cohort/json.h"

namespace cohort::data {

/// One consumer's place in an epoch. A shard's rows are every `shards`-th row of the epoch's whole
/// order (after the shuffle) from its index on; a pass may begin after a prefix of that order.
struct EpochPosition {
  int64_t epoch = -1;  ///< of the pass begun last; -1: none yet
  /// Rows of the whole order left out before sharding when the pass began (a resumed pass).
  int64_t unsharded_rows = 0;
  /// This consumer's rows of the epoch since: yielded by the pass, and those it left out at its
  /// start (EpochStart::yielded_rows).
  int64_t yielded_rows = 0;
  /// The rows yielded are the first rows of the shard in its order (no filter, no skipped file, no
  /// local shuffle buffer): then equal positions of every shard cover a prefix of the whole order.
  bool in_order = true;
  /// The pass ran to its end: nothing of the epoch is left.
  bool finished = false;
};
/// EpochPosition as JSON (a checkpoint's data_positions).
void to_json(Json& j, const EpochPosition& p);
/// EpochPosition from JSON; throws on a missing field.
void from_json(const Json& j, EpochPosition& p);

/// Where the pass of `epoch` begins (none with epoch -1): after the first `unsharded_rows` rows of
/// the epoch's whole order, the rest sharded anew; then after the first `yielded_rows` rows of this
/// consumer's own rows.
struct EpochStart {
  int64_t epoch = -1;          ///< the epoch, -1: no resume
  int64_t unsharded_rows = 0;  ///< rows of the epoch's whole order left out before sharding
  int64_t yielded_rows = 0;    ///< rows of this consumer's own left out after sharding
};

/// The start of shard `shard` of `shards` that resumes an epoch whose shards stood at `positions`
/// (one per shard then, in shard order). Exact when the shards are as many as then (each goes on
/// with its own rows) or when every shard was in order at the same place (any number of shards
/// now: the whole order's prefix they covered is left out, the rest split anew). Otherwise the
/// prefix every shard covered is left out and `warning` says which rows of the epoch may come
/// again. No start (epoch -1) when every shard had finished the epoch or none had begun one.
EpochStart resume_start(const std::vector<EpochPosition>& positions, int shard, int shards,
                        std::string* warning = nullptr);

}  // namespace cohort::data

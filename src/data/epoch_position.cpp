#include "cohort/data/epoch_position.h"

#include <algorithm>

namespace cohort::data {

void to_json(Json& j, const EpochPosition& p) {
  j = Json{{"epoch", p.epoch},
           {"unsharded_rows", p.unsharded_rows},
           {"yielded_rows", p.yielded_rows},
           {"in_order", p.in_order},
           {"finished", p.finished}};
}

void from_json(const Json& j, EpochPosition& p) {
  p.epoch = j.at("epoch").get<int64_t>();
  p.unsharded_rows = j.at("unsharded_rows").get<int64_t>();
  p.yielded_rows = j.at("yielded_rows").get<int64_t>();
  p.in_order = j.at("in_order").get<bool>();
  p.finished = j.at("finished").get<bool>();
}

EpochStart resume_start(const std::vector<EpochPosition>& positions, int shard, int shards,
                        std::string* warning) {
  int64_t epoch = -1;
  for (const auto& p : positions) epoch = std::max(epoch, p.epoch);
  if (epoch < 0) return {};
  // Shards still at an earlier epoch are behind the others; the latest epoch's shards say where
  // the run stood.
  std::vector<const EpochPosition*> at;
  for (const auto& p : positions)
    if (p.epoch == epoch) at.push_back(&p);
  const auto unfinished = [](const EpochPosition* p) { return !p->finished; };
  if (std::none_of(at.begin(), at.end(), unfinished)) return {};
  const int64_t old_shards = static_cast<int64_t>(positions.size());
  const bool every_shard = at.size() == positions.size();
  // As many shards as then: each goes on with its own rows (also where a sampler padded them).
  if (shards == old_shards && every_shard) {
    const auto& mine = positions[static_cast<size_t>(shard)];
    return {epoch, mine.unsharded_rows, mine.yielded_rows};
  }
  const auto& first = *at.front();
  const bool same_place = every_shard && std::all_of(at.begin(), at.end(), [&](const auto* p) {
                            return p->in_order && p->unsharded_rows == first.unsharded_rows &&
                                   p->yielded_rows == first.yielded_rows;
                          });
  if (same_place) return {epoch, first.unsharded_rows + first.yielded_rows * old_shards, 0};
  // Shards at different places, now cut otherwise: leave out what every shard covered.
  int64_t least = first.yielded_rows, unsharded = first.unsharded_rows;
  for (const auto* p : at) {
    least = std::min(least, p->yielded_rows);
    unsharded = std::min(unsharded, p->unsharded_rows);
  }
  if (!every_shard) least = 0;
  if (warning != nullptr) {
    *warning = "epoch " + std::to_string(epoch) + " resumes on " + std::to_string(shards) +
               " shards from " + std::to_string(old_shards) +
               " that stood at different places (filters, skipped files or a local shuffle "
               "buffer): it goes on after the first " +
               std::to_string(unsharded + least * old_shards) +
               " rows of its order, so rows some shards had consumed past them come again";
  }
  return {epoch, unsharded + least * old_shards, 0};
}

}  // namespace cohort::data

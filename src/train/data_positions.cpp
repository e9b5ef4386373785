#include "train/data_positions.h"

#include "cohort/error.h"
#include "cohort/train/parallel_model.h"

namespace cohort::train {

Json rank_positions(const StreamPositions& positions, int shard, int shards) {
  return Json{{"shard", shard}, {"shards", shards}, {"positions", positions}};
}

Json positions_by_shard(const std::vector<std::string>& ranks) {
  Json by_stream = Json::object();
  for (const auto& text : ranks) {
    const auto rank = Json::parse(text);
    const auto shard = rank.at("shard").get<size_t>();
    const auto shards = rank.at("shards").get<size_t>();
    for (const auto& [stream, position] : rank.at("positions").items()) {
      auto& list = by_stream[stream];
      if (list.is_null()) list = Json(std::vector<data::EpochPosition>(shards));
      list[shard] = position;
    }
  }
  return by_stream;
}

Json replicated_positions(const StreamPositions& positions, int shards) {
  Json by_stream = Json::object();
  for (const auto& [stream, position] : positions)
    by_stream[stream] = std::vector<data::EpochPosition>(static_cast<size_t>(shards), position);
  return by_stream;
}

data::EpochStart resume_start_from(const Json& meta, const std::filesystem::path& checkpoint,
                                   const std::string& key, int shard, int shards,
                                   std::string& warning) {
  if (!meta.contains(kDataPositionsKey)) {
    if (meta.contains("metrics") && meta["metrics"].value(kEpochStepMetric, int64_t{0}) > 0) {
      warning =
          "the checkpoint was written inside an epoch by a release that kept no data positions: "
          "that epoch starts again from its first batch";
    }
    return {};
  }
  if (!meta[kDataPositionsKey].contains(key)) return {};
  std::vector<data::EpochPosition> positions;
  try {
    positions = meta[kDataPositionsKey][key].get<std::vector<data::EpochPosition>>();
  } catch (const Json::exception& e) {
    throw UsageError("checkpoint " + checkpoint.string() + ": meta.json's " + kDataPositionsKey +
                     " of '" + key + "' is malformed (" + e.what() +
                     "): the checkpoint was altered; resume from another one");
  }
  return data::resume_start(positions, shard, shards, &warning);
}

}  // namespace cohort::train

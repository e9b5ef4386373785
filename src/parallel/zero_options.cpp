#include "cohort/parallel/zero_options.h"

#include <string>
#include <utility>

#include "cohort/error.h"

namespace cohort::parallel {

void ZeroOptions::validate() const {
  if (stage < 0 || stage > 3) {
    throw UsageError("ZeRO stage " + std::to_string(stage) +
                     " is not one of 0 (DDP), 1 (optimizer state sharded), 2 (gradients too), 3 "
                     "(parameters too)");
  }
  if (reduce_bucket_size <= 0) {
    throw UsageError("ZeRO reduce_bucket_size " + std::to_string(reduce_bucket_size) +
                     " must be > 0 elements");
  }
  if (allgather_bucket_size <= 0) {
    throw UsageError("ZeRO allgather_bucket_size " + std::to_string(allgather_bucket_size) +
                     " must be > 0 elements");
  }
  if (shard_group_size < 0) {
    throw UsageError("ZeRO shard_group_size (--shard-group-size) " +
                     std::to_string(shard_group_size) +
                     " must be >= 0 (0: shard over every data-parallel rank)");
  }
  for (const auto& [name, value] : {std::pair{"prefetch_bucket_size", prefetch_bucket_size},
                                    {"max_live_parameters", max_live_parameters},
                                    {"param_persistence_threshold", param_persistence_threshold}}) {
    if (value < 0) {
      throw UsageError(std::string("ZeRO stage 3 ") + name + " " + std::to_string(value) +
                       " must be >= 0 elements");
    }
  }
}

}  // namespace cohort::parallel

#include "cohort/data/distributed_sampler.h"

#include <algorithm>
#include <numeric>
#include <random>
#include <string>

#include "cohort/error.h"

namespace cohort::data {

DistributedSampler::DistributedSampler(SamplerOptions options) : options_(options) {
  if (options_.num_replicas < 1) {
    throw UsageError("sampler: num_replicas=" + std::to_string(options_.num_replicas) +
                     " must be >= 1");
  }
  if (options_.rank < 0 || options_.rank >= options_.num_replicas) {
    throw UsageError("sampler: rank " + std::to_string(options_.rank) + " is not in [0, " +
                     std::to_string(options_.num_replicas) + ")");
  }
  if (options_.dataset_size < 0) throw UsageError("sampler: dataset_size must be >= 0");
  if (options_.drop_last && options_.dataset_size < options_.num_replicas) {
    throw UsageError("sampler: " + std::to_string(options_.dataset_size) +
                     " examples cannot give each of " + std::to_string(options_.num_replicas) +
                     " ranks one with drop_last: use fewer workers or more data");
  }
}

int64_t DistributedSampler::num_samples(int64_t unsharded_rows) const {
  const int64_t n =
      options_.dataset_size - std::clamp<int64_t>(unsharded_rows, 0, options_.dataset_size);
  const int64_t r = options_.num_replicas;
  if (!options_.equal_shards) return (n - options_.rank + r - 1) / r;
  return options_.drop_last ? n / r : (n + r - 1) / r;
}

std::vector<int64_t> DistributedSampler::indices(int64_t unsharded_rows) const {
  const int64_t left_out = std::clamp<int64_t>(unsharded_rows, 0, options_.dataset_size);
  const int64_t n = options_.dataset_size - left_out;
  std::vector<int64_t> order(static_cast<size_t>(options_.dataset_size));
  std::iota(order.begin(), order.end(), 0);
  if (options_.shuffle && options_.dataset_size > 1) {
    // Fisher-Yates with our own bounded draw: std::shuffle and the std distributions are
    // implementation-defined, and every rank must compute the same permutation.
    std::mt19937_64 engine(options_.seed * 0x9E3779B97F4A7C15ULL + static_cast<uint64_t>(epoch_));
    for (int64_t i = options_.dataset_size - 1; i > 0; --i) {
      const uint64_t bound = static_cast<uint64_t>(i) + 1;
      const uint64_t limit = UINT64_MAX - UINT64_MAX % bound;
      uint64_t draw;
      do {
        draw = engine();
      } while (draw >= limit);
      std::swap(order[static_cast<size_t>(i)], order[draw % bound]);
    }
  }
  order.erase(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(left_out));
  const int64_t per_rank = num_samples(left_out);
  const int64_t r = options_.num_replicas;
  if (options_.equal_shards && !options_.drop_last && n > 0) {
    // Pad by wrapping around so that total = per_rank * replicas.
    const int64_t total = per_rank * r;
    for (int64_t i = n; i < total; ++i) order.push_back(order[static_cast<size_t>(i % n)]);
  }
  std::vector<int64_t> shard;
  shard.reserve(static_cast<size_t>(per_rank));
  for (int64_t k = 0; k < per_rank; ++k) {
    shard.push_back(order[static_cast<size_t>(options_.rank + k * r)]);
  }
  return shard;
}

}  // namespace cohort::data

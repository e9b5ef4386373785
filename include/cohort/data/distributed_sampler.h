#pragma once
#include <cstdint>
#include <vector>

namespace cohort::data {

/// How a DistributedSampler splits and shuffles indices.
struct SamplerOptions {
  int64_t dataset_size = 0;  ///< indices 0 to dataset_size - 1
  int num_replicas = 1;      ///< ranks sharing the data
  int rank = 0;              ///< this rank
  bool shuffle = true;       ///< a new permutation each epoch
  uint64_t seed = 0;         ///< the permutations' seed
  /// Training: every rank gets the same number of samples (the tail is dropped, or padded by
  /// wrapping around, as PyTorch's DistributedSampler), so collectives stay in step.
  bool drop_last = false;
  /// Evaluation: false gives each rank exactly its strided share, no padding and no duplicates
  /// (counts may then differ by one between ranks).
  bool equal_shards = true;
};

/// Splits dataset indices into disjoint per-rank shards, reshuffled every epoch from
/// (seed, epoch) with the same permutation on every rank and on every platform.
class DistributedSampler {
 public:
  /// A sampler with `options`.
  explicit DistributedSampler(SamplerOptions options);
  /// Sets the epoch, whose permutation indices() gives.
  void set_epoch(int64_t epoch) { epoch_ = epoch; }
  /// The epoch set last.
  int64_t epoch() const { return epoch_; }
  /// This rank's indices for the current epoch; of a resumed epoch, after the first
  /// `unsharded_rows` of its permutation (taken before it stopped), the rest split anew.
  std::vector<int64_t> indices(int64_t unsharded_rows = 0) const;
  /// Samples this rank gets per epoch (of one that leaves out `unsharded_rows`).
  int64_t num_samples(int64_t unsharded_rows = 0) const;
  /// The options it was made with.
  const SamplerOptions& options() const { return options_; }

 private:
  SamplerOptions options_;
  int64_t epoch_ = 0;
};

}  // namespace cohort::data

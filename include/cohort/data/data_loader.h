#pragma once
#include <cstdint>
#include <functional>
#include <iterator>
#include <memory>
#include <optional>

#include <c10/core/Device.h>

#include "cohort/data/distributed_sampler.h"
#include "cohort/data/epoch_position.h"
#include "cohort/data/tensor_dataset.h"

namespace cohort::data {

/// How a DataLoader batches, shuffles and prefetches.
struct DataLoaderOptions {
  int64_t batch_size = 64;  ///< rows per batch
  bool shuffle = true;      ///< a new permutation each epoch (seeded by seed and the epoch)
  bool drop_last = false;   ///< drop the last, short batch
  uint64_t seed = 0;        ///< the permutations' seed, the same on every rank
  /// Batches prepared ahead by a background thread (gather, transform, copy to device).
  int prefetch_batches = 2;
  c10::Device device =
      c10::Device(c10::DeviceType::CPU);  ///< the device batches are copied to (asynchronously from
                                          ///< pinned memory for a GPU)
  /// See SamplerOptions::equal_shards; false for evaluation.
  bool equal_shards = true;
};

/// Iterates a TensorDataset in batches, in this rank's shard of a DistributedSampler, with a
/// background thread keeping `prefetch_batches` ready. `for (auto& batch : loader)`; call
/// set_epoch(e) before each epoch for a fresh shuffle. Breaking out of the loop is fine.
class DataLoader {
 public:
  /// The loader of `dataset` for shard `rank` of `world_size`.
  DataLoader(TensorDataset dataset, DataLoaderOptions options, int rank = 0, int world_size = 1);
  ~DataLoader();
  /// Movable, not copyable: it owns its prefetch thread.
  DataLoader(DataLoader&&) noexcept;
  /// Moves the loader in.
  DataLoader& operator=(DataLoader&&) noexcept;

  /// Sets the epoch of the next pass (its shuffle, its resume start).
  void set_epoch(int64_t epoch);
  /// Resuming inside an epoch: the pass of start.epoch begins at `start` (epoch_position.h), once.
  void start_at(EpochStart start);
  /// Where the consumer stands in the pass begun last (its rows taken so far).
  EpochPosition position() const;
  /// Called with position() after every batch the consumer takes and when a pass ends.
  void set_on_position(std::function<void(const EpochPosition&)> callback);
  /// Batches this rank gets per epoch.
  int64_t num_batches() const;
  /// Rows this rank gets per epoch.
  int64_t num_samples() const;
  /// The options it was made with.
  const DataLoaderOptions& options() const;
  /// The sampler that shards and shuffles its indices.
  const DistributedSampler& sampler() const;

  /// An input iterator over an epoch's batches.
  class Iterator {
   public:
    using iterator_category = std::input_iterator_tag;  ///< standard iterator trait
    using value_type = Batch;                           ///< a batch
    using difference_type = std::ptrdiff_t;             ///< standard iterator trait
    using pointer = Batch*;                             ///< standard iterator trait
    using reference = Batch&;                           ///< standard iterator trait
    /// The current batch.
    Batch& operator*() { return current_; }
    /// The current batch's members.
    Batch* operator->() { return &current_; }
    /// Moves to the next batch (waits for it).
    Iterator& operator++();
    /// Whether both are at the end, or both not.
    bool operator==(const Iterator& other) const { return done_ == other.done_; }
    /// The opposite of ==.
    bool operator!=(const Iterator& other) const { return !(*this == other); }

   private:
    friend class DataLoader;
    struct Epoch;
    Iterator(std::shared_ptr<Epoch> epoch, bool done);
    std::shared_ptr<Epoch> epoch_;
    Batch current_;
    bool done_ = true;
  };
  /// Starts an epoch (stopping any unfinished one).
  Iterator begin();
  /// The end of the epoch.
  Iterator end();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace cohort::data

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

struct DataLoaderOptions {
  int64_t batch_size = 64;
  bool shuffle = true;
  bool drop_last = false;
  uint64_t seed = 0;
  /// Batches prepared ahead by a background thread (gather, transform, copy to device).
  int prefetch_batches = 2;
  c10::Device device = c10::Device(c10::DeviceType::CPU);
  /// See SamplerOptions::equal_shards; false for evaluation.
  bool equal_shards = true;
};

/// Iterates a TensorDataset in batches, in this rank's shard of a DistributedSampler, with a
/// background thread keeping `prefetch_batches` ready. `for (auto& batch : loader)`; call
/// set_epoch(e) before each epoch for a fresh shuffle. Breaking out of the loop is fine.
class DataLoader {
 public:
  DataLoader(TensorDataset dataset, DataLoaderOptions options, int rank = 0, int world_size = 1);
  ~DataLoader();
  DataLoader(DataLoader&&) noexcept;
  DataLoader& operator=(DataLoader&&) noexcept;

  void set_epoch(int64_t epoch);
  /// Resuming inside an epoch: the pass of start.epoch begins at `start` (epoch_position.h), once.
  void start_at(EpochStart start);
  /// Where the consumer stands in the pass begun last (its rows taken so far).
  EpochPosition position() const;
  /// Called with position() after every batch the consumer takes and when a pass ends.
  void set_on_position(std::function<void(const EpochPosition&)> callback);
  int64_t num_batches() const;
  int64_t num_samples() const;
  const DataLoaderOptions& options() const;
  const DistributedSampler& sampler() const;

  class Iterator {
   public:
    using iterator_category = std::input_iterator_tag;
    using value_type = Batch;
    using difference_type = std::ptrdiff_t;
    using pointer = Batch*;
    using reference = Batch&;
    Batch& operator*() { return current_; }
    Batch* operator->() { return &current_; }
    Iterator& operator++();
    bool operator==(const Iterator& other) const { return done_ == other.done_; }
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
  Iterator end();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace cohort::data

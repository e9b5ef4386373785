#include "cohort/data/data_loader.h"

#include <torch/types.h>
#include <algorithm>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "cohort/data/data_iterator.h"
#include "cohort/error.h"
#include "data/pass_position.h"
#include "data/to_device.h"

namespace cohort::data {

Batch TensorDataset::get_batch(const at::Tensor& indices) const {
  Batch batch;
  batch.data = inputs.index_select(0, indices);
  if (transform) batch.data = transform(batch.data);
  batch.target = targets.index_select(0, indices);
  return batch;
}

namespace {

// The batches of `rows` rows: the last one short, or dropped with drop_last.
int64_t batches_of(int64_t rows, const DataLoaderOptions& options) {
  const int64_t b = options.batch_size;
  return options.drop_last ? rows / b : (rows + b - 1) / b;
}

}  // namespace

// One pass over the shard: a producer thread fills a bounded queue, the iterator drains it.
struct DataLoader::Iterator::Epoch {
  PassPosition pass;  // the consumer's place, and who hears of it
  std::mutex mutex;
  std::condition_variable changed;
  std::deque<Batch> ready;
  std::exception_ptr error;
  bool finished = false;
  bool cancelled = false;
  std::thread producer;

  ~Epoch() { cancel(); }

  void cancel() {
    {
      std::lock_guard lock(mutex);
      cancelled = true;
    }
    changed.notify_all();
    if (producer.joinable()) producer.join();
  }

  // Blocks until a batch is ready; false at the end of the epoch.
  bool next(Batch& out) {
    const auto begin = std::chrono::steady_clock::now();
    std::unique_lock lock(mutex);
    changed.wait(lock, [&] { return !ready.empty() || finished || error; });
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
    if (error) std::rethrow_exception(error);
    if (ready.empty()) {
      lock.unlock();
      pass.finished();
      return false;
    }
    out = std::move(ready.front());
    ready.pop_front();
    changed.notify_all();
    lock.unlock();
    add_ingest_wait(waited, 1);
    pass.took(out.data.size(0));
    return true;
  }
};

struct DataLoader::Impl {
  TensorDataset dataset;
  DataLoaderOptions options;
  DistributedSampler sampler;
  std::shared_ptr<Iterator::Epoch> epoch;
  EpochStart resume;
  std::function<void(const EpochPosition&)> on_position;

  Impl(TensorDataset d, DataLoaderOptions o, DistributedSampler s)
      : dataset(std::move(d)), options(o), sampler(std::move(s)) {}
  // An iterator may outlive the loader; its producer must not outlive the dataset.
  ~Impl() {
    if (epoch) epoch->cancel();
  }
};

DataLoader::DataLoader(TensorDataset dataset, DataLoaderOptions options, int rank, int world_size) {
  if (options.batch_size < 1) {
    throw UsageError("batch_size=" + std::to_string(options.batch_size) + " must be >= 1");
  }
  if (options.prefetch_batches < 1) options.prefetch_batches = 1;
  if (dataset.targets.defined() && dataset.targets.size(0) != dataset.size()) {
    throw UsageError("dataset: " + std::to_string(dataset.size()) + " inputs but " +
                     std::to_string(dataset.targets.size(0)) + " targets");
  }
  SamplerOptions sampler_options{.dataset_size = dataset.size(),
                                 .num_replicas = world_size,
                                 .rank = rank,
                                 .shuffle = options.shuffle,
                                 .seed = options.seed,
                                 .drop_last = options.drop_last,
                                 .equal_shards = options.equal_shards};
  DistributedSampler sampler(sampler_options);
  if (options.drop_last && sampler.num_samples() < options.batch_size) {
    throw UsageError(
        "batch_size=" + std::to_string(options.batch_size) +
        " is larger than this rank's shard of " + std::to_string(sampler.num_samples()) +
        " examples, so drop_last leaves no batch: use a smaller batch size or fewer workers");
  }
  impl_ = std::make_unique<Impl>(std::move(dataset), options, std::move(sampler));
}

DataLoader::~DataLoader() = default;
DataLoader::DataLoader(DataLoader&&) noexcept = default;
DataLoader& DataLoader::operator=(DataLoader&&) noexcept = default;

void DataLoader::set_epoch(int64_t epoch) { impl_->sampler.set_epoch(epoch); }

void DataLoader::start_at(EpochStart start) { impl_->resume = start; }
EpochPosition DataLoader::position() const {
  return impl_->epoch ? impl_->epoch->pass.position : EpochPosition{};
}
void DataLoader::set_on_position(std::function<void(const EpochPosition&)> callback) {
  impl_->on_position = std::move(callback);
}

int64_t DataLoader::num_samples() const { return impl_->sampler.num_samples(); }

int64_t DataLoader::num_batches() const { return batches_of(num_samples(), impl_->options); }

const DataLoaderOptions& DataLoader::options() const { return impl_->options; }
const DistributedSampler& DataLoader::sampler() const { return impl_->sampler; }

DataLoader::Iterator::Iterator(std::shared_ptr<Epoch> epoch, bool done)
    : epoch_(std::move(epoch)), done_(done) {
  if (!done_) ++*this;
}

DataLoader::Iterator& DataLoader::Iterator::operator++() {
  if (!epoch_ || !epoch_->next(current_)) {
    done_ = true;
    current_ = Batch{};
  }
  return *this;
}

DataLoader::Iterator DataLoader::begin() {
  if (impl_->epoch) impl_->epoch->cancel();
  auto epoch = std::make_shared<Iterator::Epoch>();
  const auto& sampler = impl_->sampler;
  // Resumed inside this epoch: the permutation's rows every rank had taken, then this rank's own.
  const auto start = take_start(impl_->resume, sampler.epoch());
  auto indices = sampler.indices(start.unsharded_rows);
  const auto own = std::clamp<int64_t>(start.yielded_rows, 0, static_cast<int64_t>(indices.size()));
  indices.erase(indices.begin(), indices.begin() + static_cast<std::ptrdiff_t>(own));
  epoch->pass = {.position = {.epoch = sampler.epoch(),
                              .unsharded_rows = start.unsharded_rows,
                              .yielded_rows = own},
                 .on_position = impl_->on_position};
  const auto options = impl_->options;
  const int64_t batches = batches_of(static_cast<int64_t>(indices.size()), options);
  const TensorDataset* dataset = &impl_->dataset;
  Iterator::Epoch* raw = epoch.get();
  epoch->producer = std::thread([raw, dataset, options, batches, indices = std::move(indices)] {
    try {
      auto all = torch::tensor(indices, torch::kLong);
      for (int64_t b = 0; b < batches; ++b) {
        const int64_t start = b * options.batch_size;
        const int64_t count = std::min<int64_t>(options.batch_size, all.size(0) - start);
        Batch batch = dataset->get_batch(all.narrow(0, start, count));
        batch.data = to_device(batch.data, options.device);
        batch.target = to_device(batch.target, options.device);
        std::unique_lock lock(raw->mutex);
        raw->changed.wait(lock, [&] {
          return raw->cancelled || static_cast<int>(raw->ready.size()) < options.prefetch_batches;
        });
        if (raw->cancelled) return;
        raw->ready.push_back(std::move(batch));
        raw->changed.notify_all();
      }
    } catch (...) {
      std::lock_guard lock(raw->mutex);
      raw->error = std::current_exception();
    }
    std::lock_guard lock(raw->mutex);
    raw->finished = true;
    raw->changed.notify_all();
  });
  impl_->epoch = epoch;
  return Iterator(std::move(epoch), false);
}

DataLoader::Iterator DataLoader::end() { return Iterator(nullptr, true); }

}  // namespace cohort::data

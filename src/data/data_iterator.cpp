#include "cohort/data/data_iterator.h"

#include <torch/types.h>
#include <condition_variable>
#include <deque>
#include <iostream>
#include <mutex>
#include <random>
#include <thread>

#include "cohort/error.h"
#include "cohort/trace.h"
#include "data/pass_position.h"
#include "data/plan.h"
#include "data/task_runner.h"
#include "data/to_device.h"

namespace cohort::data {

namespace {

using Clock = std::chrono::steady_clock;

std::mutex g_ingest_mutex;
IngestStats g_ingest;

}  // namespace

IngestStats take_ingest_stats() {
  std::lock_guard lock(g_ingest_mutex);
  IngestStats out = g_ingest;
  g_ingest = IngestStats{};
  return out;
}

void add_ingest_wait(double seconds, int64_t batches) {
  trace::add(trace::Phase::kDataWait, seconds);
  std::lock_guard lock(g_ingest_mutex);
  g_ingest.wait_seconds += seconds;
  g_ingest.batches += batches;
}

struct DataIterator::Impl {
  Dataset dataset;
  std::optional<int64_t> next_epoch;
  int64_t last_epoch = -1;
  BatchAgreement agreement;
  std::map<std::string, std::string> worker_env;
  std::function<void(const std::string&)> on_listening;
  std::unique_ptr<TaskRunner> runner;
  IngestStats stats;
  EpochStart resume;
  PassPosition pass;

  // The pass in progress.
  IterBatchesOptions options;
  int64_t epoch = 0;
  int64_t batch_index = 0;
  int64_t rows_to_leave_out = 0;  // a resumed pass's first rows, which the consumer had taken
  std::thread producer;
  std::mutex mutex;
  std::condition_variable changed;
  std::deque<Block> ready;
  std::vector<Block> retired;  // used by the consumer, to be freed by the producer
  std::exception_ptr error;
  bool finished = true;
  bool cancelled = false;

  explicit Impl(Dataset d) : dataset(std::move(d)) {}
  ~Impl() { end_pass(); }

  void end_pass() {
    bool producing = false;
    {
      std::lock_guard lock(mutex);
      cancelled = true;
      producing = !finished;
    }
    changed.notify_all();
    // Wakes a producer blocked on the runner. A pass that ran to its end leaves the runner as it
    // is: its workers may be on the next epoch already.
    if (runner && producing) runner->cancel();
    if (producer.joinable()) producer.join();
    ready.clear();
    retired.clear();
  }

  // Blocks until the consumer has room; false once the pass is cancelled.
  bool push(Block block) {
    if (rows_to_leave_out > 0) {
      const int64_t rows = block.num_rows();
      const int64_t out = std::min(rows, rows_to_leave_out);
      rows_to_leave_out -= out;
      if (out == rows) return true;
      block = block.slice(out, rows - out);
    }
    for (auto& [name, column] : block.columns) column = to_device(column, options.device);
    std::vector<Block> release;
    {
      std::unique_lock lock(mutex);
      changed.wait(lock, [&] {
        return cancelled || static_cast<int>(ready.size()) < options.prefetch_batches;
      });
      if (cancelled) return false;
      ready.push_back(std::move(block));
      release.swap(retired);
      changed.notify_all();
    }
    // The consumer's used batches are freed here (unmapping a shared-memory batch takes a while).
    release.clear();
    return true;
  }

  void produce() {
    std::mt19937_64 engine(options.local_shuffle_seed * 0x9E3779B97F4A7C15ULL +
                           static_cast<uint64_t>(epoch) + 7);
    Block pending;
    int64_t have = 0;
    const int64_t batch = options.batch_size;
    const int64_t buffer = std::max<int64_t>(options.local_shuffle_buffer_size, 0);
    auto emit = [&](bool final) {
      while (have >= batch + (final ? 0 : buffer) && have > 0) {
        Block out;
        if (buffer > 0) {
          // batch rows drawn at random from the buffer; the rest stays for later batches.
          std::vector<int64_t> order(static_cast<size_t>(have));
          for (int64_t i = 0; i < have; ++i) order[static_cast<size_t>(i)] = i;
          for (int64_t i = 0; i < batch; ++i) {
            const auto j = i + static_cast<int64_t>(engine() % static_cast<uint64_t>(have - i));
            std::swap(order[static_cast<size_t>(i)], order[static_cast<size_t>(j)]);
          }
          auto index = torch::tensor(order, torch::kLong);
          out = pending.take(index.narrow(0, 0, batch));
          pending = pending.take(index.narrow(0, batch, have - batch));
        } else {
          out = pending.slice(0, batch);
          pending = pending.slice(batch, have - batch);
        }
        have -= batch;
        if (!push(std::move(out))) return false;
      }
      if (final && have > 0 && !options.drop_last) {
        if (!push(std::move(pending))) return false;
        have = 0;
      }
      return true;
    };
    try {
      while (true) {
        auto result = runner->next();
        if (!result) break;
        {
          std::lock_guard lock(mutex);
          stats.skipped_rows += result->skipped_rows;
          stats.skipped_batches += result->skipped_batches;
        }
        if (result->block.num_rows() == 0) continue;
        pending = have == 0 ? std::move(result->block) : Block::concat({pending, result->block});
        have = pending.num_rows();
        if (!emit(false)) return;
      }
      if (!emit(true)) return;
    } catch (const Cancelled&) {
      return;
    } catch (...) {
      std::lock_guard lock(mutex);
      error = std::current_exception();
    }
    std::lock_guard lock(mutex);
    finished = true;
    changed.notify_all();
  }

  void start(IterBatchesOptions o) {
    if (o.batch_size < 1)
      throw UsageError("iter_batches: batch_size=" + std::to_string(o.batch_size) +
                       " must be >= 1");
    if (o.prefetch_batches < 1) o.prefetch_batches = 1;
    end_pass();
    options = o;
    epoch = next_epoch ? *next_epoch : last_epoch + 1;
    next_epoch.reset();
    last_epoch = epoch;
    batch_index = 0;
    // Resumed inside this epoch: the rows of the whole order every shard had taken are not read
    // again; of this shard's own, those it had taken are left out as they come.
    const auto start = take_start(resume, epoch);
    const bool in_order = keeps_rows(dataset.plan()) && options.local_shuffle_buffer_size <= 0;
    pass.position = EpochPosition{.epoch = epoch,
                                  .unsharded_rows = start.unsharded_rows,
                                  .yielded_rows = start.yielded_rows,
                                  .in_order = in_order};
    // Rows in order are the shard's first: not read at all. Others are read and left out.
    const int64_t own_rows = in_order ? start.yielded_rows : 0;
    rows_to_leave_out = in_order ? 0 : start.yielded_rows;
    if (!runner) {
      const auto& plan = dataset.plan();
      const int workers = dataset.num_workers();
      if (workers > 0 || plan.execution.remote_workers > 0 ||
          !plan.execution.listen_address.empty()) {
        runner = make_worker_pool(plan, dataset.fingerprint(), workers, worker_env);
        if (on_listening && !runner->listen_address().empty())
          on_listening(runner->listen_address());
      } else {
        runner = make_inline_runner(plan);
      }
    }
    runner->start_epoch(epoch, epoch_tasks(dataset.plan(), epoch, start.unsharded_rows, own_rows));
    {
      std::lock_guard lock(mutex);
      ready.clear();
      error = nullptr;
      finished = false;
      cancelled = false;
    }
    producer = std::thread([this] { produce(); });
  }

  bool next(Block& out) {
    // The batch the consumer is done with is freed by the producer thread, off the training
    // thread (the last reference to a shared-memory batch unmaps it).
    Block used = std::move(out);
    out = Block{};
    const auto begin = Clock::now();
    bool have = false;
    {
      std::unique_lock lock(mutex);
      if (!used.columns.empty()) retired.push_back(std::move(used));
      changed.wait(lock, [&] { return !ready.empty() || finished || error || cancelled; });
      if (error) {
        auto e = error;
        error = nullptr;
        finished = true;
        lock.unlock();
        end_pass();
        std::rethrow_exception(e);
      }
      have = !ready.empty();
      if (have) {
        out = std::move(ready.front());
        ready.pop_front();
        changed.notify_all();
      }
    }
    const double waited = std::chrono::duration<double>(Clock::now() - begin).count();
    if (agreement && !agreement(epoch, batch_index, have)) {
      // Another consumer has no batch number batch_index: all end the epoch here.
      if (have) {
        std::cerr << "cohort: data: epoch " << epoch << " ends after " << batch_index
                  << " batches on every rank (another rank's shard ran out first)" << std::endl;
      }
      have = false;
    }
    if (!have) {
      end_pass();
      pass.finished();
      return false;
    }
    ++batch_index;
    pass.took(out.num_rows());
    {
      std::lock_guard lock(mutex);
      stats.wait_seconds += waited;
      stats.batches += 1;
      stats.rows += out.num_rows();
    }
    add_ingest_wait(waited, 1);
    return true;
  }
};

DataIterator::DataIterator(Dataset dataset) : impl_(std::make_unique<Impl>(std::move(dataset))) {}
DataIterator::~DataIterator() = default;
DataIterator::DataIterator(DataIterator&&) noexcept = default;
DataIterator& DataIterator::operator=(DataIterator&&) noexcept = default;

void DataIterator::set_epoch(int64_t epoch) { impl_->next_epoch = epoch; }

DataIterator::Stream DataIterator::iter_batches(IterBatchesOptions options) {
  serve_if_data_worker(impl_->dataset);
  impl_->start(options);
  return Stream(impl_.get());
}

void DataIterator::start_at(EpochStart start) { impl_->resume = start; }
EpochPosition DataIterator::position() const { return impl_->pass.position; }
void DataIterator::set_on_position(std::function<void(const EpochPosition&)> callback) {
  impl_->pass.on_position = std::move(callback);
}

IngestStats DataIterator::stats() const {
  std::lock_guard lock(impl_->mutex);
  IngestStats out = impl_->stats;
  if (impl_->runner) out.tasks_redone = impl_->runner->tasks_redone();
  return out;
}

std::string DataIterator::listen_address() const {
  return impl_->runner ? impl_->runner->listen_address() : "";
}
const Dataset& DataIterator::dataset() const { return impl_->dataset; }
void DataIterator::set_batch_agreement(BatchAgreement agreement) {
  impl_->agreement = std::move(agreement);
}
void DataIterator::set_worker_environment(std::map<std::string, std::string> env) {
  impl_->worker_env = std::move(env);
}
void DataIterator::set_on_listening(std::function<void(const std::string&)> callback) {
  impl_->on_listening = std::move(callback);
}

DataIterator::Stream::Iterator::Iterator(Impl* impl, bool done) : impl_(impl), done_(done) {
  if (!done_) ++*this;
}

DataIterator::Stream::Iterator& DataIterator::Stream::Iterator::operator++() {
  if (!impl_ || !impl_->next(current_)) {
    done_ = true;
    current_ = Block{};
  }
  return *this;
}

DataIterator::Stream::Iterator DataIterator::Stream::begin() { return Iterator(impl_, false); }
DataIterator::Stream::Iterator DataIterator::Stream::end() { return Iterator(nullptr, true); }

}  // namespace cohort::data

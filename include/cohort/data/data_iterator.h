#pragma once
#include <cstdint>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <string>

#include "cohort/data/dataset.h"
#include "cohort/data/epoch_position.h"
#include "cohort/runtime/worker_info.h"

namespace cohort::data {

/// What a consumer waited for and what the pipeline dropped.
struct IngestStats {
  /// Time the consumer spent blocked waiting for a batch (the exposed ingest time).
  double wait_seconds = 0;
  int64_t batches = 0;  ///< batches delivered
  int64_t rows = 0;     ///< rows delivered
  /// Rows a source skipped (unreadable files) and batches a stage skipped (OnError::kSkip).
  int64_t skipped_rows = 0;
  int64_t skipped_batches = 0;  ///< batches skipped by a stage (OnError::kSkip)
  /// Tasks redone because the worker that had them died.
  int64_t tasks_redone = 0;
};

/// Streams one Dataset epoch after epoch (Ray's DataIterator). Preprocessing workers start with the
/// first epoch and serve every later one; they end with the iterator.
class DataIterator {
 public:
  /// A stream of `dataset` (Dataset::iterator() makes one).
  explicit DataIterator(Dataset dataset);
  ~DataIterator();
  /// Movable, not copyable: it owns the preprocessing workers.
  DataIterator(DataIterator&&) noexcept;
  /// Moves the stream and its workers in.
  DataIterator& operator=(DataIterator&&) noexcept;

  /// The epoch the next iter_batches() streams: reseeds random_shuffle, the local shuffle and the
  /// random preprocessors. Without a call, epochs count up from 0 with every iter_batches().
  void set_epoch(int64_t epoch);

  class Stream;
  /// One pass: `for (Block& batch : it.iter_batches({.batch_size = 64})) ...`. Starting another
  /// pass ends an unfinished one.
  Stream iter_batches(IterBatchesOptions options = {});

  /// Resuming inside an epoch: the pass of start.epoch begins at `start` (epoch_position.h), once.
  void start_at(EpochStart start);
  /// Where the consumer stands in the pass begun last (its rows taken so far).
  EpochPosition position() const;
  /// Called with position() after every batch the consumer takes and when a pass ends: to keep
  /// it in a checkpoint (the Trainer's get_dataset_shard does).
  void set_on_position(std::function<void(const EpochPosition&)> callback);

  /// Since the iterator was made.
  IngestStats stats() const;
  /// Where remote preprocessing workers connect (ExecutionOptions::listen_address with the port
  /// that was picked); empty before the first pass or without one.
  std::string listen_address() const;
  /// The dataset it streams.
  const Dataset& dataset() const;

  /// For data parallel training: called before each batch with its index in the epoch and whether
  /// this consumer has it; returns whether every consumer does. A consumer then ends its epoch
  /// together with the others, so all see the same number of batches (the Trainer sets this).
  using BatchAgreement = std::function<bool(int64_t epoch, int64_t batch, bool have)>;
  /// Sets the agreement (see BatchAgreement).
  void set_batch_agreement(BatchAgreement agreement);
  /// Variables added to the environment of the preprocessing workers it starts.
  void set_worker_environment(std::map<std::string, std::string> env);
  /// Called once, when the first pass opens the listening socket for remote workers, with its
  /// address (host:port): to tell workers elsewhere where to connect.
  void set_on_listening(std::function<void(const std::string& address)> callback);

  struct Impl;

  /// One epoch's pass (iter_batches()): `for (Block& batch : iterator.iter_batches(...))`.
  class Stream {
   public:
    /// An input iterator over a pass's batches.
    class Iterator {
     public:
      using iterator_category = std::input_iterator_tag;  ///< standard iterator trait
      using value_type = Block;                           ///< a batch
      using difference_type = std::ptrdiff_t;             ///< standard iterator trait
      using pointer = Block*;                             ///< standard iterator trait
      using reference = Block&;                           ///< standard iterator trait
      /// The current batch.
      Block& operator*() { return current_; }
      /// The current batch's members.
      Block* operator->() { return &current_; }
      /// Moves to the next batch (waits for it).
      Iterator& operator++();
      /// Whether both are at the end, or both not.
      bool operator==(const Iterator& other) const { return done_ == other.done_; }
      /// The opposite of ==.
      bool operator!=(const Iterator& other) const { return !(*this == other); }

     private:
      friend class Stream;
      Iterator(Impl* impl, bool done);
      Impl* impl_ = nullptr;
      Block current_;
      bool done_ = true;
    };
    /// The first batch (starts the pass).
    Iterator begin();
    /// The end of the pass.
    Iterator end();

   private:
    friend class DataIterator;
    explicit Stream(Impl* impl) : impl_(impl) {}
    Impl* impl_;
  };

 private:
  std::unique_ptr<Impl> impl_;
};

/// Totals over every DataIterator (and DataLoader) of this process since the last call, then reset:
/// what train::report() adds to a report as the exposed ingest time.
IngestStats take_ingest_stats();
/// Adds to those totals (for other loaders).
void add_ingest_wait(double seconds, int64_t batches);

/// In a process started in the data role for `dataset` (same fingerprint): serves its tasks until
/// the consumer is done, then ends the process. Otherwise returns at once. DataIterator calls it,
/// so a program that builds its pipeline before iterating needs nothing else.
void serve_if_data_worker(const Dataset& dataset);

/// Connects to the consumer at `address` (its listen_address), proves it holds `secret` (the
/// consumer's ExecutionOptions::secret, or the job's) and runs `dataset`'s tasks for it until it
/// says stop (true), or goes away or cannot be reached (false, with the reason in `why`). Throws
/// UsageError when refused (another secret, or it streams another pipeline). For a process that
/// serves several consumers in turn; serve_if_data_worker serves one, then ends the process.
bool serve_data_consumer(const Dataset& dataset, const std::string& address,
                         const comm::JobSecret& secret, std::string* why = nullptr);

/// The role name a preprocessing worker process runs under.
inline constexpr const char* kDataRole = runtime::kDataWorkerRole;

}  // namespace cohort::data

#include "train/async_checkpoint.h"

#include <algorithm>

#include "cohort/error.h"
#include "cohort/runtime/control_channel.h"
#include "train/run_files.h"

namespace cohort::train {
namespace {

using Clock = std::chrono::steady_clock;

// How long one wait on the store lasts before the writer looks whether it was abandoned.
constexpr auto kWaitSlice = std::chrono::milliseconds(200);

}  // namespace

AsyncCheckpointWriter::AsyncCheckpointWriter(comm::Store store, std::chrono::milliseconds timeout)
    : store_(std::move(store)), timeout_(timeout) {}

AsyncCheckpointWriter::~AsyncCheckpointWriter() {
  abandon_ = true;
  if (thread_.joinable()) thread_.join();
}

double AsyncCheckpointWriter::wait() {
  if (!thread_.joinable()) return 0;
  const auto start = Clock::now();
  thread_.join();
  const double waited = std::chrono::duration<double>(Clock::now() - start).count();
  if (error_) {
    auto error = error_;
    error_ = nullptr;
    std::rethrow_exception(error);
  }
  return waited;
}

void AsyncCheckpointWriter::start(Job job) {
  if (thread_.joinable()) {
    throw RuntimeError("an asynchronous checkpoint is still in flight: wait() for it first");
  }
  thread_ = std::thread([this, job = std::move(job)] {
    // The failure keeps its kind: a peer's that timed out or went away is a consequence.
    const std::string failed = "the asynchronous checkpoint of report #" +
                               std::to_string(job.report_index) + " failed on rank " +
                               std::to_string(job.rank) + ": ";
    try {
      run(job);
    } catch (const TimeoutError& e) {
      error_ = std::make_exception_ptr(TimeoutError(failed + e.what()));
    } catch (const PeerFailureError& e) {
      error_ = std::make_exception_ptr(PeerFailureError(failed + e.what()));
    } catch (const std::exception& e) {
      error_ = std::make_exception_ptr(RuntimeError(failed + e.what()));
    }
  });
}

void AsyncCheckpointWriter::run(const Job& job) {
  if (!own_store_) own_store_ = store_.connect_again();
  if (job.has_files) {
    std::string outcome = "ok";
    try {
      merge_captured(captured_, job.staging, job.rank, job.umask);
    } catch (const std::exception& e) {
      outcome =
          std::string("could not write its files into ") + job.staging.string() + ": " + e.what();
    }
    own_store_->set(job.keys + std::to_string(job.rank), outcome);
    if (outcome != "ok") throw RuntimeError(outcome);
  }
  if (job.commit) commit(job);
}

void AsyncCheckpointWriter::commit(const Job& job) {
  const auto& c = *job.commit;
  std::vector<std::string> keys;
  for (int rank : c.ranks) keys.push_back(job.keys + std::to_string(rank));
  // Waits in slices, so that a loop that failed (or ended) meanwhile is not held up to the
  // timeout: an abandoned save is never committed.
  const auto deadline = Clock::now() + timeout_;
  while (!own_store_->check(keys)) {
    if (abandon_) return;
    if (Clock::now() >= deadline) {
      std::string missing;
      for (size_t i = 0; i < keys.size(); ++i) {
        if (!own_store_->check({keys[i]}))
          missing += (missing.empty() ? "" : ", ") + std::to_string(c.ranks[i]);
      }
      throw TimeoutError("ranks [" + missing + "] did not write their files within " +
                         std::to_string(timeout_.count()) + " ms; the checkpoint is not committed");
    }
    try {
      own_store_->wait(keys, std::min<std::chrono::milliseconds>(
                                 kWaitSlice, std::chrono::duration_cast<std::chrono::milliseconds>(
                                                 deadline - Clock::now())));
    } catch (const TimeoutError&) {
      // the next slice
    }
  }
  const auto outcomes = own_store_->get_many(keys);
  for (size_t i = 0; i < outcomes.size(); ++i) {
    if (outcomes[i] != "ok") {
      throw RuntimeError("rank " + std::to_string(c.ranks[i]) + " " + outcomes[i] +
                         "; the checkpoint is not committed");
    }
  }
  if (abandon_) return;
  // As a synchronous report: whole before it gets its final name.
  write_atomically(job.staging / kMetaFile, c.meta.dump(2) + "\n");
  write_manifest(job.staging);
  rename_durably(job.staging, c.final_path);
  own_store_->remove_prefix(job.keys);
  if (runtime::has_control_channel()) {
    Json message = c.message;
    message["checkpoint"] = c.final_path.string();
    runtime::send_control_message(message.dump());
  }
}

}  // namespace cohort::train

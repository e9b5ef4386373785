#include "train/async_checkpoint.h"

#include <algorithm>

#include "cohort/error.h"
#include "cohort/runtime/control_channel.h"
#include "train/run_files.h"
#include "train/snapshots.h"

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
  running_ = true;
  thread_ = std::thread([this, job = std::move(job)] {
    // The failure keeps its kind: a peer's that timed out or went away is a consequence.
    const std::string failed =
        (job.snapshot ? "snapshot #" : "the asynchronous checkpoint of report #") +
        std::to_string(job.report_index) + " failed on rank " + std::to_string(job.rank) + ": ";
    try {
      run(job);
    } catch (const TimeoutError& e) {
      error_ = std::make_exception_ptr(TimeoutError(failed + e.what()));
    } catch (const PeerFailureError& e) {
      error_ = std::make_exception_ptr(PeerFailureError(failed + e.what()));
    } catch (const std::exception& e) {
      error_ = std::make_exception_ptr(RuntimeError(failed + e.what()));
    }
    running_ = false;
  });
}

void AsyncCheckpointWriter::run(const Job& job) {
  if (!own_store_) own_store_ = store_.connect_again();
  if (job.snapshot) {
    keep_snapshot(job);
    return;
  }
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

bool AsyncCheckpointWriter::wait_for_ranks(const std::string& prefix, const std::vector<int>& ranks,
                                           const std::string& what) {
  std::vector<std::string> keys;
  for (int rank : ranks) keys.push_back(prefix + std::to_string(rank));
  // Waits in slices, so that a loop that failed (or ended) meanwhile is not held up to the
  // timeout: an abandoned save is never committed.
  const auto deadline = Clock::now() + timeout_;
  while (!own_store_->check(keys)) {
    if (abandon_) return false;
    if (Clock::now() >= deadline) {
      std::string missing;
      for (size_t i = 0; i < keys.size(); ++i) {
        if (!own_store_->check({keys[i]}))
          missing += (missing.empty() ? "" : ", ") + std::to_string(ranks[i]);
      }
      throw TimeoutError("ranks [" + missing + "] did not write their files within " +
                         std::to_string(timeout_.count()) + " ms; " + what);
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
    if (outcomes[i] != "ok")
      throw RuntimeError("rank " + std::to_string(ranks[i]) + " " + outcomes[i] + "; " + what);
  }
  return !abandon_;
}

void AsyncCheckpointWriter::commit(const Job& job) {
  const auto& c = *job.commit;
  if (!wait_for_ranks(job.keys, c.ranks, "the checkpoint is not committed")) return;
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

void AsyncCheckpointWriter::keep_snapshot(const Job& job) {
  const auto& snap = *job.snapshot;
  const auto staging = snap.run_folder / snapshot_staging_name(snap.token, job.report_index);
  std::string outcome = "ok";
  try {
    // This rank's own files and their list, then the buddy copies both ways: every send posted
    // before any receive waits.
    std::filesystem::create_directories(staging / kSnapshotCheckpointDir);
    std::filesystem::create_directories(staging / kSnapshotRanksDir);
    std::filesystem::create_directories(staging / kSnapshotCopiesDir);
    merge_captured(captured_, staging / kSnapshotCheckpointDir, job.rank, job.umask);
    Json names = Json::array();
    for (const auto& [name, bytes] : captured_.files()) names.push_back(name);
    write_atomically(staging / kSnapshotRanksDir / (std::to_string(job.rank) + ".json"),
                     names.dump() + "\n");
    auto group = snap.group;
    SendsInFlight sends;
    if (snap.buddy >= 0) sends = send_files_async(group, snap.buddy, captured_);
    for (int ward : snap.wards) {
      Json copied = Json::array();
      const auto into = staging / kSnapshotCopiesDir / std::to_string(ward);
      for (const auto& [name, bytes] : receive_files(group, ward)) {
        std::filesystem::create_directories((into / name).parent_path());
        write_atomically(into / name, bytes);
        copied.push_back(name);
      }
      write_atomically(staging / kSnapshotCopiesDir / (std::to_string(ward) + ".json"),
                       copied.dump() + "\n");
    }
    sends.wait();
  } catch (const TimeoutError&) {
    throw;  // a peer's: it says which
  } catch (const PeerFailureError&) {
    throw;
  } catch (const std::exception& e) {
    outcome = std::string("could not keep its snapshot in ") + staging.string() + ": " + e.what();
  }
  own_store_->set(snap.keys + std::to_string(job.rank), outcome);
  if (outcome != "ok") throw RuntimeError(outcome);
  if (snap.node_ranks.empty()) return;
  // The node's committer: once its ranks' files and copies are in, the snapshot gets its name.
  if (!wait_for_ranks(snap.keys, snap.node_ranks, "the snapshot is not kept")) return;
  const auto checkpoint = staging / kSnapshotCheckpointDir;
  std::filesystem::create_directories(checkpoint);
  write_atomically(checkpoint / kMetaFile, snap.meta.dump(2) + "\n");
  write_manifest(checkpoint);
  rename_durably(staging, snap.run_folder / snap.name);
  // The newest two: a node whose next snapshot is half written when the group fails still has a
  // whole one that the others' nodes may hold too.
  prune_snapshots(snap.run_folder, 2, snap.token);
}

}  // namespace cohort::train

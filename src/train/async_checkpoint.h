// A checkpoint written and committed behind the training loop (train::SaveOptions::async): the
// loop's rank captures its files in memory (captured(), buffers reused from save to save) and goes
// on; this writer's thread writes them into the report's staging folder of the run directory, and
// on rank 0 commits the checkpoint once every rank's files are there, as a synchronous report
// would (meta.json, manifest, a durable rename, the driver told). At most one save in flight per
// rank. The same writer keeps train::snapshot's in-memory snapshots (train/snapshots.h): its
// thread writes them onto the node's memory-backed storage and exchanges buddy copies.
#pragma once
#include <atomic>
#include <chrono>
#include <exception>
#include <filesystem>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cohort/comm/process_group.h"
#include "cohort/comm/store.h"
#include "cohort/json.h"
#include "train/run_files.h"

namespace cohort::train {

class AsyncCheckpointWriter {
 public:
  // Rank 0's part: what it commits once the ranks' files are in the staging folder.
  struct Commit {
    Json meta;                         // meta.json
    std::filesystem::path final_path;  // <run>/checkpoint_NNNNNN
    std::vector<int> ranks;            // whose files it waits for (rank 0's own among them)
    Json message;                      // sent to the driver with "checkpoint" set, when committed
  };
  // A snapshot's part (train::snapshot): where on the node, the buddy copies, who commits.
  struct Snapshot {
    std::filesystem::path run_folder;  // the node's folder of the run's snapshots
    std::string token;                 // the start's run token (its staging folders are kept)
    std::string name;                  // snapshot_<token>_<n>, staged as staging_<token>_<n>
    Json meta;                         // meta.json, the same on every node
    comm::ProcessGroup group;          // for the buddy copies (not the loop's: a thread of its own)
    int buddy = -1;                    // who keeps a copy of this rank's files (-1: nobody)
    std::vector<int> wards;            // whose copies this rank keeps
    std::vector<int> node_ranks;       // the node's ranks, when this rank commits the node's
    std::string keys;                  // store prefix: "<keys><rank>" says "ok" or the error
  };
  // One save.
  struct Job {
    bool has_files = false;         // this rank captured files (rank 0 may have none to write)
    std::filesystem::path staging;  // the report's staging folder in the run directory
    std::string keys;               // store prefix: "<keys><rank>" says "ok" or the rank's error
    int rank = 0;
    int umask = 077;
    int64_t report_index = 0;
    std::optional<Commit> commit;      // rank 0's
    std::optional<Snapshot> snapshot;  // a snapshot's (then staging, keys and commit are unused)
  };

  // Waits on `store` (a connection of its own is made for the writer's thread) up to `timeout`
  // for the other ranks' files.
  AsyncCheckpointWriter(comm::Store store, std::chrono::milliseconds timeout);
  // Abandons a save in flight: it stops at its next wait, its staging folder is never committed
  // (the previous checkpoint stays the latest).
  ~AsyncCheckpointWriter();
  AsyncCheckpointWriter(const AsyncCheckpointWriter&) = delete;
  AsyncCheckpointWriter& operator=(const AsyncCheckpointWriter&) = delete;

  // Waits for the save in flight, if any, and rethrows its failure (a RuntimeError naming the
  // report); returns the seconds waited.
  double wait();
  // Whether a save is still being written (without waiting).
  bool busy() const { return running_; }
  // Starts `job`, writing out what captured() holds (none may be in flight: wait() first).
  void start(Job job);
  // Where a save captures this rank's files (train::FileCapture), between wait() and start().
  CapturedFiles& captured() { return captured_; }

 private:
  void run(const Job& job);
  void commit(const Job& job);
  void keep_snapshot(const Job& job);
  // Waits for the keys "<prefix><rank>" of `ranks` (in slices, so that an abandoned save stops
  // soon) and throws unless each says "ok"; false when the save was abandoned meanwhile. `what`
  // names what is not done ("the checkpoint is not committed").
  bool wait_for_ranks(const std::string& prefix, const std::vector<int>& ranks,
                      const std::string& what);

  comm::Store store_;
  std::optional<comm::Store> own_store_;  // made by the first job's thread
  std::chrono::milliseconds timeout_;
  std::thread thread_;
  std::atomic<bool> abandon_{false};
  std::atomic<bool> running_{false};  // the thread has not finished its job
  std::exception_ptr error_;
  CapturedFiles captured_;
};

}  // namespace cohort::train

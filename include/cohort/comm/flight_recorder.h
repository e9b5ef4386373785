/// \file
/// The flight recorder: what a rank did last with its process groups and its control channel,
/// kept in a ring so that a hang or a collective that times out can be explained afterwards
/// (PyTorch's NCCL flight recorder, for every transport). Each process group records its
/// collectives and point-to-point operations into the recorder it was made with (sub-groups
/// share their parent's); the train layer adds the control messages and writes each rank's
/// records to `<run>/flight/rank-R.json` when the coordinator declares a hang or a collective
/// times out; flight_divergence() reads those files and names the first operation where the
/// ranks part ways.
#pragma once
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "cohort/json.h"

namespace cohort::comm {

/// How many operations a recorder keeps by default: the newest, the oldest are dropped.
inline constexpr size_t kDefaultFlightRecorderEntries = 2048;

/// Where a recorded operation stands.
enum class FlightState {
  kStarted,    ///< entered, not finished (or not waited for yet)
  kCompleted,  ///< waited for and done (for CUDA tensors: ordered on the caller's stream)
  kFailed,     ///< ended with an error (a peer died or closed its connection, another error)
  kTimedOut,   ///< past its deadline
  kAborted,    ///< given up because a peer was lost (live recovery)
};
/// "started", "completed", "failed", "timed out" or "aborted".
const char* to_string(FlightState state);

/// One operation of a rank: a collective, a point-to-point operation or a control message (a
/// message's `detail` is "send" or "recv").
struct FlightEntry {
  int64_t id = 0;     ///< its place in this recorder's order (1, 2, ...)
  std::string group;  ///< the process group's name (its key prefix), "control" for messages
  /// The group's count of operations at it (1-based): the same call on every member has the
  /// same number; 0 for a control message.
  int64_t seq = 0;
  std::string op;        ///< "allreduce", "send", ... or the control message's type
  std::string dtype;     ///< the first tensor's dtype ("" for none)
  int64_t numel = 0;     ///< elements of the first tensor
  int tensors = 0;       ///< tensors given
  int peer = -1;         ///< the peer's group rank of a send or recv (-1: none)
  std::string detail;    ///< the transport, and what the group said it does (set_activity)
  double started_s = 0;  ///< when it began, seconds since the Unix epoch
  double ended_s = 0;    ///< when it ended (0: not yet)
  FlightState state = FlightState::kStarted;  ///< where it stands
};

/// A ring of a rank's last operations, thread-safe (collectives are recorded by the training
/// thread, control messages by any, and the recorder is written out by the heartbeat thread).
class FlightRecorder {
 public:
  /// Keeps the last `capacity` operations (at least 1).
  explicit FlightRecorder(size_t capacity = kDefaultFlightRecorderEntries);

  /// A group whose operations it records: its name and its members by global rank. What the
  /// written records name for flight_divergence() to compare the members.
  void add_group(const std::string& name, const std::vector<int>& global_ranks);
  /// Records the start of `entry` (its id and started_s are filled in); returns its id.
  int64_t begin(const FlightEntry& entry);
  /// The operation of `id` ended as `state` (nothing when it was dropped from the ring).
  void end(int64_t id, FlightState state);
  /// Records a control message of `type`, sent ("send") or received ("recv"), as ended at once.
  void note_control(const std::string& type, const std::string& direction);

  /// The operations it keeps, oldest first.
  std::vector<FlightEntry> entries() const;
  /// How many operations it dropped (the ring was full).
  int64_t dropped() const;
  /// Its records as written to `<run>/flight/rank-R.json`: {"rank", "pid", "reason",
  /// "written_at_s", "capacity", "dropped", "groups": {name: {"ranks": [...], "entered": n}},
  /// "entries": [...]}.
  Json to_json(int rank, const std::string& reason) const;

 private:
  mutable std::mutex mutex_;
  size_t capacity_;
  std::vector<FlightEntry> ring_;  // ring_[id % capacity_]
  int64_t next_id_ = 1;
  struct Group {
    std::vector<int> ranks;
    int64_t entered = 0;
  };
  std::vector<std::pair<std::string, Group>> groups_;
};

/// The first operation where the ranks part ways, from their written records (to_json(); null or
/// malformed ones, of ranks that could not write theirs, are named as unknown): per group, the
/// first operation some members entered and others did not, or entered as different operations
/// (another op, dtype or size), or that some finished and others still wait in. One line per
/// group that diverges, the earliest first, e.g. "group train/x: collective #12 (allreduce
/// float [1]): rank 0 entered it (started, 3.1 s before its records were written), rank 1 did
/// not (its last: #11 allreduce, completed)". "" when the records agree or nothing is known.
std::string flight_divergence(const std::vector<Json>& records_by_rank);

}  // namespace cohort::comm

// In-memory replicated snapshots (train::snapshot): every rank's checkpoint files kept on its
// node's memory-backed storage (RunConfig::snapshot_path, /dev/shm by default), which outlives the
// rank's process, and a copy of them kept by a buddy rank, on another node when the job spans
// nodes. A restarted group restores from them when the survivors' nodes hold every rank's files
// and they are newer than the latest checkpoint on disk.
//
// On a node, under <snapshot_path>/<run folder>:
//   staging_<token>_<n>/          a snapshot being written (never restored from)
//   snapshot_<token>_<n>/         a committed one (renamed from staging once the node's ranks
//   wrote):
//     checkpoint/                 the node's ranks' own files, meta.json and manifest.json
//     ranks/<r>.json              the files of rank r among them
//     copies/<w>/, copies/<w>.json  the buddy copy of rank w's files, and their list
#pragma once
#include <cstdint>
#include <filesystem>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "cohort/comm/process_group.h"
#include "cohort/json.h"
#include "train/kept_tensors.h"
#include "train/run_files.h"

namespace cohort::train {

inline constexpr const char* kSnapshotCheckpointDir = "checkpoint";
inline constexpr const char* kSnapshotRanksDir = "ranks";
inline constexpr const char* kSnapshotCopiesDir = "copies";

// A node's folder of the run in `run_dir`: <root>/<run name>-<hash of the run directory's path>.
std::filesystem::path snapshot_run_folder(const std::filesystem::path& root,
                                          const std::filesystem::path& run_dir);
// "snapshot_<token>_<index>" and "staging_<token>_<index>".
std::string snapshot_name(const std::string& token, int64_t index);
std::string snapshot_staging_name(const std::string& token, int64_t index);

// Who keeps a copy of whose files, by world rank, from each rank's node: the rank at the same
// place among the ranks of the next node (cyclically), or on a single node the next rank. -1 for
// the rank of a world of one.
std::vector<int> snapshot_buddies(const std::vector<int>& node_of_rank);

// Rank `peer`'s files over `group`, point to point: every send is posted before anything is
// waited for, so that a ring of ranks that each send to one and receive from another cannot block.
// The sends in flight (and what they send), to be waited for after the receives.
struct SendsInFlight {
  std::vector<comm::Work> works;
  std::vector<at::Tensor> tensors;
  void wait();
};
// Every file of `files` but those named in `except`; and `kept`'s files, where given, as the bytes
// of their files straight from their tensors (no copy into file bytes first).
SendsInFlight send_files_async(comm::ProcessGroup& group, int peer, const CapturedFiles& files,
                               const std::set<std::string>& except = {},
                               const KeptTensorFiles* kept = nullptr);
std::vector<std::pair<std::string, std::string>> receive_files(comm::ProcessGroup& group, int peer);

// One committed snapshot of a node: the ranks whose files it holds, its own or copies.
struct HeldSnapshot {
  std::string name;      // its folder's
  int64_t saved_ns = 0;  // rank 0's wall clock when it was taken (meta.json's "saved_ns")
  int world_size = 0;
  int64_t steps = -1;  // its metrics' "steps", when it has them (for messages)
  std::vector<int> own, copies;
};
void to_json(Json& j, const HeldSnapshot& s);
void from_json(const Json& j, HeldSnapshot& s);

// The committed snapshots in a node's run folder, newest first; none when it does not exist.
std::vector<HeldSnapshot> held_snapshots(const std::filesystem::path& run_folder);

// Which snapshot a restarted group restores from, from what every rank's node holds (by rank):
// the newest that is newer than the checkpoint on disk (`disk_saved_ns`, none: no checkpoint)
// and of which every rank's node holds every rank's files. `snapshot` is this rank's node's; `why`
// says what was chosen and why (empty when no node holds any snapshot newer than the disk's).
struct SnapshotChoice {
  std::optional<HeldSnapshot> snapshot;
  std::string why;
};
SnapshotChoice choose_snapshot(const std::vector<std::vector<HeldSnapshot>>& by_rank, int rank,
                               std::optional<int64_t> disk_saved_ns);

// The "saved_ns" of a checkpoint's meta.json (older ones: its "timestamp" in seconds); none
// without either.
std::optional<int64_t> saved_ns_of(const std::filesystem::path& checkpoint);

// A checkpoint folder of snapshot `held` on this node: its own checkpoint/ when every rank's
// files are there, else one made for rank `rank` from hard links of them and of the copies.
std::filesystem::path snapshot_checkpoint(const std::filesystem::path& run_folder,
                                          const HeldSnapshot& held, int rank);

// After a node committed a snapshot: keeps the newest `keep` committed snapshots and removes the
// staging folders of starts other than `token`'s (a crashed start's half-written ones).
void prune_snapshots(const std::filesystem::path& run_folder, size_t keep,
                     const std::string& token);

}  // namespace cohort::train

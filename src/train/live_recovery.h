// Live recovery (FailureConfig::Recovery::kLive): when a worker dies or hangs, the survivors abort
// the step in flight and go on without it, in the same processes.
//
//   1. A survivor's collective fails (PeerFailureError: the lost worker's connections closed; the
//      driver kills a hung worker first). The step, the batch agreement and should_stop() call
//      regroup_after(), which tells the driver "regroup_ready" with the survivor's optimizer
//      steps, and waits for the driver's answer in the store (live_decision_key).
//      (Under cohort launch "the driver" is rank 0, which hosts the coordinator and the same
//      decisions, LiveRegroups: launched_regroups.h; the launchers start the replacements.)
//   2. The driver, once every survivor is ready, publishes the new group: the survivors keep
//      their order, and a replacement it starts in the lost worker's slot takes the lost rank
//      (FailureConfig::replace_lost), else the group shrinks (down to ScalingConfig::min_workers).
//      The survivor that got furthest (optimizer steps, then synchronisations) is the source of
//      the state. A survivor that ended instead, too few workers, or no answer within the setup
//      timeout fall back to a restart.
//   3. The source saves its model's whole state into memory (with the data positions after its
//      last completed step), and every survivor unwinds its loop with a LiveRegroup. A survivor
//      as far as the source saves its own (the same state, with DDP) into memory too: nothing
//      needs to reach it. Without replicas the tensors of those saves are kept as they were, not
//      copied (kept_tensors.h): the rank loads its own state back from them, and serialises them
//      only for a peer it sends them to. ZeRO 1-3 in sharding groups: each rank takes its whole
//      state from a survivor as far that held the same shard (itself, where it can): the model
//      (at stage 3 the pieces of it that rank held), that shard and the run state; after the load,
//      the parameters are gathered from the shards again
//      (ShardedState::gather_parameters_from_shards), as a failure may have cut the all-gather
//      after the last step short. Where each rank holds a replica of its own (local SGD, DiLoCo:
//      ShardedState::holds_replicas), such a survivor keeps its replica and inner optimizer state
//      and takes the rest from the source; the others (a replacement, a survivor behind) take the
//      source's replica. The lost worker's progress since the last synchronisation is gone; its
//      rows count as trained on.
//   4. run_worker joins the new group (a replacement joins it from the start, SessionSpec::
//      live_round) and heal_from_peer() sends the source's state to those that need it; the
//      loop runs again from that checkpoint: every rank the same parameters and optimizer state
//      (or its own replica), the epoch's remaining rows re-balanced over the new group
//      (data::resume_start).
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "cohort/comm/store.h"
#include "cohort/error.h"
#include "cohort/train/checkpoint.h"
#include "train/kept_tensors.h"
#include "train/run_files.h"

namespace cohort::train {

struct WorkerSession;

// Unwinds a survivor's train loop after the group re-formed without a lost worker. Not a
// std::exception: a loop's own catch of std::exception lets it through.
struct LiveRegroup {
  int round = 0;       // the live rounds so far, this one included
  int rank = 0;        // this process's rank in the new group
  int world_size = 0;  // the new group's
  int source = 0;      // the rank whose state every rank takes
  int64_t next_checkpoint_index = 0;
  // The whole state of a rank that provides it (state_providers; a checkpoint's files, meta.json
  // included); null on the others. Without replicas, the tensors of its safetensors files are
  // kept as they were (`kept`), not copied into `state`: the rank loads its own state back from
  // them, and serialises them only for the peers it sends them to.
  std::shared_ptr<CapturedFiles> state;
  std::shared_ptr<KeptTensorFiles> kept;
  // By new rank, whether it keeps its own state (a survivor as far as the source, the source
  // included); empty on a replacement. With `replicas` (local SGD's) that is its replica, the
  // rest coming from the source; else its whole state. `own` is what it keeps, captured.
  std::vector<bool> keeps_own;
  bool replicas = false;
  std::shared_ptr<CapturedFiles> own;
  // Without replicas, by new rank: the new rank whose captured state it takes whole (itself
  // where it keeps its own). Empty on a replacement: the source publishes it for the heal.
  std::vector<int> provider;
};

// The run token of live round `round` of a start whose token is `token`: the regrouped group's
// store keys and staging folders are its own.
inline std::string live_run_token(const std::string& token, int round) {
  return token + "-live" + std::to_string(round);
}
// The folder of rank `rank`'s state in the live rounds of the start whose token is `token`, in
// `root` (the run's snapshots' folder on this node, else its run directory).
inline constexpr const char* kLiveStatePrefix = "live_";
inline std::filesystem::path live_state_folder_in(const std::filesystem::path& root,
                                                  const std::string& token, int rank) {
  return root / (kLiveStatePrefix + token + "_rank" + std::to_string(rank));
}
// Every live round's state folder in `root`: the driver's at the end of a run that failed (a
// killed worker leaves its own), as nothing restores from them.
void remove_live_states(const std::filesystem::path& root);

// Where the driver publishes live round `round` of the group started with `token`: a JSON object
// {"members": [by new rank: the old rank, or -1 for a replacement], "source": the new rank whose
// state everyone takes, "progress": [by new rank: [optimizer steps, synchronisations], or null
// for a replacement], "next_checkpoint": the next checkpoint's index, "cause": the failures}.
inline std::string live_decision_key(const std::string& token, int round) {
  return "live/" + token + "/" + std::to_string(round);
}

// By new rank of a live round's decision (`members`: by new rank the old rank, -1 for a
// replacement; `progress`: by new rank [optimizer steps, synchronisations], null for a
// replacement; `source`: the new rank that got furthest), the new rank whose captured state it
// takes whole: itself where it got as far as the source, else the source; with ZeRO's sharding
// groups of `shard_group` ranks (0: none), a survivor as far that held the same shard (its old
// rank at the same place in its group as the new rank in its new group), itself where it can.
// Empty, with `why`, where some rank finds none, or the group is no multiple of `shard_group`.
std::vector<int> state_providers(const std::vector<int>& members, const Json& progress, int source,
                                 int shard_group, std::string& why);

// From inside a catch of PeerFailureError in one of a step's collectives: with live recovery on
// and a ParallelModel to take the state from, takes part in the regroup and throws LiveRegroup;
// otherwise (or when the driver gives no answer) rethrows the error being handled.
[[noreturn]] void regroup_after(const PeerFailureError& error);

// Runs one of a step's collectives (`collective()`), regrouping on a peer's failure.
template <typename Collective>
decltype(auto) live_collective(Collective&& collective) {
  try {
    return collective();
  } catch (const PeerFailureError& e) {
    regroup_after(e);
  }
}

// What a regroup captures of a ParallelModel's state (`module`, `optimizer`) into `dir`. Where
// every rank holds the same state: the whole of it (DDP's optimizer state as one shard, which
// loads as fast as a copy). ZeRO: the model (at stage 3 this rank's pieces of it) and this rank's
// shard, which its manifest alone names (a rank of another sharding group with the same shard takes
// it). With replicas: this rank's as rank `rank` of the new group of `world_size` and, when `whole`
// (the source), the state every rank shares: the model file (the global parameters), the replicas'
// manifest (its values; the files each rank's own) and the run state.
void save_live_state(const std::filesystem::path& dir, const torch::nn::Module& module,
                     torch::optim::Optimizer& optimizer, int rank, int world_size, bool whole);

// In the new group (rank `rank` of `world_size` through `store`): each rank's provider sends it
// the state the regroup captured, where it keeps none of its own (and with replicas the source
// sends what every rank shares to those that keep their replica) over a Gloo group of their
// own; every rank writes its state into `dir` (replaced) with its manifest, and gets it as a
// checkpoint to resume from. Its safetensors files are not written where they are tensors in
// memory (kept_tensors.h): its own the regroup kept, or those a peer sent (over the bytes
// received); `kept` is set to them, for the session to read in place of those files.
Checkpoint heal_from_peer(const LiveRegroup& regroup, const comm::Store& store,
                          const std::string& token, const std::string& interface_address,
                          std::chrono::milliseconds timeout, const std::filesystem::path& dir,
                          int umask, KeptState& kept);

}  // namespace cohort::train

#include "train/live_recovery.h"

#include <algorithm>
#include <ctime>
#include <exception>
#include <vector>

#include "cohort/comm/process_group.h"
#include "cohort/runtime/control_channel.h"
#include "cohort/train/parallel_model.h"
#include "train/data_positions.h"
#include "train/snapshots.h"
#include "train/worker_session.h"

namespace cohort::train {
namespace {

// meta.json of the state a regroup takes: the last completed step's metrics and data positions.
// Every data-parallel shard of a DDP group stood where this rank's did (the batch agreement gives
// every rank the same batches), so each stream's position is this rank's for every old shard.
Json live_meta(const WorkerSession& s, int64_t steps) {
  const int world = s.context.world_size;
  Json metrics{{"steps", steps}, {"world_size", world}, {"epoch", 0}, {kEpochStepMetric, 0}};
  if (!s.positions_at_step.empty()) {
    const auto& p = s.positions_at_step.begin()->second;
    if (p.epoch >= 0) {
      metrics["epoch"] = p.epoch + 1;
      // The steps of the epoch done, at least 1 inside it: a resumed loop then starts inside the
      // epoch, after the rows the positions say were taken.
      const int64_t rows = p.unsharded_rows / world + p.yielded_rows;
      if (!p.finished)
        metrics[kEpochStepMetric] =
            std::max<int64_t>(1, rows / std::max<int64_t>(1, s.rows_at_step));
    }
  }
  Json meta{{"metrics", metrics},
            {"world_size", world},
            {"data_parallel_size", world},
            {"live_recovery", true},
            {"timestamp", std::time(nullptr)}};
  if (!s.positions_at_step.empty())
    meta[kDataPositionsKey] = replicated_positions(s.positions_at_step, world);
  return meta;
}

}  // namespace

void regroup_after(const PeerFailureError& error) {
  const auto original = std::current_exception();
  WorkerSession* s = current_session();
  if (s == nullptr || !s->live_recovery || !s->live_save || !runtime::has_control_channel())
    std::rethrow_exception(original);
  const int64_t steps = s->live_steps();
  Json decision;
  try {
    runtime::send_control_message(
        Json{{"type", "regroup_ready"}, {"steps", steps}, {"cause", error.what()}}.dump());
    const std::string key = live_decision_key(s->live_token, s->live_round + 1);
    s->store.wait({key}, s->collective_timeout);
    decision = Json::parse(s->store.get(key));
  } catch (const std::exception&) {
    // No driver or no answer: the failure stands, and the driver restarts the group.
    std::rethrow_exception(original);
  }
  const auto members = decision.at("members").get<std::vector<int>>();
  const auto mine = std::find(members.begin(), members.end(), s->context.world_rank);
  if (mine == members.end()) std::rethrow_exception(original);
  LiveRegroup regroup{.round = s->live_round + 1,
                      .rank = static_cast<int>(mine - members.begin()),
                      .world_size = static_cast<int>(members.size()),
                      .source = decision.at("source").get<int>(),
                      .next_checkpoint_index = decision.at("next_checkpoint").get<int64_t>()};
  if (regroup.rank == regroup.source) {
    regroup.state = std::make_shared<CapturedFiles>();
    // Captured in memory: nothing is written under this folder but its empty directories.
    const auto root =
        s->context.storage_path / (".live-capture-rank" + std::to_string(s->context.world_rank));
    {
      FileCapture capture(root, *regroup.state);
      s->live_save(root);
      write_atomically(root / kMetaFile, live_meta(*s, steps).dump(2) + "\n");
    }
    remove_tree(root);
  }
  throw regroup;
}

Checkpoint heal_from_peer(const LiveRegroup& regroup, const comm::Store& store,
                          const std::string& token, const std::string& interface_address,
                          std::chrono::milliseconds timeout, const std::filesystem::path& dir,
                          int umask) {
  remove_tree(dir);
  std::filesystem::create_directories(dir);
  if (regroup.world_size > 1) {
    // Gloo whatever the training's backend: the files are host memory.
    auto group = comm::ProcessGroup::create(store, regroup.rank, regroup.world_size,
                                            {.interface_address = interface_address,
                                             .setup_timeout = timeout,
                                             .timeout = timeout,
                                             .prefix = "live/" + token + "/heal",
                                             .backend = comm::Backend::kGloo});
    if (regroup.rank == regroup.source) {
      std::vector<SendsInFlight> sends;
      for (int peer = 0; peer < regroup.world_size; ++peer)
        if (peer != regroup.source) sends.push_back(send_files_async(group, peer, *regroup.state));
      for (auto& send : sends) send.wait();
    } else {
      for (const auto& [name, bytes] : receive_files(group, regroup.source))
        write_atomically(dir / name, bytes);
    }
  }
  if (regroup.rank == regroup.source) merge_captured(*regroup.state, dir, 0, umask);
  write_manifest(dir);
  return Checkpoint::from_directory(dir);
}

}  // namespace cohort::train

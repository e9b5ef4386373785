#include "train/live_recovery.h"

#include <algorithm>
#include <ctime>
#include <exception>
#include <iostream>
#include <optional>
#include <set>
#include <vector>

#include "cohort/comm/process_group.h"
#include "cohort/runtime/control_channel.h"
#include "cohort/train/parallel_model.h"
#include "train/data_positions.h"
#include "train/manifest.h"
#include "train/run_state.h"
#include "train/snapshots.h"
#include "train/state_files.h"
#include "train/worker_session.h"
#include "train/zero_checkpoint.h"

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

// The replica part's file of rank `rank` of `world_size` (state_files.h's naming).
std::string replica_file(int rank, int world_size) {
  return detail::rank_file(optim::kReplicasPart, rank, world_size, ".safetensors");
}

// Into a rank's folder of the live state, which holds the source's replica manifest: the manifest
// names this rank's replica file only, its own (`from` = `rank`) or the source's (`from`, which
// the values then name as "replica_from").
void point_replica_manifest(const std::filesystem::path& dir, int rank, int from, int world_size) {
  const auto name = std::string(optim::kReplicasPart);
  const auto manifest = dir / detail::state_manifest_file(name);
  auto values =
      detail::read_state_manifest(read_json(manifest), name, "live state " + manifest.string())
          .values;
  if (from == rank) {
    values.erase("replica_from");
  } else {
    values["replica_from"] = from;
  }
  detail::write_state_manifest(dir, name, world_size, {replica_file(from, world_size)}, values);
}

// Where the source publishes the providers (state_providers) for the heal, by the live round's
// token: a replacement knows none of the survivors' progress.
std::string providers_key(const std::string& token) { return "live/" + token + "/providers"; }

}  // namespace

std::vector<int> state_providers(const std::vector<int>& members, const Json& progress, int source,
                                 int shard_group, std::string& why) {
  const int world = static_cast<int>(members.size());
  const auto as_far = [&](int rank) {
    const auto& p = progress.at(static_cast<size_t>(rank));
    return !p.is_null() && p == progress.at(static_cast<size_t>(source));
  };
  std::vector<int> provider(static_cast<size_t>(world), source);
  if (shard_group <= 0) {
    for (int r = 0; r < world; ++r)
      if (as_far(r)) provider[static_cast<size_t>(r)] = r;
    return provider;
  }
  if (world % shard_group != 0) {
    why = "the " + std::to_string(world) + " workers left are no multiple of --shard-group-size " +
          std::to_string(shard_group);
    return {};
  }
  const auto holds = [&](int rank, int shard) {
    const int old = members[static_cast<size_t>(rank)];
    return old >= 0 && old % shard_group == shard && as_far(rank);
  };
  for (int r = 0; r < world; ++r) {
    const int shard = r % shard_group;
    int from = holds(r, shard) ? r : -1;
    for (int other = 0; other < world && from < 0; ++other)
      if (holds(other, shard)) from = other;
    if (from < 0) {
      why = "no survivor holds ZeRO shard " + std::to_string(shard) + " of " +
            std::to_string(shard_group) + " as of step " +
            progress.at(static_cast<size_t>(source)).at(0).dump() +
            " (its holders were lost or stopped a step behind)";
      return {};
    }
    provider[static_cast<size_t>(r)] = from;
  }
  return provider;
}

void remove_live_states(const std::filesystem::path& root) {
  std::error_code ignored;
  if (!std::filesystem::is_directory(root, ignored)) return;
  for (const auto& entry : std::filesystem::directory_iterator(root, ignored))
    if (entry.path().filename().string().rfind(kLiveStatePrefix, 0) == 0) remove_tree(entry.path());
}

void save_live_state(const std::filesystem::path& dir, const torch::nn::Module& module,
                     torch::optim::Optimizer& optimizer, int rank, int world_size, bool whole) {
  std::filesystem::create_directories(dir);
  const auto* sharded = dynamic_cast<const optim::ShardedState*>(&optimizer);
  if (sharded != nullptr && sharded->holds_replicas()) {
    const auto replica = sharded->replica_state_as(rank, world_size);
    save_state(dir, sharded->part_name(), replica);
    if (!whole) return;
    safetensors::write(dir / "model.safetensors", sharded->model_state(), {{"format", "pt"}});
    detail::write_state_manifest(dir, sharded->part_name(), world_size,
                                 {replica_file(rank, world_size)}, replica.values);
    detail::save_run_state(dir);
    return;
  }
  if (sharded != nullptr) {
    // ZeRO: its shard, which its manifest alone names (the others come from other ranks); at
    // stage 3 the model as its pieces (no collective gathers it whole in a broken group).
    const auto state = sharded->state_dict();
    if (sharded->sharded_units().empty()) {
      save_model(module, dir / "model.safetensors");
    } else {
      detail::save_model_pieces(dir, *sharded, module, state.shard, state.shards);
    }
    detail::save_own_piece(dir, sharded->part_name(), state);
    detail::save_run_state(dir);
    return;
  }
  // DDP's optimizer as shards rather than the archive optimizer.pt: captured and loaded back as
  // fast as a copy (a pickle of Adam's state takes seconds per GB). Another algorithm, or another
  // engine, as a checkpoint.
  if (sharded == nullptr && detail::save_optimizer_as_shards(dir, optimizer, module)) {
    save_model(module, dir / "model.safetensors");
    detail::save_run_state(dir);
    return;
  }
  save_checkpoint(dir, module, optimizer);
}

void regroup_after(const PeerFailureError& error) {
  const auto original = std::current_exception();
  WorkerSession* s = current_session();
  if (s == nullptr || !s->live_recovery || !s->live_save || !runtime::has_control_channel())
    std::rethrow_exception(original);
  const int64_t steps = s->live_steps();
  const int64_t syncs = s->live_syncs ? s->live_syncs() : 0;
  Json decision;
  try {
    runtime::send_control_message(Json{
        {"type", "regroup_ready"},
        {"steps", steps},
        {"syncs", syncs},
        {"cause", error.what()}}.dump());
    const std::string key = live_decision_key(s->live_token, s->live_round + 1);
    s->store.wait({key}, s->collective_timeout);
    decision = Json::parse(s->store.get(key));
  } catch (const std::exception&) {
    // No driver or no answer: the failure stands, and the driver restarts the group.
    std::rethrow_exception(original);
  }
  if (decision.contains("stop")) {
    // The host of the decisions found that the group cannot go on (rank 0 under cohort launch):
    // every survivor fails, and the launchers restart the job.
    std::cerr << "cohort: live recovery cannot go on: " << decision.at("stop").get<std::string>()
              << std::endl;
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
  // By new rank: with replicas, a survivor as far as the source (steps and synchronisations)
  // keeps its replica (the rest, which every rank shares, comes from the source); otherwise each
  // rank keeps its own state where it is its own provider (state_providers).
  const auto& progress = decision.at("progress");
  regroup.replicas = s->live_replicas;
  if (regroup.replicas) {
    const auto& furthest = progress.at(static_cast<size_t>(regroup.source));
    for (const auto& p : progress) regroup.keeps_own.push_back(!p.is_null() && p == furthest);
  } else {
    std::string why;
    regroup.provider = state_providers(members, progress, regroup.source, s->live_shard_group, why);
    if (regroup.provider.empty()) {
      // Every survivor reads the same decision and ends the same way: the driver restarts.
      std::cerr << "cohort: live recovery cannot go on: " << why
                << "; the group restarts from the last snapshot or checkpoint" << std::endl;
      std::rethrow_exception(original);
    }
    for (size_t r = 0; r < regroup.provider.size(); ++r)
      regroup.keeps_own.push_back(regroup.provider[r] == static_cast<int>(r));
  }
  // Captured in memory: nothing is written under the folder but its empty directories. With
  // `kept`, the safetensors files' tensors are kept there, not copied.
  const auto capture = [&](bool whole, KeptTensorFiles* kept = nullptr) {
    auto files = std::make_shared<CapturedFiles>();
    const auto root =
        s->context.storage_path / (".live-capture-rank" + std::to_string(s->context.world_rank));
    {
      FileCapture capture(root, *files);
      std::optional<TensorKeeping> keeping;
      if (kept != nullptr) keeping.emplace(root, *kept);
      s->live_save(root, regroup.rank, regroup.world_size, whole);
      if (whole) write_atomically(root / kMetaFile, live_meta(*s, steps).dump(2) + "\n");
    }
    remove_tree(root);
    return files;
  };
  if (regroup.replicas) {
    if (regroup.rank == regroup.source) {
      regroup.state = capture(true);
    } else if (regroup.keeps_own[static_cast<size_t>(regroup.rank)]) {
      regroup.own = capture(false);
    }
  } else if (std::count(regroup.provider.begin(), regroup.provider.end(), regroup.rank) > 0) {
    regroup.kept = std::make_shared<KeptTensorFiles>();
    regroup.state = capture(true, regroup.kept.get());
  }
  throw regroup;
}

Checkpoint heal_from_peer(const LiveRegroup& regroup, const comm::Store& store,
                          const std::string& token, const std::string& interface_address,
                          std::chrono::milliseconds timeout, const std::filesystem::path& dir,
                          int umask, KeptState& kept) {
  // Whether new rank `rank` keeps its own state (a replacement knows of none, and keeps none).
  const auto keeps_own = [&](int rank) {
    return !regroup.keeps_own.empty() && regroup.keeps_own[static_cast<size_t>(rank)];
  };
  remove_tree(dir);
  std::filesystem::create_directories(dir);
  // What a peer sent: its safetensors files kept as tensors over the bytes received, the rest
  // written.
  auto received = std::make_shared<KeptTensorFiles>();
  const auto take_files = [&](std::vector<std::pair<std::string, std::string>> files) {
    for (auto& [name, bytes] : files) {
      if (std::filesystem::path(name).extension() == ".safetensors") {
        (*received)[name] = kept_from_bytes(std::move(bytes), dir / name);
      } else {
        write_atomically(dir / name, bytes);
      }
    }
  };
  if (regroup.world_size > 1) {
    // Gloo whatever the training's backend: the files are host memory.
    auto group = comm::ProcessGroup::create(store, regroup.rank, regroup.world_size,
                                            {.interface_address = interface_address,
                                             .setup_timeout = timeout,
                                             .timeout = timeout,
                                             .prefix = "live/" + token + "/heal",
                                             .backend = comm::Backend::kGloo});
    // Who takes whose state (none with replicas): the source's word for a replacement.
    std::vector<int> provider = regroup.provider;
    const auto key = providers_key(token);
    comm::Store client = store;  // a handle on the same connection
    if (regroup.rank == regroup.source) {
      client.set(key, Json(provider).dump());
    } else if (regroup.keeps_own.empty()) {
      client.wait({key}, timeout);
      provider = Json::parse(client.get(key)).get<std::vector<int>>();
    }
    // Those as far as the source have their own state; with replicas they take what every rank
    // shares from the source, but not its replica.
    const auto sent_to = [&](int rank) { return !keeps_own(rank) || regroup.replicas; };
    if (!provider.empty()) {
      // The state as files to the peers this rank provides (its kept tensors from their memory).
      std::vector<SendsInFlight> sends;
      for (int peer = 0; peer < regroup.world_size; ++peer) {
        if (peer != regroup.rank && provider[static_cast<size_t>(peer)] == regroup.rank)
          sends.push_back(send_files_async(group, peer, *regroup.state, {}, regroup.kept.get()));
      }
      const int from = provider[static_cast<size_t>(regroup.rank)];
      if (from != regroup.rank) take_files(receive_files(group, from));
      for (auto& send : sends) send.wait();
    } else if (regroup.rank == regroup.source) {
      const std::set<std::string> replica{replica_file(regroup.source, regroup.world_size)};
      std::vector<SendsInFlight> sends;
      for (int peer = 0; peer < regroup.world_size; ++peer) {
        if (peer == regroup.source || !sent_to(peer)) continue;
        sends.push_back(send_files_async(group, peer, *regroup.state,
                                         keeps_own(peer) ? replica : std::set<std::string>{}));
      }
      for (auto& send : sends) send.wait();
    } else if (sent_to(regroup.rank)) {
      take_files(receive_files(group, regroup.source));
    }
  }
  if (regroup.state) merge_captured(*regroup.state, dir, 0, umask);
  // Its own state beside the source's files (which stay), where it keeps its own.
  if (regroup.own) merge_captured(*regroup.own, dir, 1, umask);
  if (std::filesystem::exists(dir / detail::state_manifest_file(optim::kReplicasPart))) {
    // Its own replica, or the source's.
    point_replica_manifest(dir, regroup.rank,
                           keeps_own(regroup.rank) ? regroup.rank : regroup.source,
                           regroup.world_size);
  }
  write_manifest(dir);
  const auto root = std::filesystem::absolute(dir);
  if (!received->empty()) {
    kept = {.root = root, .files = received};
  } else if (regroup.kept && !regroup.provider.empty() &&
             regroup.provider[static_cast<size_t>(regroup.rank)] == regroup.rank) {
    kept = {.root = root, .files = regroup.kept};  // its own
  }
  return Checkpoint::from_directory(dir);
}

}  // namespace cohort::train

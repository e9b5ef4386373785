#include "mesh_checkpoint.h"

#include <fstream>
#include <iostream>

#include "cohort/error.h"
#include "cohort/json.h"
#include "cohort/optim/state_dict.h"
#include "cohort/parallel/pipeline/schedule.h"
#include "cohort/parallel/sync_mode.h"
#include "cohort/train/context.h"
#include "train/run_files.h"
#include "train/run_state.h"

namespace cohort::train {
namespace {

constexpr const char* kMeshFile = "mesh.json";

int stages_per_rank(const std::string& schedule) {
  return parallel::pipeline::schedule_from_string(schedule) ==
                 parallel::pipeline::ScheduleKind::kInterleaved
             ? 2
             : 1;
}

// The folder of one (pp, tp) position's optimizer state: DDP's from dp index 0 (optimizer.pt, or
// a flat optimizer's state files), or every dp rank's ZeRO shards. Checkpoints written before ZeRO
// could shard a pipeline hold the state as a file of this name plus ".pt".
std::string optimizer_folder(const parallel::DeviceMesh& mesh) {
  const auto& s = mesh.shape();
  return "optimizer-pp" + std::to_string(mesh.pp_index()) + "-of-" + std::to_string(s.pp) + "-tp" +
         std::to_string(mesh.tp_index()) + "-of-" + std::to_string(s.tp);
}

bool first_rank() { return get_context().get_world_rank() == 0; }

// The optimizer state of a synchronous engine (a whole optimizer or ZeRO) into `optimizer`.
void load_mesh_optimizer_state(const std::filesystem::path& dir, const MeshLayout& written,
                               const MeshCheckpointParts& parts,
                               torch::optim::Optimizer& optimizer) {
  if (!written.same_cut(parts.layout)) {
    // Another cut: every stage's state by the model's names.
    std::vector<OptimizerPart> found;
    if (written.mesh) {
      found = find_optimizer_parts(dir);
      if (found.empty()) {
        throw UsageError("checkpoint " + dir.string() +
                         " was written before a mesh checkpoint named its stages' optimizer "
                         "state: resume it with " +
                         written.flags());
      }
    } else {
      // A run without a mesh: its optimizer was over the whole model's parameters, in order.
      OptimizerPart whole{.dir = dir, .parameters = {}};
      for (const auto& p : parts.whole->named_parameters())
        whole.parameters.push_back({p.key(), p.key(), p.value().sizes().vec()});
      found.push_back(std::move(whole));
    }
    if (first_rank()) {
      std::cout << "re-cutting the optimizer state of " << dir.filename().string() << " from "
                << (written.mesh ? written.flags() : "a run without a mesh") << " to "
                << parts.layout.flags() << std::endl;
    }
    load_optimizer_parts(found, optimizer, *parts.stages, parts.parameters);
    return;
  }
  const auto state = dir / optimizer_folder(*parts.mesh);
  auto old_file = state;
  old_file += ".pt";
  if (std::filesystem::is_directory(state)) {
    load_optimizer_state(state, optimizer, *parts.stages);
  } else if (std::filesystem::exists(old_file) && !checkpoint_per_rank(optimizer)) {
    load_optimizer(optimizer, old_file);
  } else if (std::filesystem::exists(old_file)) {
    throw UsageError("checkpoint " + dir.string() +
                     " was written before ZeRO could shard a pipeline's optimizer state: resume "
                     "it with --zero-stage 0 --sync ddp (its next checkpoint then loads into ZeRO "
                     "and local SGD)");
  } else {
    throw UsageError("checkpoint " + dir.string() + " holds no optimizer state for " +
                     optimizer_folder(*parts.mesh) + ": it is incomplete; resume from another one");
  }
}

}  // namespace

std::string MeshLayout::flags() const {
  return "--pp " + std::to_string(pp) + " --tp " + std::to_string(tp) +
         (pp > 1 ? " --schedule " + schedule : "");
}

bool MeshLayout::same_cut(const MeshLayout& other) const {
  return mesh && other.mesh && pp == other.pp && tp == other.tp &&
         stages_per_rank(schedule) == stages_per_rank(other.schedule);
}

MeshLayout mesh_layout_of(const std::filesystem::path& checkpoint_dir) {
  const auto file = checkpoint_dir / kMeshFile;
  if (!std::filesystem::exists(file)) return {};
  Json json;
  try {
    json = Json::parse(std::ifstream(file));
  } catch (const Json::exception& e) {
    throw UsageError("checkpoint " + checkpoint_dir.string() + ": " + kMeshFile + " is not JSON (" +
                     e.what() +
                     "): the checkpoint is damaged; resume from "
                     "another one");
  }
  return {.mesh = true,
          .pp = json.value("pp", 0),
          .tp = json.value("tp", 0),
          .schedule = json.value("schedule", std::string("1f1b")),
          .zero_stage = json.value("zero_stage", 0)};
}

void save_mesh_checkpoint(const std::filesystem::path& dir, const MeshCheckpointParts& parts) {
  const auto& mesh = *parts.mesh;
  const auto& optimizer = *parts.optimizer;
  if (mesh.dp_index() != 0 && !checkpoint_per_rank(optimizer)) return;
  std::filesystem::create_directories(dir);
  if (mesh.dp_index() == 0 && mesh.pp_index() == 0) {
    if (parts.copy_to_dense) parts.copy_to_dense();  // collective over tp
    if (mesh.tp_index() == 0) save_model(*parts.whole, dir / "model.safetensors");
  }
  if (const auto* sharded = dynamic_cast<const optim::ShardedState*>(&optimizer);
      sharded != nullptr && sharded->holds_replicas()) {
    // Local SGD's replicas: the stages' global parameters with every rank's own.
    detail::save_model_and_optimizer(dir / optimizer_folder(mesh), *parts.stages, optimizer);
  } else {
    save_optimizer_state(dir / optimizer_folder(mesh), optimizer, *parts.stages);
  }
  if (mesh.dp_index() == 0)
    save_optimizer_part({.dir = dir / optimizer_folder(mesh), .parameters = parts.parameters});
  detail::save_run_state(dir);
  if (first_rank()) {
    const auto& layout = parts.layout;
    write_atomically(dir / kMeshFile, Json{{"pp", layout.pp},
                                           {"tp", layout.tp},
                                           {"schedule", layout.schedule},
                                           {"zero_stage", layout.zero_stage}}
                                              .dump(2) +
                                          "\n");
  }
}

void load_mesh_checkpoint(const Checkpoint& checkpoint, const MeshCheckpointParts& parts) {
  const auto dir = checkpoint.path();
  const MeshLayout written = mesh_layout_of(dir);
  load_model(*parts.whole, dir / "model.safetensors");
  if (parts.load_from_dense) parts.load_from_dense();
  auto& optimizer = *parts.optimizer;
  const auto* sharded = dynamic_cast<const optim::ShardedState*>(&optimizer);
  const bool replicas = sharded != nullptr && sharded->holds_replicas();
  const auto state = dir / optimizer_folder(*parts.mesh);
  if (replicas && written.same_cut(parts.layout) && is_local_sgd_checkpoint(state)) {
    // Its own checkpoint: the stages' global parameters, this rank's own and its inner state.
    load_checkpoint(Checkpoint::from_directory(state), *parts.stages, optimizer);
  } else {
    // The state that the optimizer steps with (local SGD: its inner optimizer's, a new period).
    load_mesh_optimizer_state(dir, written, parts, optimizer);
  }
  // From a group of another dp degree (--workers, or an elastic restart): the lr scaled.
  restore_run_state(checkpoint, optimizer);
}

void check_mesh_checkpoint(const Checkpoint& checkpoint, const parallel::SyncMode& sync) {
  const MeshLayout written = mesh_layout_of(checkpoint.path());
  if (!written.mesh) return;
  const bool server = std::holds_alternative<parallel::AsyncParameterServer>(sync);
  const std::string why =
      server ? "the parameter server does not load a mesh's optimizer state"
      : find_optimizer_parts(checkpoint.path()).empty()
          ? "it was written before a mesh checkpoint named its stages' optimizer state"
          : "";
  if (why.empty()) {
    if (first_rank()) {
      std::cout << "re-cutting the optimizer state of " << checkpoint.path().filename().string()
                << " from " << written.flags() << " to a run without a mesh" << std::endl;
    }
    return;
  }
  throw UsageError(
      "checkpoint " + checkpoint.path().string() + " was written by a mesh run (" +
      written.flags() + "): " + why + "; resume it with " +
      (server ? "--sync ddp, local-sgd:H or diloco:H (with or without " + written.flags() + ")"
              : written.flags()));
}

}  // namespace cohort::train

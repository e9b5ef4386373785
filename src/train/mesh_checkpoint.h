// The checkpoint of a model cut over a dp x pp x tp mesh: the whole (dense) model, every
// (pp, tp) position's optimizer state in a folder of its own (DDP's from dp index 0, every dp
// rank's ZeRO shards, local SGD's own state), the state's parameters named so that another cut
// loads it (OptimizerPart), and mesh.json, the layout that wrote it.
#pragma once
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "cohort/parallel/mesh.h"
#include "cohort/parallel/sync_mode.h"
#include "cohort/train/checkpoint.h"

namespace cohort::train {

// The layout of a checkpoint: a mesh run's degrees and schedule, or none (pp 1, tp 1).
struct MeshLayout {
  bool mesh = false;
  int pp = 1, tp = 1;
  std::string schedule;
  int zero_stage = 0;
  // "--pp 2 --tp 1 --schedule 1f1b": the flags that resume it as written.
  std::string flags() const;
  // Cut as `other` (a mesh too): the same degrees and stages per rank (the schedules may differ
  // otherwise).
  bool same_cut(const MeshLayout& other) const;
};
// The layout a checkpoint's mesh.json holds (mesh false without one).
MeshLayout mesh_layout_of(const std::filesystem::path& checkpoint_dir);

// What a rank of a mesh saves and loads.
struct MeshCheckpointParts {
  const parallel::DeviceMesh* mesh = nullptr;
  MeshLayout layout;
  // The whole model as checkpoints hold it (the dense one with tp > 1), and with tp > 1 the
  // copies between the sliced model and it (collectives over tp).
  torch::nn::Module* whole = nullptr;
  std::function<void()> copy_to_dense;
  std::function<void()> load_from_dense;
  // What the optimizer steps (a pipeline's module of this rank's stages) and its parameters by
  // name, in the optimizer's order.
  torch::nn::Module* stages = nullptr;
  torch::optim::Optimizer* optimizer = nullptr;
  std::vector<OptimizerPart::Parameter> parameters;
};

// Writes this rank's part into `dir` (nothing on a dp rank other than the first with a replicated
// optimizer). The whole model must be current on the ranks of dp index 0 and pp index 0 (after
// the stages were shared).
void save_mesh_checkpoint(const std::filesystem::path& dir, const MeshCheckpointParts& parts);
// Loads the whole model and this rank's optimizer state: from a checkpoint of the same cut
// exactly as written (any dp; into any synchronous engine, or local SGD's own state); from any
// other cut or a run without a mesh, each parameter's state by the model's names, its slices
// gathered and cut anew.
void load_mesh_checkpoint(const Checkpoint& checkpoint, const MeshCheckpointParts& parts);
// For a run without a mesh resuming `checkpoint`: when a mesh run wrote it, a UsageError naming
// the degrees if this run cannot load it (one written before its stages' optimizer state was
// named, or any into the parameter server), else a line on rank 0 saying that it is re-cut.
void check_mesh_checkpoint(const Checkpoint& checkpoint, const parallel::SyncMode& sync);

}  // namespace cohort::train

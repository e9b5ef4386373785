/// \file
/// A mesh of parallel degrees (the idea of torchtitan's ParallelDims): data x pipeline x tensor
/// parallelism over the world's ranks, with a named sub-group per dimension.
#pragma once
#include <string>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "cohort/comm/process_group.h"
#include "cohort/parallel/mesh_shape.h"
#include "cohort/parallel/pipeline/pipeline.h"

namespace cohort::parallel {

/// Ranks are laid out tensor-parallel fastest, then pipeline, then data parallel:
/// rank = (dp_index x pp + pp_index) x tp + tp_index, so that a tensor-parallel group (one
/// all-reduce per layer) holds neighbouring ranks, the same node where it can.
class DeviceMesh {
 public:
  DeviceMesh() = default;
  /// Every rank of `world` calls it with the same shape; it makes the three sub-groups (named
  /// "dp", "pp" and "tp" in the stall inspector's reports).
  static DeviceMesh create(comm::ProcessGroup world, MeshShape shape);

  /// The degrees.
  const MeshShape& shape() const { return shape_; }
  /// The group of every rank of the mesh.
  comm::ProcessGroup world() const { return world_; }
  /// The ranks that hold the same model part and see different data (gradients averaged here).
  comm::ProcessGroup dp() const { return dp_; }
  /// The ranks of one pipeline, by stage: group rank = pipeline stage index.
  comm::ProcessGroup pp() const { return pp_; }
  /// The ranks that share each layer's weights by slices.
  comm::ProcessGroup tp() const { return tp_; }
  /// This rank's data-parallel index.
  int dp_index() const { return dp_index_; }
  /// This rank's pipeline stage index.
  int pp_index() const { return pp_index_; }
  /// This rank's tensor-parallel index.
  int tp_index() const { return tp_index_; }
  /// The world rank at these coordinates.
  int rank_of(int dp_index, int pp_index, int tp_index) const;

 private:
  MeshShape shape_;
  comm::ProcessGroup world_, dp_, pp_, tp_;
  int dp_index_ = 0, pp_index_ = 0, tp_index_ = 0;
};

/// Gradient clipping by the global L2 norm of a model cut over a mesh, before the optimizer
/// steps. `module` is this rank's part (its pipeline stages, e.g. Pipeline::module(), with their
/// tensor-parallel slices) and `optimizer` its data-parallel engine's: a whole optimizer, whose
/// gradients DDP made the same on every dp rank, or a ZeroOptimizer, whose averaged gradients are
/// sharded over dp, or a LocalSgdOptimizer, whose replicas step their own gradients: each replica
/// is clipped by its own norm. Every parameter counts once: slices summed over tp, whole parameters
/// once per tp group, stages over pp, a parameter that stages on several pp ranks share (`tied`,
/// Pipeline::tied_parameters()) once, ZeRO's shards over dp; one all-reduce over the world (local
/// SGD: over pp, then tp), no host sync.
/// The gradients the optimizer steps are scaled by min(1, max_norm / norm); returns the norm before
/// clipping (a 0-dim float32 tensor). Every rank of the mesh calls it; max_norm <= 0 is a
/// UsageError.
at::Tensor clip_grad_norm(const DeviceMesh& mesh, const torch::nn::Module& module,
                          torch::optim::Optimizer& optimizer, double max_norm,
                          const std::vector<pipeline::TiedParameter>& tied = {});

}  // namespace cohort::parallel

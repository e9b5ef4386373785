#include "cohort/parallel/mesh.h"

#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <map>
#include <vector>

#include "cohort/error.h"
#include "cohort/parallel/local_sgd.h"
#include "cohort/parallel/tensor_parallel.h"
#include "cohort/parallel/zero_optimizer.h"

namespace cohort::parallel {

int DeviceMesh::rank_of(int dp_index, int pp_index, int tp_index) const {
  return (dp_index * shape_.pp + pp_index) * shape_.tp + tp_index;
}

DeviceMesh DeviceMesh::create(comm::ProcessGroup world, MeshShape shape) {
  DeviceMesh mesh;
  mesh.shape_ = resolve_mesh(shape, world.world_size());
  const MeshShape& s = mesh.shape_;
  mesh.world_ = world;
  const int rank = world.rank();
  mesh.tp_index_ = rank % s.tp;
  mesh.pp_index_ = rank / s.tp % s.pp;
  mesh.dp_index_ = rank / (s.tp * s.pp);
  std::vector<std::vector<int>> dp_parts, pp_parts, tp_parts;
  for (int p = 0; p < s.pp; ++p) {
    for (int t = 0; t < s.tp; ++t) {
      std::vector<int>& part = dp_parts.emplace_back();
      for (int d = 0; d < s.dp; ++d) part.push_back(mesh.rank_of(d, p, t));
    }
  }
  for (int d = 0; d < s.dp; ++d) {
    for (int t = 0; t < s.tp; ++t) {
      std::vector<int>& part = pp_parts.emplace_back();
      for (int p = 0; p < s.pp; ++p) part.push_back(mesh.rank_of(d, p, t));
    }
    for (int p = 0; p < s.pp; ++p) {
      std::vector<int>& part = tp_parts.emplace_back();
      for (int t = 0; t < s.tp; ++t) part.push_back(mesh.rank_of(d, p, t));
    }
  }
  mesh.dp_ = world.split(dp_parts, "dp");
  mesh.pp_ = world.split(pp_parts, "pp");
  mesh.tp_ = world.split(tp_parts, "tp");
  return mesh;
}

at::Tensor clip_grad_norm(const DeviceMesh& mesh, const torch::nn::Module& module,
                          torch::optim::Optimizer& optimizer, double max_norm,
                          const std::vector<pipeline::TiedParameter>& tied) {
  if (!(max_norm > 0)) {
    throw UsageError("gradient clipping max_norm " + std::to_string(max_norm) +
                     " must be > 0 (0 or less would zero every gradient)");
  }
  torch::NoGradGuard no_grad;
  const auto slices = tensor_parallel_slices(module);
  // A whole parameter's square is on every rank of its tp group: each counts a tp-th of it.
  const double tp = mesh.shape().tp;
  // A tied parameter's square is on each rank that holds a copy: each counts its share.
  std::map<const c10::TensorImpl*, double> copies;
  for (const auto& t : tied)
    copies[t.parameter.unsafeGetTensorImpl()] = static_cast<double>(t.ranks.size());
  auto weight_of = [&](const std::string& name) { return slices.count(name) ? 1.0 : 1.0 / tp; };
  // The gradients the optimizer steps, each with the weight of its parameter.
  std::vector<std::pair<at::Tensor, double>> grads;
  double replicas = 1;  // the dp ranks that hold the same gradients
  auto* zero = dynamic_cast<ZeroOptimizer*>(&optimizer);
  // Local SGD's replicas step their own gradients; DDP made them the same on every dp rank.
  const bool own_gradients = dynamic_cast<LocalSgdOptimizer*>(&optimizer) != nullptr;
  std::vector<at::Tensor> shards;  // ZeRO's gradient shards, one per group
  if (zero != nullptr) {
    std::map<std::string, double> tied_copies;  // by the parameter's name in `module`
    for (const auto& p : module.named_parameters()) {
      const auto found = copies.find(p.value().unsafeGetTensorImpl());
      if (found != copies.end()) tied_copies[p.key()] = found->second;
    }
    shards = zero->flat_gradients();
    for (const auto& piece : zero->shard_pieces()) {
      const auto tied_copies_of = tied_copies.find(piece.parameter);
      const double share = tied_copies_of == tied_copies.end() ? 1.0 : 1.0 / tied_copies_of->second;
      grads.emplace_back(shards.at(piece.group).narrow(0, piece.offset, piece.length),
                         weight_of(piece.parameter) * share);
    }
  } else {
    if (!own_gradients) replicas = mesh.shape().dp;
    for (const auto& p : module.named_parameters()) {
      if (!p.value().grad().defined()) continue;
      const auto tied_copies = copies.find(p.value().unsafeGetTensorImpl());
      const double share = tied_copies == copies.end() ? 1.0 : 1.0 / tied_copies->second;
      grads.emplace_back(p.value().grad(), weight_of(p.key()) * share);
    }
  }
  c10::Device device(c10::kCPU);
  for (const auto& p : module.parameters()) {
    device = p.device();
    break;
  }
  at::Tensor squares = at::zeros({1}, at::TensorOptions(at::kFloat).device(device));
  for (const auto& [grad, weight] : grads)
    squares.add_(grad.to(at::kFloat).pow(2).sum() * (weight / replicas));
  std::vector<at::Tensor> total{squares};
  if (own_gradients) {
    // Summed over the replica's stages and slices only.
    mesh.pp().allreduce(total);
    mesh.tp().allreduce(total);
  } else {
    mesh.world().allreduce(total);
  }
  const at::Tensor norm = total[0].clamp_min(0).sqrt().reshape({});
  const at::Tensor coefficient = (max_norm / (norm + 1e-6)).clamp_max(1.0);
  if (zero != nullptr) {
    for (auto& shard : shards) shard.mul_(coefficient.to(shard.scalar_type()));
  } else {
    for (auto& [grad, weight] : grads) grad.mul_(coefficient.to(grad.scalar_type()));
  }
  return norm;
}

}  // namespace cohort::parallel

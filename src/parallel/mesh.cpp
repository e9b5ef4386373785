#include "cohort/parallel/mesh.h"

#include <vector>

#include "cohort/error.h"

namespace cohort::parallel {

std::string to_string(const MeshShape& shape) {
  return "dp " + std::to_string(shape.dp) + " x pp " + std::to_string(shape.pp) + " x tp " +
         std::to_string(shape.tp);
}

MeshShape resolve_mesh(MeshShape shape, int world_size) {
  if (shape.pp < 1 || shape.tp < 1 || shape.dp < 0) {
    throw UsageError("parallel degrees must be >= 1 (dp may be 0: the rest), got " +
                     to_string(shape));
  }
  const int model = shape.pp * shape.tp;
  if (shape.dp == 0) {
    if (world_size % model != 0) {
      throw UsageError("pp " + std::to_string(shape.pp) + " x tp " + std::to_string(shape.tp) +
                       " = " + std::to_string(model) + " does not divide the " +
                       std::to_string(world_size) +
                       " workers: use a number of workers that is a multiple of " +
                       std::to_string(model) + ", or smaller degrees");
    }
    shape.dp = world_size / model;
  }
  if (shape.dp * model != world_size) {
    throw UsageError("the parallel degrees " + to_string(shape) + " = " +
                     std::to_string(shape.dp * model) + " do not match the " +
                     std::to_string(world_size) + " workers: make them multiply to " +
                     std::to_string(world_size) + " (or leave dp at 0 to take the rest)");
  }
  return shape;
}

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

}  // namespace cohort::parallel

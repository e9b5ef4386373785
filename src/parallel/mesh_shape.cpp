#include "cohort/parallel/mesh_shape.h"

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

}  // namespace cohort::parallel

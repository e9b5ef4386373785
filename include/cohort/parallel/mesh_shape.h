/// \file
/// A mesh's parallel degrees, without libtorch (configs, plans, worker specs and their fuzz
/// targets hold them); mesh.h makes the groups of a mesh.
#pragma once
#include <string>

namespace cohort::parallel {

/// Parallel degrees; they multiply to the world size. dp 0 means "what is left": world / (pp x tp).
struct MeshShape {
  int dp = 0;  ///< data-parallel degree (0: what is left)
  int pp = 1;  ///< pipeline stages
  int tp = 1;  ///< tensor-parallel degree
};
/// "dp 2 x pp 2 x tp 2".
std::string to_string(const MeshShape& shape);
/// The shape with dp resolved for `world_size` ranks. Degrees < 0 (or < 1 for pp and tp), or a
/// product other than the world size, are a UsageError that names the degrees and the fix.
MeshShape resolve_mesh(MeshShape shape, int world_size);

}  // namespace cohort::parallel

#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <variant>

namespace cohort::parallel {

/// How the replicas of a data-parallel model agree.
///
/// Synchronous: DDP, the gradients averaged in every backward.
struct Synchronous {};

/// Local SGD: every rank steps on its own gradients; every `every` optimizer steps the ranks'
/// parameters (and floating-point buffers) are averaged. Engine: LocalSgdOptimizer.
struct LocalSgd {
  int64_t every = 8;  ///< optimizer steps between averages (H)
};

/// DiLoCo (Douillard et al. 2023): `inner_steps` local steps, then the pseudo-gradient (the
/// global parameters minus the local ones) is averaged over the ranks and applied to the global
/// parameters by an outer SGD with (Nesterov) momentum; every rank continues from the result.
/// With inner_steps 1, outer_lr 1 and no momentum it is synchronous DDP (for SGD inner steps).
/// Engine: LocalSgdOptimizer.
struct DiLoCo {
  int64_t inner_steps = 32;     ///< local steps between outer steps (H)
  double outer_lr = 0.7;        ///< the outer SGD's learning rate
  double outer_momentum = 0.9;  ///< the outer SGD's momentum
  bool nesterov = true;         ///< Nesterov momentum for the outer SGD
};

/// An asynchronous parameter server (as TensorFlow's ParameterServerStrategy): `servers`
/// parameter servers hold shards of the parameters and their optimizer state; every worker pushes
/// its gradients and pulls the parameters without waiting for the others, but no worker runs more
/// than `max_staleness` steps ahead of the slowest (stale synchronous parallel: 0 is lock-step).
/// `servers` 0: ScalingConfig::num_parameter_servers (1 when that is 0 too). The servers run in
/// the first `servers` worker processes. Engine: ParameterServerOptimizer.
struct AsyncParameterServer {
  int64_t max_staleness = 4;  ///< steps a worker may run ahead of the slowest
  int servers = 0;            ///< servers (0: ScalingConfig::num_parameter_servers, or 1)
};

/// How the replicas agree: one of the four modes.
using SyncMode = std::variant<Synchronous, LocalSgd, DiLoCo, AsyncParameterServer>;

/// "ddp", "local-sgd:H", "diloco:H" (DiLoCo's outer options at their defaults) or "async-ps:K";
/// anything else, H < 1 or K < 0, is a UsageError naming the value.
SyncMode parse_sync_mode(const std::string& text);
/// The inverse of parse_sync_mode (DiLoCo's outer options and the servers are not in it).
std::string to_string(const SyncMode& mode);
/// UsageError naming the field: H < 1, an outer lr <= 0 or not finite, a momentum outside [0, 1),
/// a staleness bound < 0, servers < 0.
void validate(const SyncMode& mode);
/// Whether `mode` is Synchronous (DDP or ZeRO).
bool is_synchronous(const SyncMode& mode);
/// Why `mode` cannot run with ZeRO stage `zero_stage`, e.g. "diloco:8 cannot be combined with ZeRO
/// stage 2: ZeRO's shards need every replica to step the same gradients"; empty when it can
/// (stage 0, or a synchronous mode). Callers put the name of their option before it and the fix
/// after it.
std::optional<std::string> zero_conflict(const SyncMode& mode, int zero_stage);

}  // namespace cohort::parallel

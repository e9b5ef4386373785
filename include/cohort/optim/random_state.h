#pragma once
#include <optional>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "cohort/optim/state_dict.h"

namespace cohort::optim {

/// The states of the default random number generators that dropout and random initialisation
/// draw from: the CPU's and those of some CUDA devices.
struct GeneratorStates {
  at::Tensor cpu;                                        ///< the CPU generator's state (bytes)
  std::vector<std::pair<c10::Device, at::Tensor>> cuda;  ///< each CUDA device's, by device

  /// The states now (copies), of the CPU's generator and of `cuda_devices`'.
  static GeneratorStates capture(const std::vector<c10::Device>& cuda_devices);
  /// Sets every generator named here to its state here.
  void restore() const;
};

/// The name of the random generators' part in a checkpoint (train::save_state's files).
inline constexpr const char* kRandomStatePart = "rng";

/// A rank's default random number generators as a Stateful part: its piece of tensors "cpu" and,
/// with a CUDA device, "cuda" (the generators' state bytes, one piece per rank of the world), so
/// that a run resumed at the same world size draws what the uninterrupted run would have drawn
/// (dropout's masks, say). A checkpoint of another world size, or of generators of another kind
/// (another libtorch's, a GPU's loaded on a CPU), restores nothing that differs: each rank's
/// generators go on from where they stand, and restored() says so.
class RandomState : public Stateful {
 public:
  /// The generators of rank `rank` of `world_size`: the CPU's, and `cuda_device`'s where given.
  RandomState(int rank, int world_size, std::optional<c10::Device> cuda_device = std::nullopt);
  /// This rank's generator states now, as its piece of each tensor (shard rank of world_size),
  /// with values "world_size", "cpu_bytes" and "cuda_bytes" (0 without a CUDA device).
  StateDict state_dict() const override;
  /// UsageError when `values` are not a RandomState's (a part altered or of another kind).
  void check_state(const Json& values) const override;
  /// This rank's pieces of the generators whose kind matches (the same world size and state
  /// size); none otherwise.
  StateDict state_to_load(const Json& values) const override;
  /// Sets the generators to the pieces of `state` (those state_to_load chose).
  void load_state_dict(const StateDict& state) override;
  /// Whether the last load restored every generator of this rank.
  bool restored() const { return restored_; }

 private:
  int rank_;
  int world_size_;
  std::optional<c10::Device> cuda_device_;
  bool restored_ = false;
};

}  // namespace cohort::optim

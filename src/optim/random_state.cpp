#include "cohort/optim/random_state.h"

#include <ATen/Context.h>

#include <mutex>
#include <string>

#include "cohort/error.h"

namespace cohort::optim {
namespace {

at::Tensor generator_state(const c10::Device& device) {
  at::Generator generator = at::globalContext().defaultGenerator(device);
  std::lock_guard lock(generator.mutex());
  return generator.get_state();
}

void set_generator_state(const c10::Device& device, const at::Tensor& state) {
  at::Generator generator = at::globalContext().defaultGenerator(device);
  std::lock_guard lock(generator.mutex());
  generator.set_state(state);
}

// The values of a RandomState's part, read as written.
struct RandomStateValues {
  int world_size = 0;
  int64_t cpu_bytes = 0, cuda_bytes = 0;
};

RandomStateValues random_state_values(const Json& values) {
  RandomStateValues v;
  try {
    v.world_size = values.at("world_size").get<int>();
    v.cpu_bytes = values.at("cpu_bytes").get<int64_t>();
    v.cuda_bytes = values.at("cuda_bytes").get<int64_t>();
  } catch (const Json::exception& e) {
    throw UsageError(std::string("the random generators' state is malformed (") + e.what() +
                     "): the checkpoint was altered or the part is not a RandomState's");
  }
  if (v.world_size < 1 || v.cpu_bytes < 1 || v.cuda_bytes < 0) {
    throw UsageError("the random generators' state says world size " +
                     std::to_string(v.world_size) + ", " + std::to_string(v.cpu_bytes) +
                     " CPU and " + std::to_string(v.cuda_bytes) +
                     " CUDA bytes per rank: the checkpoint was altered");
  }
  return v;
}

// Rank `rank`'s piece of a tensor of `world_size` pieces like `piece`.
StateTensor piece_of(at::Tensor piece, int rank, int world_size) {
  const int64_t bytes = piece.numel();
  return {.values = std::move(piece), .offset = rank * bytes, .numel = world_size * bytes};
}

}  // namespace

GeneratorStates GeneratorStates::capture(const std::vector<c10::Device>& cuda_devices) {
  GeneratorStates states;
  states.cpu = generator_state(c10::Device(c10::kCPU));
  for (const auto& device : cuda_devices) states.cuda.emplace_back(device, generator_state(device));
  return states;
}

void GeneratorStates::restore() const {
  if (cpu.defined()) set_generator_state(c10::Device(c10::kCPU), cpu);
  for (const auto& [device, state] : cuda) set_generator_state(device, state);
}

RandomState::RandomState(int rank, int world_size, std::optional<c10::Device> cuda_device)
    : rank_(rank), world_size_(world_size), cuda_device_(cuda_device) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    throw UsageError("RandomState: rank " + std::to_string(rank) + " of world size " +
                     std::to_string(world_size) + ": a rank is in [0, world size)");
  }
  if (cuda_device && !cuda_device->is_cuda()) {
    throw UsageError("RandomState: " + cuda_device->str() +
                     " is not a CUDA device: leave it out (the CPU's generator is always kept)");
  }
}

StateDict RandomState::state_dict() const {
  std::vector<c10::Device> devices;
  if (cuda_device_) devices.push_back(*cuda_device_);
  const auto now = GeneratorStates::capture(devices);
  StateDict state;
  state.shard = rank_;
  state.shards = world_size_;
  state.tensors["cpu"] = piece_of(now.cpu.flatten(), rank_, world_size_);
  int64_t cuda_bytes = 0;
  if (!now.cuda.empty()) {
    cuda_bytes = now.cuda.front().second.numel();
    state.tensors["cuda"] = piece_of(now.cuda.front().second.flatten(), rank_, world_size_);
  }
  state.values =
      Json{{"world_size", world_size_}, {"cpu_bytes", now.cpu.numel()}, {"cuda_bytes", cuda_bytes}};
  return state;
}

void RandomState::check_state(const Json& values) const { random_state_values(values); }

StateDict RandomState::state_to_load(const Json& values) const {
  const auto written = random_state_values(values);
  auto state = state_dict();
  state.values = values;
  if (written.world_size != world_size_) {
    state.tensors.clear();
    return state;
  }
  for (auto it = state.tensors.begin(); it != state.tensors.end();) {
    const int64_t bytes = it->first == "cpu" ? written.cpu_bytes : written.cuda_bytes;
    if (it->second.values.numel() == bytes) {
      it->second.values = at::empty_like(it->second.values);
      ++it;
    } else {
      it = state.tensors.erase(it);
    }
  }
  return state;
}

void RandomState::load_state_dict(const StateDict& state) {
  GeneratorStates states;
  if (const auto cpu = state.tensors.find("cpu"); cpu != state.tensors.end())
    states.cpu = cpu->second.values;
  if (const auto cuda = state.tensors.find("cuda"); cuda != state.tensors.end() && cuda_device_)
    states.cuda.emplace_back(*cuda_device_, cuda->second.values);
  states.restore();
  restored_ = states.cpu.defined() && (!cuda_device_ || !states.cuda.empty());
}

}  // namespace cohort::optim

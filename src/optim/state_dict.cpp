#include "cohort/optim/state_dict.h"

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <sstream>
#include <stdexcept>
#include <type_traits>
#include <utility>

#include "cohort/error.h"
#include "cohort/optim/flat_optimizer.h"

namespace cohort::optim {
namespace {

// torch::optim's per-parameter state map is keyed by the parameter's TensorImpl: as a string in
// libtorch 1.13, as the pointer in 2.x.
using StateKey = std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>::key_type;
template <typename Key = StateKey>
Key state_key(const at::Tensor& p) {
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream key;  // as libtorch 1.13 writes it (c10::guts::to_string, gone in 2.x)
    key << p.unsafeGetTensorImpl();
    return key.str();
  } else {
    return p.unsafeGetTensorImpl();
  }
}

using ParameterState = FlatOptimizer::ParameterState;

// Parameter `index` of torch::optim's optimizer of `algorithm`: its steps and state buffers
// (`names`), flattened float32 copies on the CPU; zeros for a parameter never stepped.
ParameterState torch_state_of(const torch::optim::Optimizer& optimizer,
                              const std::string& algorithm, const std::vector<std::string>& names,
                              size_t index) {
  const auto& p = optimizer.param_groups()[0].params()[index];
  ParameterState out;
  const auto found = optimizer.state().find(state_key(p));
  auto flat_copy = [&](const at::Tensor& t) {
    return t.defined() ? t.detach().reshape({-1}).to(at::kCPU, at::kFloat)
                       : at::zeros({p.numel()}, at::kFloat);
  };
  if (found == optimizer.state().end()) {
    for (size_t s = 0; s < names.size(); ++s) out.values.push_back(at::zeros({p.numel()}));
    return out;
  }
  const auto& state = *found->second;
  if (algorithm == "sgd") {
    if (!names.empty())
      out.values.push_back(
          flat_copy(static_cast<const torch::optim::SGDParamState&>(state).momentum_buffer()));
    return out;
  }
  auto adam = [&](const auto& s) {
    out.steps = s.step();
    out.values.push_back(flat_copy(s.exp_avg()));
    out.values.push_back(flat_copy(s.exp_avg_sq()));
    if (names.size() == 3) out.values.push_back(flat_copy(s.max_exp_avg_sq()));
  };
  if (algorithm == "adam") {
    adam(static_cast<const torch::optim::AdamParamState&>(state));
  } else {
    adam(static_cast<const torch::optim::AdamWParamState&>(state));
  }
  return out;
}

void set_torch_state(torch::optim::Optimizer& optimizer, const std::string& algorithm, size_t index,
                     const ParameterState& state) {
  const auto& p = optimizer.param_groups()[0].params()[index];
  auto shaped = [&](size_t s) { return state.values[s].reshape(p.sizes()).to(p.options()); };
  std::unique_ptr<torch::optim::OptimizerParamState> param_state;
  if (algorithm == "sgd") {
    if (state.values.empty()) return;  // no momentum: nothing to keep
    auto sgd = std::make_unique<torch::optim::SGDParamState>();
    sgd->momentum_buffer(shaped(0));
    param_state = std::move(sgd);
  } else {
    auto adam = [&](auto s) {
      s->step(state.steps);
      s->exp_avg(shaped(0));
      s->exp_avg_sq(shaped(1));
      if (state.values.size() == 3) s->max_exp_avg_sq(shaped(2));
      param_state = std::move(s);
    };
    if (algorithm == "adam") {
      adam(std::make_unique<torch::optim::AdamParamState>());
    } else {
      adam(std::make_unique<torch::optim::AdamWParamState>());
    }
  }
  optimizer.state()[state_key(p)] = std::move(param_state);
}

}  // namespace

StateDict ShardedState::replica_state_as(int rank, int world_size) const {
  throw std::logic_error("ShardedState::replica_state_as(" + std::to_string(rank) + ", " +
                         std::to_string(world_size) + "): part '" + part_name() +
                         "' holds no replicas");
}

Json optimizer_state_values(const std::string& algorithm, const std::vector<std::string>& names,
                            int64_t steps, double lr) {
  return Json{{"algorithm", algorithm}, {"state_names", names}, {"steps", steps}, {"lr", lr}};
}

void check_optimizer_state(const Json& values, const std::string& algorithm,
                           const std::vector<std::string>& names) {
  if (values.value("algorithm", "") == algorithm &&
      values.value("state_names", Json::array()) == Json(names)) {
    return;
  }
  throw UsageError("the checkpoint holds " + values.value("algorithm", std::string("?")) +
                   " state (" + values.value("state_names", Json::array()).dump() +
                   "); this optimizer is " + algorithm + " (" + Json(names).dump() +
                   "): resume with the optimizer that wrote it");
}

OptimizerState::OptimizerState(torch::optim::Optimizer& optimizer, std::vector<std::string> names)
    : optimizer_(optimizer),
      names_(std::move(names)),
      algorithm_(algorithm_of(optimizer, "a checkpoint of optimizer state",
                              "it moves state of SGD, Adam or AdamW only")) {
  if (optimizer.param_groups().size() != 1) {
    throw UsageError("a checkpoint of optimizer state: the optimizer has " +
                     std::to_string(optimizer.param_groups().size()) +
                     " param groups; its state moves between optimizers of one");
  }
  if (names_.size() != optimizer.param_groups()[0].params().size()) {
    throw UsageError("OptimizerState: " + std::to_string(names_.size()) + " names for the " +
                     std::to_string(optimizer.param_groups()[0].params().size()) +
                     " parameters of the optimizer");
  }
  state_names_ = state_names_of(algorithm_, optimizer.param_groups()[0].options());
}

StateDict OptimizerState::state_dict() const {
  StateDict out;
  auto* flat = dynamic_cast<FlatOptimizer*>(&optimizer_);
  int64_t steps = 0;
  const auto& params = optimizer_.param_groups()[0].params();
  for (size_t i = 0; i < params.size(); ++i) {
    // A flat optimizer's own buffers, as ZeRO's state_dict gives its shards': a checkpoint writes
    // from them, and a load (state_to_load's) reads into them in place, without a copy of the
    // state that would fault in as much fresh memory.
    auto state = flat != nullptr ? flat->parameter_state_views(0, i)
                                 : torch_state_of(optimizer_, algorithm_, state_names_, i);
    steps = std::max(steps, state.steps);
    for (size_t s = 0; s < state_names_.size(); ++s) {
      const int64_t numel = params[i].numel();
      // State on disk: its pages go back once the checkpoint wrote or read them.
      std::function<void()> release;
      if (flat != nullptr && flat->state_offloaded())
        release = [flat, i, s] { flat->release_parameter_state(0, i, s); };
      out.tensors[names_[i] + "/" + state_names_[s]] = {
          .values = state.values.at(s).reshape({-1}).to(at::kCPU, at::kFloat),
          .offset = 0,
          .numel = numel,
          .release = release};
    }
  }
  out.values = optimizer_state_values(algorithm_, state_names_, steps,
                                      optimizer_.param_groups()[0].options().get_lr());
  return out;
}

void OptimizerState::check_state(const Json& values) const {
  check_optimizer_state(values, algorithm_, state_names_);
}

void OptimizerState::load_state_dict(const StateDict& state) {
  torch::NoGradGuard no_grad;
  check_state(state.values);
  auto* flat = dynamic_cast<FlatOptimizer*>(&optimizer_);
  const int64_t steps = state.values.value("steps", int64_t{0});
  for (size_t i = 0; i < names_.size(); ++i) {
    ParameterState values{.steps = steps, .values = {}};
    for (const auto& s : state_names_) {
      const auto found = state.tensors.find(names_[i] + "/" + s);
      if (found == state.tensors.end()) {
        throw UsageError("the checkpoint holds no " + s + " of parameter '" + names_[i] +
                         "': it was written for another model");
      }
      values.values.push_back(found->second.values);
    }
    if (flat != nullptr) {
      flat->set_parameter_state(0, i, values);
    } else {
      set_torch_state(optimizer_, algorithm_, i, values);
    }
  }
  optimizer_.param_groups()[0].options().set_lr(
      state.values.value("lr", optimizer_.param_groups()[0].options().get_lr()));
}

std::unique_ptr<torch::optim::Optimizer> make_torch_optimizer(
    const std::string& algorithm, std::vector<torch::Tensor> params,
    const torch::optim::OptimizerOptions& options) {
  if (algorithm == "sgd") {
    return std::make_unique<torch::optim::SGD>(
        params, dynamic_cast<const torch::optim::SGDOptions&>(options));
  }
  if (algorithm == "adam") {
    return std::make_unique<torch::optim::Adam>(
        params, dynamic_cast<const torch::optim::AdamOptions&>(options));
  }
  if (algorithm == "adamw") {
    return std::make_unique<torch::optim::AdamW>(
        params, dynamic_cast<const torch::optim::AdamWOptions&>(options));
  }
  throw UsageError("make_torch_optimizer: unknown algorithm '" + algorithm +
                   "': choose sgd, adam or adamw");
}

}  // namespace cohort::optim

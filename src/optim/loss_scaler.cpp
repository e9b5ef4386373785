#include "cohort/optim/loss_scaler.h"

#include <torch/torch.h>

#include "cohort/error.h"
#include "cohort/optim/flat_optimizer.h"

namespace cohort::optim {
LossScaler::LossScaler(LossScalerOptions options, std::optional<comm::ProcessGroup> group,
                       bool enabled)
    : options_(options),
      group_(std::move(group)),
      enabled_(enabled),
      scale_(options.initial_scale),
      hysteresis_left_(options.hysteresis) {
  options_.validate();
}

at::Tensor LossScaler::scale(const at::Tensor& loss) const {
  if (!enabled_) return loss;
  return loss * scale_;
}

bool LossScaler::unscale(torch::optim::Optimizer& optimizer) {
  if (!enabled_ || unscaled_) return found_inf_;
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  if (auto* flat = dynamic_cast<FlatOptimizer*>(&optimizer)) {
    grads = flat->flat_gradients();
  } else {
    for (auto& group : optimizer.param_groups())
      for (auto& p : group.params())
        if (p.grad().defined()) grads.push_back(p.grad());
  }
  const double inverse = 1.0 / scale_;
  // The flags are summed on the first gradient's device: one host round trip per step, not one
  // per gradient.
  at::Tensor non_finite;
  for (auto& g : grads) {
    g.mul_(inverse);
    auto bad = at::isfinite(g).logical_not().any().to(at::kFloat);
    non_finite = non_finite.defined() ? non_finite.add_(bad.to(non_finite.device())) : bad;
  }
  non_finite = non_finite.defined() ? non_finite.reshape({1}).to(at::kCPU) : at::zeros({1});
  if (group_ && group_->world_size() > 1) {
    std::vector<at::Tensor> flags{non_finite};
    group_->allreduce(flags, comm::ReduceOp::kMax);
    non_finite = flags[0];
  }
  found_inf_ = non_finite.item<float>() > 0;
  unscaled_ = true;
  return found_inf_;
}

bool LossScaler::step(torch::optim::Optimizer& optimizer) {
  if (!enabled_) {
    optimizer.step();
    return true;
  }
  unscale(optimizer);
  if (!found_inf_) {
    optimizer.step();
  } else {
    ++skipped_steps_;
    // The skipped step's gradients must not leak into the next one.
    optimizer.zero_grad();
    if (auto* flat = dynamic_cast<FlatOptimizer*>(&optimizer)) flat->skip_step();
  }
  return !found_inf_;
}

void LossScaler::update() {
  if (!enabled_) return;
  if (!unscaled_) return;  // no step since the last update
  if (found_inf_) {
    clean_steps_ = 0;
    if (hysteresis_left_ > 1) {
      --hysteresis_left_;
    } else {
      scale_ = std::max(scale_ * options_.backoff_factor, options_.min_scale);
    }
  } else if (++clean_steps_ >= options_.growth_interval) {
    scale_ *= options_.growth_factor;
    clean_steps_ = 0;
    hysteresis_left_ = options_.hysteresis;
  }
  unscaled_ = false;
  found_inf_ = false;
}

StateDict LossScaler::state_dict() const {
  StateDict state;
  state.values = Json{{"scale", scale_},
                      {"clean_steps", clean_steps_},
                      {"hysteresis_left", hysteresis_left_},
                      {"skipped_steps", skipped_steps_}};
  return state;
}

namespace {

struct ScalerCounters {
  double scale;
  int64_t clean_steps;
  int hysteresis_left;
  int64_t skipped_steps;
};

ScalerCounters counters_of(const Json& values) {
  ScalerCounters c{};
  try {
    c.scale = values.at("scale").get<double>();
    c.clean_steps = values.at("clean_steps").get<int64_t>();
    c.hysteresis_left = values.at("hysteresis_left").get<int>();
    c.skipped_steps = values.at("skipped_steps").get<int64_t>();
  } catch (const Json::exception& e) {
    throw UsageError(std::string("loss scaler state is malformed (") + e.what() +
                     "): the checkpoint was altered or is not a loss scaler's");
  }
  if (!(c.scale > 0)) {
    throw UsageError("loss scaler state has scale " + format_number(c.scale) +
                     ": a scale is > 0; the checkpoint was altered");
  }
  return c;
}

}  // namespace

void LossScaler::check_state(const Json& values) const { counters_of(values); }

void LossScaler::load_state_dict(const StateDict& state) {
  const auto c = counters_of(state.values);
  scale_ = c.scale;
  clean_steps_ = c.clean_steps;
  hysteresis_left_ = c.hysteresis_left;
  skipped_steps_ = c.skipped_steps;
}

}  // namespace cohort::optim

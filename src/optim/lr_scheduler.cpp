#include "cohort/optim/lr_scheduler.h"

#include <algorithm>
#include <cmath>

#include "cohort/error.h"

namespace cohort::optim {

LrScheduler::LrScheduler(torch::optim::Optimizer& optimizer, LrScheduleOptions options,
                         int64_t steps_done)
    : optimizer_(optimizer), options_(std::move(options)), steps_done_(steps_done) {
  options_.validate();
  if (steps_done < 0)
    throw UsageError("LrScheduler steps_done " + std::to_string(steps_done) + " must be >= 0");
  const double now = options_.factor(steps_done_);
  for (auto& group : optimizer_.param_groups()) {
    const double lr = group.options().get_lr();
    if (steps_done_ == 0) {
      base_lrs_.push_back(lr);
      group.options().set_lr(lr * now);
    } else {
      base_lrs_.push_back(now > 0 ? lr / now : lr);
    }
  }
}

void LrScheduler::step() {
  const double previous = options_.factor(steps_done_);
  ++steps_done_;
  const double next = options_.factor(steps_done_);
  auto& groups = optimizer_.param_groups();
  for (size_t g = 0; g < groups.size() && g < base_lrs_.size(); ++g) {
    auto& o = groups[g].options();
    if (previous > 0) base_lrs_[g] = o.get_lr() / previous;
    o.set_lr(base_lrs_[g] * next);
  }
}

std::vector<double> LrScheduler::get_last_lr() const {
  std::vector<double> out;
  for (const auto& group : optimizer_.param_groups()) out.push_back(group.options().get_lr());
  return out;
}

StateDict LrScheduler::state_dict() const {
  StateDict state;
  state.values = Json{{"steps_done", steps_done_}, {"base_lrs", base_lrs_}};
  return state;
}

namespace {

// Whether every group of a schedule's state had the same lr before the factor: an engine's
// groups (ZeRO's buckets) that split one group of the user's, which another split takes whole.
bool one_base_lr(const std::vector<double>& base_lrs) {
  return !base_lrs.empty() && std::all_of(base_lrs.begin(), base_lrs.end(),
                                          [&](double lr) { return lr == base_lrs[0]; });
}

}  // namespace

void LrScheduler::check_state(const Json& values) const {
  int64_t steps = -1;
  std::vector<double> base_lrs;
  try {
    steps = values.at("steps_done").get<int64_t>();
    base_lrs = values.at("base_lrs").get<std::vector<double>>();
  } catch (const Json::exception& e) {
    throw UsageError(std::string("the learning-rate schedule's state is malformed (") + e.what() +
                     "): the checkpoint was altered or the part is not an LrScheduler's");
  }
  if (steps < 0) {
    throw UsageError("the learning-rate schedule's state says " + std::to_string(steps) +
                     " steps done: the checkpoint was altered");
  }
  if (base_lrs.size() != base_lrs_.size() && !one_base_lr(base_lrs)) {
    throw UsageError("the learning-rate schedule's state has " + std::to_string(base_lrs.size()) +
                     " param groups of different learning rates, the optimizer " +
                     std::to_string(base_lrs_.size()) +
                     ": load it into an optimizer of the same param groups");
  }
}

void LrScheduler::load_state_dict(const StateDict& state) {
  check_state(state.values);
  steps_done_ = state.values.at("steps_done").get<int64_t>();
  const auto base_lrs = state.values.at("base_lrs").get<std::vector<double>>();
  // Group by group; one lr for every group where the engine splits the user's group otherwise
  // (ZeRO's buckets at another stage or world size).
  if (base_lrs.size() == base_lrs_.size()) {
    base_lrs_ = base_lrs;
  } else {
    base_lrs_.assign(base_lrs_.size(), base_lrs.front());
  }
}

}  // namespace cohort::optim

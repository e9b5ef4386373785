#include "cohort/optim/lr_scheduler.h"

#include <algorithm>
#include <cmath>

#include "cohort/error.h"

namespace cohort::optim {

void LrScheduleOptions::validate() const {
  if (warmup_steps < 0)
    throw UsageError("lr schedule warmup_steps " + std::to_string(warmup_steps) + " must be >= 0");
  if (warmup_type != "linear" && warmup_type != "log")
    throw UsageError("unknown lr warmup type '" + warmup_type + "': choose linear or log");
  if (!(warmup_start_ratio >= 0 && warmup_start_ratio <= 1))
    throw UsageError("lr schedule warmup_start_ratio " + format_number(warmup_start_ratio) +
                     " must be in [0, 1]");
  if (decay != "none" && decay != "cosine" && decay != "linear" && decay != "step")
    throw UsageError("unknown lr decay '" + decay + "': choose none, cosine, linear or step");
  if ((decay == "cosine" || decay == "linear") && total_steps <= warmup_steps)
    throw UsageError("lr decay " + decay + " needs total_steps (" + std::to_string(total_steps) +
                     ") greater than warmup_steps (" + std::to_string(warmup_steps) + ")");
  if (decay == "step" && step_size < 1)
    throw UsageError("lr decay step needs step_size >= 1, got " + std::to_string(step_size));
  if (decay == "step" && !(gamma > 0 && gamma <= 1))
    throw UsageError("lr decay step gamma " + format_number(gamma) + " must be in (0, 1]");
  if (!(min_lr_ratio >= 0 && min_lr_ratio <= 1))
    throw UsageError("lr schedule min_lr_ratio " + format_number(min_lr_ratio) +
                     " must be in [0, 1]");
}

double LrScheduleOptions::factor(int64_t step) const {
  if (step < warmup_steps) {
    const double way = warmup_type == "log"
                           ? std::log(static_cast<double>(step + 2)) /
                                 std::log(static_cast<double>(warmup_steps + 1))
                           : static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
    return warmup_start_ratio + (1.0 - warmup_start_ratio) * way;
  }
  const double after = static_cast<double>(step - warmup_steps);
  if (decay == "step") return std::pow(gamma, std::floor(after / static_cast<double>(step_size)));
  if (decay == "none") return 1.0;
  const double progress =
      std::clamp(after / static_cast<double>(total_steps - warmup_steps), 0.0, 1.0);
  const double shape = decay == "cosine" ? 0.5 * (1.0 + std::cos(M_PI * progress)) : 1.0 - progress;
  return min_lr_ratio + (1.0 - min_lr_ratio) * shape;
}

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

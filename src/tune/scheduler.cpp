#include "cohort/tune/scheduler.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "cohort/error.h"

namespace cohort::tune {
namespace {

double sign_of(const std::string& mode, const std::string& who) {
  if (mode == "max") return 1;
  if (mode == "min") return -1;
  throw UsageError(who + ": mode '" + mode +
                   "' must be \"max\" or \"min\" (set it, or TuneConfig.mode)");
}

void require_metric(const std::string& metric, const std::string& who) {
  if (metric.empty())
    throw UsageError(who + " needs a metric: set TuneConfig.metric (or the scheduler's own)");
}

// Linear interpolation between the closest ranks, as numpy's percentile.
double percentile(std::vector<double> values, double percent) {
  std::sort(values.begin(), values.end());
  const double rank = percent / 100.0 * static_cast<double>(values.size() - 1);
  const auto low = static_cast<size_t>(std::floor(rank)),
             high = static_cast<size_t>(std::ceil(rank));
  return values[low] + (values[high] - values[low]) * (rank - static_cast<double>(low));
}

double median(std::vector<double> values) { return percentile(std::move(values), 50); }

std::string number(double value) {
  std::ostringstream out;
  out.precision(4);
  out << value;
  return out.str();
}

// The scheduler's view of a result: its progress and its metric, when the result has both.
bool read_result(const Json& result, const std::string& time_attr, const std::string& metric,
                 double& time, double& value) {
  if (!result.contains(time_attr) || !result.contains(metric)) return false;
  if (!result[time_attr].is_number() || !result[metric].is_number()) return false;
  time = result[time_attr].get<double>();
  value = result[metric].get<double>();
  return std::isfinite(value);
}

}  // namespace

ASHAScheduler::ASHAScheduler(ASHAOptions options)
    : options_(std::move(options)), rng_(options_.seed) {
  const auto& o = options_;
  if (!(o.grace_period > 0)) throw UsageError("ASHAScheduler: grace_period must be > 0");
  if (!(o.max_t >= o.grace_period)) {
    throw UsageError("ASHAScheduler: max_t=" + number(o.max_t) +
                     " must be >= grace_period=" + number(o.grace_period));
  }
  if (!(o.reduction_factor > 1)) throw UsageError("ASHAScheduler: reduction_factor must be > 1");
  if (o.brackets < 1) throw UsageError("ASHAScheduler: brackets must be >= 1");
  for (int s = 0; s < o.brackets; ++s) {
    const int rungs = static_cast<int>(
        std::log(o.max_t / o.grace_period) / std::log(o.reduction_factor) - s + 1 + 1e-9);
    std::vector<Rung> bracket;
    for (int k = rungs - 1; k >= 0; --k) {
      bracket.push_back(Rung{o.grace_period * std::pow(o.reduction_factor, k + s), {}});
    }
    brackets_.push_back(std::move(bracket));
  }
}

void ASHAScheduler::set_search_properties(const std::string& metric, const std::string& mode) {
  if (options_.metric.empty()) options_.metric = metric;
  if (options_.mode.empty()) options_.mode = mode;
  require_metric(options_.metric, "ASHAScheduler");
  sign_ = sign_of(options_.mode, "ASHAScheduler");
}

void ASHAScheduler::on_trial_add(const std::string& trial_id) {
  if (bracket_of_.count(trial_id)) return;
  // Brackets with more rungs are likelier (as Ray: weights e^(rungs - most rungs)).
  std::vector<double> weights;
  size_t most = 0;
  for (const auto& b : brackets_) most = std::max(most, b.size());
  for (const auto& b : brackets_)
    weights.push_back(std::exp(static_cast<double>(b.size()) - static_cast<double>(most)));
  double total = 0;
  for (double w : weights) total += w;
  double pick = static_cast<double>(rng_() >> 11) * 0x1.0p-53 * total;
  size_t index = 0;
  while (index + 1 < weights.size() && pick >= weights[index]) pick -= weights[index++];
  bracket_of_[trial_id] = index;
}

std::optional<double> ASHAScheduler::cutoff(const Rung& rung) const {
  if (rung.recorded.empty()) return std::nullopt;
  std::vector<double> values;
  for (const auto& [id, v] : rung.recorded) values.push_back(v);
  return percentile(values, (1 - 1 / options_.reduction_factor) * 100);
}

TrialDecision ASHAScheduler::record(std::vector<Rung>& bracket, const std::string& trial_id,
                                    double progress, double value) {
  for (auto& rung : bracket) {
    if (progress < rung.milestone || rung.recorded.count(trial_id)) continue;
    const auto bar = cutoff(rung);
    const TrialDecision decision =
        bar && value < *bar ? TrialDecision::kStop : TrialDecision::kContinue;
    rung.recorded[trial_id] = value;
    return decision;
  }
  return TrialDecision::kContinue;
}

TrialDecision ASHAScheduler::on_trial_result(const std::string& trial_id, const Json& result) {
  double progress = 0, value = 0;
  if (!read_result(result, options_.time_attr, options_.metric, progress, value))
    return TrialDecision::kContinue;
  on_trial_add(trial_id);
  if (progress >= options_.max_t) return TrialDecision::kFinish;
  const TrialDecision decision =
      record(brackets_[bracket_of_[trial_id]], trial_id, progress, sign_ * value);
  if (decision == TrialDecision::kStop) ++num_stopped_;
  return decision;
}

void ASHAScheduler::on_trial_complete(const std::string& trial_id, const Json& last_result) {
  double progress = 0, value = 0;
  if (!read_result(last_result, options_.time_attr, options_.metric, progress, value)) return;
  on_trial_add(trial_id);
  record(brackets_[bracket_of_[trial_id]], trial_id, progress, sign_ * value);
}

std::string ASHAScheduler::describe() const {
  std::string out = "AsyncHyperBand: num_stopped=" + std::to_string(num_stopped_);
  for (const auto& bracket : brackets_) {
    out += "\n  Bracket:";
    for (size_t r = 0; r < bracket.size(); ++r) {
      const auto bar = cutoff(bracket[r]);
      out += std::string(r ? " |" : "") + " Iter " + number(bracket[r].milestone) + ": " +
             (bar ? number(sign_ * *bar) : "None");
    }
  }
  return out;
}

Json ASHAScheduler::to_json() const {
  return Json{{"type", "asha"},
              {"time_attr", options_.time_attr},
              {"metric", options_.metric},
              {"mode", options_.mode},
              {"max_t", options_.max_t},
              {"grace_period", options_.grace_period},
              {"reduction_factor", options_.reduction_factor},
              {"brackets", options_.brackets},
              {"seed", options_.seed}};
}

MedianStoppingRule::MedianStoppingRule(MedianStoppingOptions options)
    : options_(std::move(options)) {
  if (options_.grace_period < 0) throw UsageError("MedianStoppingRule: grace_period must be >= 0");
  if (options_.min_samples_required < 1)
    throw UsageError("MedianStoppingRule: min_samples_required must be >= 1");
}

void MedianStoppingRule::set_search_properties(const std::string& metric, const std::string& mode) {
  if (options_.metric.empty()) options_.metric = metric;
  if (options_.mode.empty()) options_.mode = mode;
  require_metric(options_.metric, "MedianStoppingRule");
  sign_ = sign_of(options_.mode, "MedianStoppingRule");
}

TrialDecision MedianStoppingRule::on_trial_result(const std::string& trial_id, const Json& result) {
  double time = 0, value = 0;
  if (!read_result(result, options_.time_attr, options_.metric, time, value))
    return TrialDecision::kContinue;
  auto& own = results_[trial_id];
  own.push_back({time, sign_ * value});
  if (time < options_.grace_period) return TrialDecision::kContinue;
  // The running means, up to this time, of the other trials that got at least this far.
  std::vector<double> means;
  for (const auto& [id, points] : results_) {
    if (id == trial_id || points.empty() || points.back().time < time) continue;
    double sum = 0;
    int count = 0;
    for (const auto& p : points) {
      if (p.time > time) break;
      sum += p.value;
      ++count;
    }
    if (count > 0) means.push_back(sum / count);
  }
  if (static_cast<int>(means.size()) < options_.min_samples_required)
    return TrialDecision::kContinue;
  double best = own.front().value;
  for (const auto& p : own) best = std::max(best, p.value);
  if (best < median(means)) {
    ++num_stopped_;
    return TrialDecision::kStop;
  }
  return TrialDecision::kContinue;
}

void MedianStoppingRule::on_trial_complete(const std::string& trial_id, const Json& last_result) {
  double time = 0, value = 0;
  if (!read_result(last_result, options_.time_attr, options_.metric, time, value)) return;
  auto& own = results_[trial_id];
  if (own.empty() || own.back().time != time) own.push_back({time, sign_ * value});
}

std::string MedianStoppingRule::describe() const {
  return "MedianStoppingRule: num_stopped=" + std::to_string(num_stopped_);
}

Json MedianStoppingRule::to_json() const {
  return Json{{"type", "median"},
              {"time_attr", options_.time_attr},
              {"metric", options_.metric},
              {"mode", options_.mode},
              {"grace_period", options_.grace_period},
              {"min_samples_required", options_.min_samples_required}};
}

std::shared_ptr<TrialScheduler> scheduler_from_json(const Json& d) {
  const std::string type = d.is_object() ? d.value("type", std::string{}) : std::string{};
  if (type == "fifo") return std::make_shared<FIFOScheduler>();
  if (type == "asha") {
    return std::make_shared<ASHAScheduler>(
        ASHAOptions{.time_attr = d.value("time_attr", "training_iteration"),
                    .metric = d.value("metric", ""),
                    .mode = d.value("mode", ""),
                    .max_t = d.value("max_t", 100.0),
                    .grace_period = d.value("grace_period", 1.0),
                    .reduction_factor = d.value("reduction_factor", 4.0),
                    .brackets = d.value("brackets", 1),
                    .seed = d.value("seed", uint64_t{0})});
  }
  if (type == "median") {
    return std::make_shared<MedianStoppingRule>(
        MedianStoppingOptions{.time_attr = d.value("time_attr", "training_iteration"),
                              .metric = d.value("metric", ""),
                              .mode = d.value("mode", ""),
                              .grace_period = d.value("grace_period", 1.0),
                              .min_samples_required = d.value("min_samples_required", 3)});
  }
  throw UsageError("unknown scheduler " + d.dump() +
                   ": cohort rebuilds fifo, asha and median; pass a custom "
                   "scheduler again in TuneConfig.scheduler");
}

}  // namespace cohort::tune

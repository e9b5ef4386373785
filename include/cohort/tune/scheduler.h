/// \file
/// Trial schedulers (Ray Tune's FIFOScheduler, ASHAScheduler, MedianStoppingRule): after each
/// result of a trial they decide whether it goes on or is stopped early.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "cohort/json.h"

namespace cohort::tune {

/// What a scheduler decides after a trial's result.
enum class TrialDecision {
  kContinue,
  /// Stopped early: not promising enough to go on.
  kStop,
  /// Stopped because it has run as long as the scheduler allows (ASHA's max_t): not early.
  kFinish,
};

/// Decides, after each result, whether a trial goes on (Ray Tune's TrialScheduler). Its state is
/// JSON, so an experiment resumes with it.
class TrialScheduler {
 public:
  virtual ~TrialScheduler() = default;
  /// The Tuner's metric and mode ("max" or "min"), for schedulers whose own are unset.
  virtual void set_search_properties(const std::string& metric, const std::string& mode) {}
  /// A trial starts.
  virtual void on_trial_add(const std::string& trial_id) {}
  /// Each result as the trial reports it: its metrics plus "training_iteration" and
  /// "time_total_s".
  virtual TrialDecision on_trial_result(const std::string& trial_id, const Json& result) = 0;
  /// The trial finished on its own (not stopped by this scheduler), with its last result.
  virtual void on_trial_complete(const std::string& trial_id, const Json& last_result) {}
  /// The trial errored, or was stopped.
  virtual void on_trial_remove(const std::string& trial_id) {}
  /// One line for the status table ("AsyncHyperBand: num_stopped=3 | Iter 4: 0.81 | ...").
  virtual std::string describe() const = 0;
  /// The scheduler and its options, kept in the experiment state so that Tuner::restore can
  /// rebuild it (scheduler_from_json); null for one it cannot rebuild.
  virtual Json to_json() const { return nullptr; }
};

/// Runs every trial to its end (the default).
class FIFOScheduler : public TrialScheduler {
 public:
  TrialDecision on_trial_result(const std::string&, const Json&) override {
    return TrialDecision::kContinue;
  }
  std::string describe() const override { return "FIFOScheduler"; }
  Json to_json() const override { return Json{{"type", "fifo"}}; }
};

/// How ASHAScheduler stops trials: the time attribute, metric, max_t, grace period, reduction
/// factor, brackets and seed.
struct ASHAOptions {
  /// The result field that measures progress: "training_iteration" (reports so far) or
  /// "time_total_s".
  std::string time_attr = "training_iteration";
  /// Empty: the Tuner's metric and mode.
  std::string metric;
  std::string mode;  ///< "max" or "min"; empty: the Tuner's
  /// A trial is stopped once time_attr reaches max_t.
  double max_t = 100;
  /// No trial is stopped before time_attr reaches this.
  double grace_period = 1;
  /// Rungs at grace_period * reduction_factor^k; at each only the top 1/reduction_factor go on.
  double reduction_factor = 4;
  /// Brackets of rungs (Hyperband's s), each trial in one chosen at random (seeded).
  int brackets = 1;
  uint64_t seed = 0;  ///< draws each trial's bracket
};

/// Asynchronous successive halving (Li et al. 2018; Ray Tune's ASHAScheduler). When a trial
/// reaches a rung, it is stopped unless its metric is within the top 1/reduction_factor of the
/// values that trials reached the same rung with before it; the first to reach a rung goes on.
class ASHAScheduler : public TrialScheduler {
 public:
  /// ASHA with `options`.
  explicit ASHAScheduler(ASHAOptions options = {});
  void set_search_properties(const std::string& metric, const std::string& mode) override;
  /// Places the trial in a bracket (drawn with the seed).
  void on_trial_add(const std::string& trial_id) override;
  TrialDecision on_trial_result(const std::string& trial_id, const Json& result) override;
  void on_trial_complete(const std::string& trial_id, const Json& last_result) override;
  std::string describe() const override;
  Json to_json() const override;

  /// The rung milestones of bracket b, highest first, each with the values recorded there (the
  /// metric, sign-flipped to "higher is better").
  struct Rung {
    double milestone = 0;                    ///< the time attribute's value at this rung
    std::map<std::string, double> recorded;  ///< trial id to its metric there (higher is better)
  };
  /// Each bracket's rungs, highest first.
  const std::vector<std::vector<Rung>>& brackets() const { return brackets_; }
  /// Trials stopped early so far.
  int num_stopped() const { return num_stopped_; }

 private:
  /// The value a trial must reach at this rung to go on: the (1 - 1/reduction_factor) percentile
  /// of those recorded there; none while the rung is empty.
  std::optional<double> cutoff(const Rung& rung) const;
  TrialDecision record(std::vector<Rung>& bracket, const std::string& trial_id, double progress,
                       double value);
  ASHAOptions options_;
  double sign_ = 1;  ///< +1 for max, -1 for min
  std::vector<std::vector<Rung>> brackets_;
  std::map<std::string, size_t> bracket_of_;
  std::mt19937_64 rng_;
  int num_stopped_ = 0;
};

/// How MedianStoppingRule stops trials.
struct MedianStoppingOptions {
  std::string time_attr = "training_iteration";  ///< the result field that measures progress
  std::string metric;                            ///< empty: the Tuner's metric
  std::string mode;                              ///< "max" or "min"; empty: the Tuner's
  /// No trial is stopped before time_attr reaches this.
  double grace_period = 1;
  /// Other trials that must have reached the same time before any comparison is made.
  int min_samples_required = 3;
};

/// Median stopping (Golovin et al. 2017; Ray Tune's MedianStoppingRule): a trial is stopped when
/// its best result so far is worse than the median of the other trials' running means up to the
/// same time.
class MedianStoppingRule : public TrialScheduler {
 public:
  /// The median stopping rule with `options`.
  explicit MedianStoppingRule(MedianStoppingOptions options = {});
  void set_search_properties(const std::string& metric, const std::string& mode) override;
  TrialDecision on_trial_result(const std::string& trial_id, const Json& result) override;
  void on_trial_complete(const std::string& trial_id, const Json& last_result) override;
  std::string describe() const override;
  Json to_json() const override;

 private:
  struct Point {
    double time = 0;
    double value = 0;  ///< sign-flipped to "higher is better"
  };
  MedianStoppingOptions options_;
  double sign_ = 1;
  std::map<std::string, std::vector<Point>> results_;
  int num_stopped_ = 0;
};

/// Rebuilds a scheduler from TrialScheduler::to_json(); throws UsageError for an unknown one.
std::shared_ptr<TrialScheduler> scheduler_from_json(const Json& description);

}  // namespace cohort::tune

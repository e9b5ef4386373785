#include "cohort/tune/scheduler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>

#include "cohort/error.h"
#include "support/expect.h"

namespace cohort::tune {
namespace {

using cohort::testing::expect_error;
constexpr auto kGo = TrialDecision::kContinue;
constexpr auto kStop = TrialDecision::kStop;

Json result(int iteration, double score) {
  return Json{{"training_iteration", iteration}, {"score", score}};
}

TEST(ASHAScheduler, RungsFollowGracePeriodAndReductionFactor) {
  ASHAScheduler asha({.max_t = 16, .grace_period = 1, .reduction_factor = 2});
  std::vector<double> milestones;
  for (const auto& rung : asha.brackets()[0]) milestones.push_back(rung.milestone);
  EXPECT_EQ(milestones, (std::vector<double>{16, 8, 4, 2, 1}));
  ASHAScheduler wide({.max_t = 100, .grace_period = 1, .reduction_factor = 4, .brackets = 2});
  ASSERT_EQ(wide.brackets().size(), 2u);
  EXPECT_EQ(wide.brackets()[0].front().milestone, 64);
  EXPECT_EQ(wide.brackets()[1].back().milestone, 4);  // bracket s starts at grace * rf^s
}

TEST(ASHAScheduler, KeepsTheTopFractionAtEachRungAndStopsTheRest) {
  ASHAScheduler asha(
      {.metric = "score", .mode = "max", .max_t = 8, .grace_period = 1, .reduction_factor = 2});
  asha.set_search_properties("", "");
  // Rung 1: the first to arrive always goes on; later ones must reach the median so far.
  EXPECT_EQ(asha.on_trial_result("a", result(1, 0.9)), kGo);
  EXPECT_EQ(asha.on_trial_result("b", result(1, 0.1)), kStop);  // below 0.9
  EXPECT_EQ(asha.on_trial_result("c", result(1, 0.5)), kGo);    // median of {0.9, 0.1} is 0.5
  EXPECT_EQ(asha.on_trial_result("d", result(1, 0.95)), kGo);
  // Rung 2.
  EXPECT_EQ(asha.on_trial_result("a", result(2, 0.9)), kGo);
  EXPECT_EQ(asha.on_trial_result("c", result(2, 0.5)), kStop);  // below 0.9
  EXPECT_EQ(asha.on_trial_result("d", result(2, 0.95)), kGo);   // median of {0.9, 0.5} is 0.7
  // Between rungs nothing is decided; at max_t every trial stops.
  EXPECT_EQ(asha.on_trial_result("d", result(3, 0.01)), kGo);
  EXPECT_EQ(asha.on_trial_result("d", result(8, 0.99)), TrialDecision::kFinish);
  EXPECT_EQ(asha.num_stopped(), 2);
  EXPECT_NE(asha.describe().find("num_stopped=2"), std::string::npos) << asha.describe();
  EXPECT_NE(asha.describe().find("Iter 2: 0.9 | Iter 1: 0.7"), std::string::npos)
      << asha.describe();
}

TEST(ASHAScheduler, MinModeStopsTheHigherValues) {
  ASHAScheduler asha({.max_t = 8, .grace_period = 1, .reduction_factor = 2});
  asha.set_search_properties("loss", "min");
  EXPECT_EQ(asha.on_trial_result("a", Json{{"training_iteration", 1}, {"loss", 0.3}}), kGo);
  EXPECT_EQ(asha.on_trial_result("b", Json{{"training_iteration", 1}, {"loss", 0.8}}), kStop);
  EXPECT_EQ(asha.on_trial_result("c", Json{{"training_iteration", 1}, {"loss", 0.1}}), kGo);
  // Results without the metric are no evidence either way.
  EXPECT_EQ(asha.on_trial_result("d", Json{{"training_iteration", 1}}), kGo);
}

// Trials with a known ranking (quality q gives score q * t at iteration t), stepped in turns as
// concurrent trials would report: ASHA must keep the best to max_t and spend far fewer
// iterations than running everything to the end.
TEST(ASHAScheduler, OnAKnownRankingTheBestSurvivesAtAFractionOfTheCost) {
  constexpr int kTrials = 16, kMaxT = 16;
  std::vector<double> quality(kTrials);
  for (int i = 0; i < kTrials; ++i)
    quality[static_cast<size_t>(i)] = (i * 7 % kTrials) / double(kTrials);
  const int best =
      static_cast<int>(std::max_element(quality.begin(), quality.end()) - quality.begin());
  ASHAScheduler asha({.max_t = kMaxT, .grace_period = 1, .reduction_factor = 4});
  asha.set_search_properties("score", "max");
  std::vector<int> iterations(kTrials, 0);
  std::vector<bool> running(kTrials, true);
  int total = 0;
  for (int t = 1; t <= kMaxT; ++t) {
    for (int i = 0; i < kTrials; ++i) {
      if (!running[static_cast<size_t>(i)]) continue;
      iterations[static_cast<size_t>(i)] = t;
      ++total;
      const auto id = "t" + std::to_string(i);
      if (asha.on_trial_result(id, result(t, quality[static_cast<size_t>(i)] * t)) != kGo) {
        running[static_cast<size_t>(i)] = false;
      }
    }
  }
  EXPECT_EQ(iterations[static_cast<size_t>(best)], kMaxT);
  EXPECT_LE(total * 2, kTrials * kMaxT)
      << "ASHA used " << total << " of " << kTrials * kMaxT << " iterations";
  // The first to reach a rung always goes on (the price of being asynchronous), yet those that ran
  // to the end are better on average than those stopped at the first rung.
  double finished = 0, stopped = 0;
  int n_finished = 0, n_stopped = 0;
  for (int i = 0; i < kTrials; ++i) {
    const double q = quality[static_cast<size_t>(i)];
    if (iterations[static_cast<size_t>(i)] == kMaxT) finished += q, ++n_finished;
    if (iterations[static_cast<size_t>(i)] == 1) stopped += q, ++n_stopped;
  }
  ASSERT_GT(n_stopped, 0);
  EXPECT_GT(finished / n_finished, stopped / n_stopped + 0.1);
}

TEST(MedianStoppingRule, StopsATrialWorseThanTheMedianOfTheOthers) {
  MedianStoppingRule rule({.grace_period = 2, .min_samples_required = 3});
  rule.set_search_properties("score", "max");
  for (const auto& [id, score] :
       std::vector<std::pair<std::string, double>>{{"a", 0.8}, {"b", 0.6}, {"c", 0.7}}) {
    EXPECT_EQ(rule.on_trial_result(id, result(1, score)), kGo);
    EXPECT_EQ(rule.on_trial_result(id, result(2, score)), kGo);
  }
  // Within the grace period nobody is stopped; after it, below the median (0.7) is.
  EXPECT_EQ(rule.on_trial_result("d", result(1, 0.1)), kGo);
  EXPECT_EQ(rule.on_trial_result("d", result(2, 0.1)), kStop);
  EXPECT_EQ(rule.on_trial_result("e", result(1, 0.75)), kGo);
  EXPECT_EQ(rule.on_trial_result("e", result(2, 0.75)), kGo);
  // Too few others got as far: no comparison yet.
  EXPECT_EQ(rule.on_trial_result("a", result(3, 0.0)), kGo);
  EXPECT_EQ(rule.describe(), "MedianStoppingRule: num_stopped=1");
}

TEST(Schedulers, TheyAreRebuiltFromTheirSavedForm) {
  ASHAScheduler asha(
      {.metric = "acc", .mode = "max", .max_t = 9, .grace_period = 3, .reduction_factor = 3});
  auto rebuilt = scheduler_from_json(asha.to_json());
  EXPECT_EQ(rebuilt->to_json(), asha.to_json());
  EXPECT_EQ(scheduler_from_json(FIFOScheduler().to_json())->describe(), "FIFOScheduler");
  MedianStoppingRule median({.metric = "loss", .mode = "min", .grace_period = 5});
  EXPECT_EQ(scheduler_from_json(median.to_json())->to_json(), median.to_json());
  expect_error<UsageError>([] { scheduler_from_json(Json{{"type", "pbt"}}); }, "unknown scheduler");
}

TEST(Schedulers, BadOptionsAreNamed) {
  expect_error<UsageError>([] { ASHAScheduler({.max_t = 1, .grace_period = 4}); },
                           "max_t=1 must be >= grace_period=4");
  expect_error<UsageError>([] { ASHAScheduler({.reduction_factor = 1}); },
                           "reduction_factor must be > 1");
  expect_error<UsageError>([] { ASHAScheduler().set_search_properties("", "max"); },
                           "needs a metric");
  expect_error<UsageError>([] { ASHAScheduler().set_search_properties("acc", "best"); },
                           "mode 'best'");
}

}  // namespace
}  // namespace cohort::tune

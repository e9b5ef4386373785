#include "cohort/tune/search_space.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <set>

#include "cohort/error.h"
#include "support/expect.h"

namespace cohort::tune {
namespace {

using cohort::testing::expect_error;

std::vector<Json> draw(const Json& domain, int n, uint64_t seed = 1) {
  std::mt19937_64 rng(seed);
  std::vector<Json> values;
  for (int i = 0; i < n; ++i) values.push_back(sample_domain(domain, rng));
  return values;
}

std::vector<Json> all_trials(const Json& space, int num_samples, uint64_t seed) {
  BasicVariantGenerator generator(seed, num_samples);
  generator.set_search_properties("", "", space);
  std::vector<Json> trials;
  while (auto config = generator.suggest(std::to_string(trials.size()))) trials.push_back(*config);
  return trials;
}

TEST(SearchSpace, UniformStaysInItsBoundsAndSpreadsEvenly) {
  const auto values = draw(uniform(-2, 6), 4000);
  double sum = 0;
  int low_half = 0;
  for (const auto& v : values) {
    const double x = v.get<double>();
    ASSERT_GE(x, -2);
    ASSERT_LT(x, 6);
    sum += x;
    low_half += x < 2;
  }
  EXPECT_NEAR(sum / 4000, 2.0, 0.15);
  EXPECT_NEAR(low_half / 4000.0, 0.5, 0.04);
}

TEST(SearchSpace, LoguniformIsUniformInTheLogarithm) {
  const auto values = draw(loguniform(1e-4, 1e-1), 6000);
  int per_decade[3] = {0, 0, 0};
  for (const auto& v : values) {
    const double x = v.get<double>();
    ASSERT_GE(x, 1e-4);
    ASSERT_LE(x, 1e-1);
    ++per_decade[std::min(2, static_cast<int>(std::floor(std::log10(x) + 4)))];
  }
  // Each decade a third, where a uniform draw would put 90% in the last one.
  for (int count : per_decade) EXPECT_NEAR(count / 6000.0, 1.0 / 3, 0.03);
}

TEST(SearchSpace, QuantizedDomainsGiveMultiplesOfQWithinTheBounds) {
  std::set<double> seen;
  for (const auto& v : draw(quniform(0.2, 1.0, 0.2), 2000)) {
    const double x = v.get<double>();
    EXPECT_NEAR(std::round(x / 0.2) * 0.2, x, 1e-9) << x;
    EXPECT_GE(x, 0.2 - 1e-9);
    EXPECT_LE(x, 1.0 + 1e-9);
    seen.insert(std::round(x * 10) / 10);
  }
  EXPECT_EQ(seen, (std::set<double>{0.2, 0.4, 0.6, 0.8, 1.0}));
  std::set<int64_t> ints;
  for (const auto& v : draw(qrandint(0, 20, 5), 2000)) {
    ASSERT_TRUE(v.is_number_integer()) << v;
    ints.insert(v.get<int64_t>());
  }
  // qrandint includes its upper bound, as Ray's does.
  EXPECT_EQ(ints, (std::set<int64_t>{0, 5, 10, 15, 20}));
  for (const auto& v : draw(qloguniform(1, 1000, 10), 500)) {
    EXPECT_NEAR(std::fmod(v.get<double>(), 10.0), 0.0, 1e-9);
    EXPECT_GE(v.get<double>(), 10);
  }
}

TEST(SearchSpace, RandintExcludesItsUpperBoundAndChoiceCoversEveryCategory) {
  std::map<int64_t, int> counts;
  for (const auto& v : draw(randint(3, 7), 4000)) ++counts[v.get<int64_t>()];
  ASSERT_EQ(counts.size(), 4u);
  EXPECT_EQ(counts.begin()->first, 3);
  EXPECT_EQ(counts.rbegin()->first, 6);
  for (const auto& [value, count] : counts) EXPECT_NEAR(count / 4000.0, 0.25, 0.03) << value;
  std::map<std::string, int> picks;
  for (const auto& v : draw(choice({"sgd", "adam", "rmsprop"}), 3000))
    ++picks[v.get<std::string>()];
  ASSERT_EQ(picks.size(), 3u);
  for (const auto& [name, count] : picks) EXPECT_NEAR(count / 3000.0, 1.0 / 3, 0.04) << name;
}

TEST(SearchSpace, TheSameSeedGivesTheSameTrials) {
  const Json space{{"lr", loguniform(1e-4, 1e-1)},
                   {"batch_size", choice({32, 64, 128})},
                   {"optim", {{"momentum", uniform(0.5, 0.99)}, {"nesterov", true}}}};
  const auto first = all_trials(space, 6, 42);
  EXPECT_EQ(first, all_trials(space, 6, 42));
  EXPECT_NE(first, all_trials(space, 6, 43));
  ASSERT_EQ(first.size(), 6u);
  for (const auto& trial : first) {
    // Nested domains are resolved and constants copied.
    EXPECT_TRUE(trial["optim"]["nesterov"].get<bool>());
    EXPECT_TRUE(trial["optim"]["momentum"].is_number_float());
    EXPECT_TRUE(trial["batch_size"].is_number_integer());
  }
}

TEST(SearchSpace, GridsAreCrossedAndRepeatedPerSample) {
  const Json space{{"optimizer", grid_search({"sgd", "adam", "rmsprop"})},
                   {"layers", grid_search({1, 2})},
                   {"lr", uniform(0, 1)}};
  const auto trials = all_trials(space, 2, 7);
  ASSERT_EQ(trials.size(), 12u);
  std::map<std::pair<std::string, int>, int> combinations;
  std::set<double> lrs;
  for (const auto& t : trials) {
    ++combinations[{t["optimizer"].get<std::string>(), t["layers"].get<int>()}];
    lrs.insert(t["lr"].get<double>());
  }
  EXPECT_EQ(combinations.size(), 6u);
  for (const auto& [combination, count] : combinations) EXPECT_EQ(count, 2);
  EXPECT_EQ(lrs.size(), 12u);  // random domains are drawn afresh for every trial
  // The last grid varies fastest, the whole grid once per sample.
  EXPECT_EQ(trials[0]["optimizer"], "sgd");
  EXPECT_EQ(trials[0]["layers"], 1);
  EXPECT_EQ(trials[1]["layers"], 2);
  EXPECT_EQ(trials[2]["optimizer"], "adam");
  EXPECT_EQ(trials[6]["optimizer"], "sgd");
  BasicVariantGenerator generator(0, 2);
  generator.set_search_properties("", "", space);
  EXPECT_EQ(generator.total_trials(), 12);
}

TEST(SearchSpace, BadDomainsAreNamedByTheirPath) {
  auto check = [](const Json& space, const std::string& fragment) {
    expect_error<UsageError>([&] { validate_param_space(space); }, fragment);
  };
  check(Json{{"lr", loguniform(0, 0.1)}}, "param_space/lr: loguniform needs 0 < lower");
  check(Json{{"n", randint(5, 5)}}, "param_space/n: randint needs lower < upper");
  check(Json{{"opt", {{"kind", choice(Json::array())}}}},
        "param_space/opt/kind: choice needs at least one value");
  check(Json{{"x", quniform(0, 1, 0)}}, "param_space/x: quniform needs a quantum q > 0");
  check(Json{{"x", Json{{"uniform", {0, "one"}}}}}, "uniform bound \"one\" is not a number");
  check(Json{{"x", choice({grid_search({1, 2})})}}, "cannot stand inside a choice");
  check(Json{{"n", Json{{"randint", {0.5, 3}}}}}, "randint takes integers");
  expect_error<UsageError>([] { validate_param_space(Json::array()); },
                           "param_space must be a JSON object");
}

TEST(SearchSpace, TheCommandLineFormParsesEveryDomain) {
  EXPECT_EQ(parse_domain("loguniform:1e-4:1e-1"), loguniform(1e-4, 1e-1));
  EXPECT_EQ(parse_domain("uniform:0:1"), uniform(0, 1));
  EXPECT_EQ(parse_domain("quniform:0:1:0.25"), quniform(0, 1, 0.25));
  EXPECT_EQ(parse_domain("randint:1:10"), randint(1, 10));
  EXPECT_EQ(parse_domain("choice:32,64,128"), choice({32, 64, 128}));
  EXPECT_EQ(parse_domain("choice:sgd,adam"), choice({"sgd", "adam"}));
  EXPECT_EQ(parse_domain("grid:0.1,0.01"), grid_search({0.1, 0.01}));
  EXPECT_EQ(parse_domain("0.5"), Json(0.5));
  EXPECT_EQ(parse_domain("adam"), Json("adam"));
  expect_error<UsageError>([] { parse_domain("loguniform:small:1"); },
                           "bound 'small' is not a number");
  expect_error<UsageError>([] { parse_domain("loguniform:0:1"); }, "loguniform needs 0 < lower");
  expect_error<UsageError>([] { parse_domain("uniform:1"); }, "uniform takes [lower, upper]");
  EXPECT_EQ(searched_parameters(Json{{"a", 1},
                                     {"lr", parse_domain("uniform:0:1")},
                                     {"optim", {{"m", parse_domain("choice:0.5,0.9")}}}}),
            (std::vector<std::string>{"lr", "optim/m"}));
}

}  // namespace
}  // namespace cohort::tune

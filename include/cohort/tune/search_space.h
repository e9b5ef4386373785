/// \file
/// Search spaces (Ray Tune's tune.grid_search, tune.choice, tune.uniform, ...) and the searchers
/// that turn a param space into trial configurations.
#pragma once
#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "cohort/json.h"

namespace cohort::tune {

/// A search domain is a JSON object with exactly one of these keys, so a param space is plain
/// JSON, nests freely and can live in a file:
///   {"grid_search": [v1, v2, ...]}   every value, crossed with the other grids
///   {"choice": [v1, v2, ...]}        one value, uniformly
///   {"uniform": [lower, upper]}      a float in [lower, upper)
///   {"quniform": [lower, upper, q]}  uniform, rounded to a multiple of q, within [lower, upper]
///   {"loguniform": [lower, upper]}   a float whose logarithm is uniform; 0 < lower < upper
///   {"qloguniform": [lower, upper, q]}
///   {"randint": [lower, upper]}      an integer in [lower, upper) (upper excluded, as in Ray)
///   {"qrandint": [lower, upper, q]}  a multiple of q in [lower, upper] (upper included, as in Ray)
/// Anything else is a constant and is copied into every trial's config as it is.
Json grid_search(Json values);
/// A value drawn uniformly from `categories` (a JSON array): {"choice": [...]}.
Json choice(Json categories);
/// A float uniform in [lower, upper]: {"uniform": [lower, upper]}.
Json uniform(double lower, double upper);
/// A float uniform in [lower, upper], rounded to a multiple of q.
Json quniform(double lower, double upper, double q);
/// A float whose logarithm is uniform in [log lower, log upper]; 0 < lower < upper.
Json loguniform(double lower, double upper);
/// loguniform(), rounded to a multiple of q.
Json qloguniform(double lower, double upper, double q);
/// An integer in [lower, upper) (upper excluded, as in Ray).
Json randint(int64_t lower, int64_t upper);
/// A multiple of q in [lower, upper] (upper included, as in Ray).
Json qrandint(int64_t lower, int64_t upper, int64_t q);

/// Whether `value` is a search domain (of any kind, grid_search included).
bool is_domain(const Json& value);

/// Parses the command-line form of a domain: "loguniform:1e-4:1e-1", "uniform:0:1",
/// "quniform:0:1:0.1", "randint:1:10", "choice:32,64,128", "grid:sgd,adam". Values of choice and
/// grid are numbers when they read as numbers, else strings. A value without a domain prefix is a
/// constant (number or string). Throws UsageError naming what is wrong.
Json parse_domain(const std::string& text);

/// Draws one value from a random domain (not grid_search). `where` names it in errors.
Json sample_domain(const Json& domain, std::mt19937_64& rng, const std::string& where = "value");

/// Checks every domain of a param space (bounds, non-empty lists) and throws UsageError naming
/// the first bad one by its path, such as "param_space/train_loop_config/lr".
void validate_param_space(const Json& param_space);

/// The paths ("lr", "optimizer/momentum") of every domain in a param space, in order: the
/// parameters a trial table shows.
std::vector<std::string> searched_parameters(const Json& param_space);

/// Resolves a param space into trial configurations (Ray Tune's search_alg).
class Searcher {
 public:
  virtual ~Searcher() = default;
  /// Called once before the first suggest().
  virtual void set_search_properties(const std::string& metric, const std::string& mode,
                                     const Json& param_space) {}
  /// The config of the next trial, or nullopt once the searcher has no more.
  virtual std::optional<Json> suggest(const std::string& trial_id) = 0;
  /// Every result of a trial, and its end (errored: it failed). Model-based searchers learn here.
  virtual void on_trial_result(const std::string& trial_id, const Json& result) {}
  /// A trial ended with `last_result`; `errored`: it failed.
  virtual void on_trial_complete(const std::string& trial_id, const Json& last_result,
                                 bool errored) {}
  /// The number of trials it will suggest in all, when known.
  virtual std::optional<int64_t> total_trials() const { return std::nullopt; }
};

/// The default searcher (Ray Tune's BasicVariantGenerator): every combination of the grid_search
/// values, the whole grid repeated num_samples times, each trial with fresh draws of the random
/// domains. Seeded: the same param space, num_samples and seed give the same trials, in the same
/// order.
class BasicVariantGenerator : public Searcher {
 public:
  /// num_samples: how often the whole grid is repeated (TuneConfig::num_samples).
  explicit BasicVariantGenerator(uint64_t seed = 0, int num_samples = 1)
      : seed_(seed), rng_(seed), num_samples_(num_samples) {}
  void set_search_properties(const std::string& metric, const std::string& mode,
                             const Json& param_space) override;
  std::optional<Json> suggest(const std::string& trial_id) override;
  std::optional<int64_t> total_trials() const override;

 private:
  uint64_t seed_;
  std::mt19937_64 rng_;
  int num_samples_;
  Json param_space_ = Json::object();
  std::vector<std::string> grid_paths_;  ///< JSON pointers of the grid_search domains
  std::vector<size_t> grid_sizes_;
  int64_t next_ = 0;
};

}  // namespace cohort::tune

#include "cohort/tune/search_space.h"

#include <cmath>
#include <cstdlib>
#include <sstream>

#include "cohort/error.h"

namespace cohort::tune {
namespace {

constexpr const char* kGrid = "grid_search";
const std::vector<std::string> kDomainKinds = {"grid_search", "choice",      "uniform", "quniform",
                                               "loguniform",  "qloguniform", "randint", "qrandint"};

// A float in [0, 1) from the top 53 bits: the same on every platform, unlike the standard
// distributions, whose algorithms the standard leaves open.
double unit(std::mt19937_64& rng) { return static_cast<double>(rng() >> 11) * 0x1.0p-53; }

std::string kind_of(const Json& domain) { return domain.begin().key(); }

std::string pointer_to_path(const std::string& pointer) {
  return pointer.empty() ? std::string() : pointer.substr(1);
}

void fail(const std::string& where, const std::string& what) {
  throw UsageError(where + ": " + what);
}

double number_at(const Json& args, size_t i, const std::string& where, const std::string& kind) {
  if (!args[i].is_number()) fail(where, kind + " bound " + args[i].dump() + " is not a number");
  return args[i].get<double>();
}

// Checks one domain; `where` names it.
void check_domain(const Json& domain, const std::string& where) {
  const std::string kind = kind_of(domain);
  const Json& args = domain.begin().value();
  if (!args.is_array()) fail(where, kind + " takes a list, got " + args.dump());
  if (kind == "grid_search" || kind == "choice") {
    if (args.empty()) fail(where, kind + " needs at least one value");
    return;
  }
  const bool quantized = kind[0] == 'q';
  const size_t arity = quantized ? 3 : 2;
  if (args.size() != arity) {
    fail(where, kind + " takes [lower, upper" + std::string(quantized ? ", q" : "") + "], got " +
                    args.dump());
  }
  const double lower = number_at(args, 0, where, kind), upper = number_at(args, 1, where, kind);
  if (kind == "randint" || kind == "qrandint") {
    for (size_t i = 0; i < arity; ++i) {
      if (!args[i].is_number_integer()) fail(where, kind + " takes integers, got " + args.dump());
    }
  }
  if (kind == "randint" ? !(lower < upper) : !(lower <= upper)) {
    fail(where, kind + " needs lower " + std::string(kind == "randint" ? "<" : "<=") +
                    " upper, got " + args.dump());
  }
  if ((kind == "loguniform" || kind == "qloguniform") && !(lower > 0)) {
    fail(where, kind + " needs 0 < lower (a logarithm is taken), got " + args.dump());
  }
  if (quantized) {
    const double q = number_at(args, 2, where, kind);
    if (!(q > 0)) fail(where, kind + " needs a quantum q > 0, got " + args.dump());
    if (std::ceil(lower / q) * q > upper)
      fail(where, kind + " has no multiple of q in [lower, upper]: " + args.dump());
  }
}

// Rounds to the nearest multiple of q, kept within the multiples of q in [lower, upper].
double quantize(double value, double q, double lower, double upper) {
  const double low = std::ceil(lower / q - 1e-9), high = std::floor(upper / q + 1e-9);
  return std::clamp(std::round(value / q), low, high) * q;
}

// Samples every random domain in `value`; `where` names it in errors ("param_space/lr").
Json resolve(const Json& value, std::mt19937_64& rng, const std::string& where);

template <typename Visit>
void walk(const Json& value, const std::string& pointer, const Visit& visit) {
  if (is_domain(value)) {
    visit(value, pointer);
    return;
  }
  if (value.is_object()) {
    for (const auto& [key, child] : value.items()) walk(child, pointer + "/" + key, visit);
  } else if (value.is_array()) {
    for (size_t i = 0; i < value.size(); ++i)
      walk(value[i], pointer + "/" + std::to_string(i), visit);
  }
}

Json resolve(const Json& value, std::mt19937_64& rng, const std::string& where) {
  if (is_domain(value)) {
    if (kind_of(value) == kGrid)
      fail(where, "a grid_search cannot stand inside a choice or another grid_search");
    return sample_domain(value, rng, where);
  }
  if (value.is_object()) {
    Json out = Json::object();
    for (const auto& [key, child] : value.items())
      out[key] = resolve(child, rng, where + "/" + key);
    return out;
  }
  if (value.is_array()) {
    Json out = Json::array();
    for (size_t i = 0; i < value.size(); ++i)
      out.push_back(resolve(value[i], rng, where + "/" + std::to_string(i)));
    return out;
  }
  return value;
}

Json parse_scalar(const std::string& text) {
  if (text.empty()) return text;
  char* end = nullptr;
  const long long integer = std::strtoll(text.c_str(), &end, 10);
  if (*end == '\0') return static_cast<int64_t>(integer);
  const double real = std::strtod(text.c_str(), &end);
  if (*end == '\0') return real;
  if (text == "true" || text == "false") return text == "true";
  return text;
}

std::vector<std::string> split(const std::string& text, char separator) {
  std::vector<std::string> parts;
  std::string part;
  std::istringstream in(text);
  while (std::getline(in, part, separator)) parts.push_back(part);
  if (!text.empty() && text.back() == separator) parts.emplace_back();
  return parts;
}

}  // namespace

Json grid_search(Json values) { return Json{{"grid_search", std::move(values)}}; }
Json choice(Json categories) { return Json{{"choice", std::move(categories)}}; }
Json uniform(double lower, double upper) { return Json{{"uniform", {lower, upper}}}; }
Json quniform(double lower, double upper, double q) {
  return Json{{"quniform", {lower, upper, q}}};
}
Json loguniform(double lower, double upper) { return Json{{"loguniform", {lower, upper}}}; }
Json qloguniform(double lower, double upper, double q) {
  return Json{{"qloguniform", {lower, upper, q}}};
}
Json randint(int64_t lower, int64_t upper) { return Json{{"randint", {lower, upper}}}; }
Json qrandint(int64_t lower, int64_t upper, int64_t q) {
  return Json{{"qrandint", {lower, upper, q}}};
}

bool is_domain(const Json& value) {
  if (!value.is_object() || value.size() != 1) return false;
  const std::string key = value.begin().key();
  return std::find(kDomainKinds.begin(), kDomainKinds.end(), key) != kDomainKinds.end();
}

Json parse_domain(const std::string& text) {
  const auto colon = text.find(':');
  const std::string kind = text.substr(0, colon);
  const bool known = kind == "grid" || std::find(kDomainKinds.begin(), kDomainKinds.end(), kind) !=
                                           kDomainKinds.end();
  if (colon == std::string::npos || !known) return parse_scalar(text);
  const std::string rest = text.substr(colon + 1);
  Json domain;
  if (kind == "grid" || kind == "grid_search" || kind == "choice") {
    Json values = Json::array();
    for (const auto& part : split(rest, ',')) values.push_back(parse_scalar(part));
    domain = Json{{kind == "choice" ? "choice" : "grid_search", values}};
  } else {
    Json bounds = Json::array();
    for (const auto& part : split(rest, ':')) {
      const Json value = parse_scalar(part);
      if (!value.is_number()) {
        throw UsageError("'" + text + "': " + kind + " bound '" + part +
                         "' is not a number (write " + kind + ":LOWER:UPPER" +
                         (kind[0] == 'q' ? ":Q" : "") + ")");
      }
      bounds.push_back(value);
    }
    domain = Json{{kind, bounds}};
  }
  check_domain(domain, "'" + text + "'");
  return domain;
}

Json sample_domain(const Json& domain, std::mt19937_64& rng, const std::string& where) {
  if (!is_domain(domain)) fail(where, domain.dump() + " is not a search domain");
  check_domain(domain, where);
  const std::string kind = kind_of(domain);
  const Json& args = domain.begin().value();
  if (kind == kGrid) fail(where, "grid_search is expanded by the searcher, not sampled");
  if (kind == "choice") {
    const auto index = static_cast<size_t>(unit(rng) * static_cast<double>(args.size()));
    const size_t pick = std::min(index, args.size() - 1);
    return resolve(args[pick], rng, where + "/choice/" + std::to_string(pick));
  }
  const double lower = args[0].get<double>(), upper = args[1].get<double>();
  const double u = unit(rng);
  if (kind == "uniform") return lower + u * (upper - lower);
  if (kind == "quniform")
    return quantize(lower + u * (upper - lower), args[2].get<double>(), lower, upper);
  if (kind == "loguniform" || kind == "qloguniform") {
    const double value = std::exp(std::log(lower) + u * (std::log(upper) - std::log(lower)));
    return kind == "loguniform" ? value : quantize(value, args[2].get<double>(), lower, upper);
  }
  const int64_t low = args[0].get<int64_t>(), high = args[1].get<int64_t>();
  if (kind == "randint") {
    return std::min(high - 1, low + static_cast<int64_t>(u * static_cast<double>(high - low)));
  }
  // qrandint: upper included, as in Ray.
  const int64_t q = args[2].get<int64_t>();
  const int64_t value =
      std::min(high, low + static_cast<int64_t>(u * static_cast<double>(high - low + 1)));
  return static_cast<int64_t>(quantize(static_cast<double>(value), static_cast<double>(q),
                                       static_cast<double>(low), static_cast<double>(high)));
}

void validate_param_space(const Json& param_space) {
  if (!param_space.is_object())
    throw UsageError("param_space must be a JSON object, got " + param_space.dump());
  walk(param_space, "", [](const Json& domain, const std::string& pointer) {
    check_domain(domain, "param_space" + pointer);
    if (kind_of(domain) == "choice") {
      walk(domain.begin().value(), pointer + "/choice",
           [](const Json& inner, const std::string& inner_pointer) {
             if (kind_of(inner) == kGrid)
               fail("param_space" + inner_pointer, "a grid_search cannot stand inside a choice");
             check_domain(inner, "param_space" + inner_pointer);
           });
    }
  });
}

std::vector<std::string> searched_parameters(const Json& param_space) {
  std::vector<std::string> paths;
  walk(param_space, "",
       [&](const Json&, const std::string& pointer) { paths.push_back(pointer_to_path(pointer)); });
  return paths;
}

void BasicVariantGenerator::set_search_properties(const std::string&, const std::string&,
                                                  const Json& param_space) {
  validate_param_space(param_space);
  param_space_ = param_space;
  grid_paths_.clear();
  grid_sizes_.clear();
  walk(param_space_, "", [&](const Json& domain, const std::string& pointer) {
    if (kind_of(domain) != kGrid) return;
    grid_paths_.push_back(pointer);
    grid_sizes_.push_back(domain.begin().value().size());
  });
  rng_.seed(seed_);
  next_ = 0;
}

std::optional<int64_t> BasicVariantGenerator::total_trials() const {
  int64_t grid = 1;
  for (size_t size : grid_sizes_) grid *= static_cast<int64_t>(size);
  return grid * num_samples_;
}

std::optional<Json> BasicVariantGenerator::suggest(const std::string&) {
  if (next_ >= *total_trials()) return std::nullopt;
  // The last grid varies fastest; the whole grid once per sample.
  int64_t combination = next_++;
  Json config = param_space_;
  for (size_t g = grid_paths_.size(); g-- > 0;) {
    const auto size = static_cast<int64_t>(grid_sizes_[g]);
    const Json::json_pointer pointer(grid_paths_[g]);
    config[pointer] = config[pointer]["grid_search"][static_cast<size_t>(combination % size)];
    combination /= size;
  }
  return resolve(config, rng_, "param_space");
}

}  // namespace cohort::tune

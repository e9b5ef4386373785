#include "cohort/parallel/activation_checkpointing_policy.h"

#include <exception>

#include "cohort/error.h"

namespace cohort::parallel {

void ActivationCheckpointing::validate() const {
  const std::string flag = "--activation-checkpointing " + to_string(*this);
  if (every < 0)
    throw UsageError(flag + ": every:K needs K >= 1 (1: every unit; none: no checkpointing)");
  if (every > 0 && !layers.empty())
    throw UsageError(flag + ": give every:K or layers:NAMES, not both");
  for (const auto& name : layers)
    if (name.empty()) throw UsageError(flag + ": an empty layer name; give NAME[,NAME...]");
}

ActivationCheckpointing parse_activation_checkpointing(const std::string& text) {
  const auto fail = [&](const std::string& why) {
    return UsageError("--activation-checkpointing '" + text + "': " + why +
                      "; give none, every:K (K >= 1: every K-th unit) or layers:NAME[,NAME...] "
                      "(units by name or type, e.g. layers:blocks.0,blocks.1 or "
                      "layers:BasicBlock)");
  };
  ActivationCheckpointing policy;
  if (text.empty() || text == "none") return policy;
  const auto colon = text.find(':');
  const std::string kind = text.substr(0, colon);
  const std::string value = colon == std::string::npos ? "" : text.substr(colon + 1);
  if (kind == "every") {
    size_t used = 0;
    long long k = 0;
    try {
      k = std::stoll(value, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (value.empty() || used != value.size()) throw fail("K must be an integer");
    if (k < 1) throw fail("K must be >= 1");
    if (k > 1'000'000) throw fail("K must be at most 1000000");
    policy.every = static_cast<int>(k);
    return policy;
  }
  if (kind == "layers") {
    size_t start = 0;
    while (start <= value.size()) {
      const auto comma = value.find(',', start);
      const auto name = value.substr(start, comma == std::string::npos ? comma : comma - start);
      if (name.empty()) throw fail("a layer name is empty");
      policy.layers.push_back(name);
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
    return policy;
  }
  throw fail("unknown form");
}

std::string to_string(const ActivationCheckpointing& policy) {
  if (policy.every != 0) return "every:" + std::to_string(policy.every);
  if (policy.layers.empty()) return "none";
  std::string text = "layers:";
  for (size_t i = 0; i < policy.layers.size(); ++i) text += (i ? "," : "") + policy.layers[i];
  return text;
}

}  // namespace cohort::parallel

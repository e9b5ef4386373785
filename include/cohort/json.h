#pragma once
#include <nlohmann/json.hpp>

namespace cohort {
// Configs, metrics and control messages are JSON, as in Ray (dicts); keys keep their order.
using Json = nlohmann::ordered_json;
}  // namespace cohort

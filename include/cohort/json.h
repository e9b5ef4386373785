#pragma once
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

#include <nlohmann/json.hpp>

#include "cohort/error.h"

namespace cohort {
/// Configs, metrics and control messages are JSON, as in Ray (dicts); keys keep their order.
using Json = nlohmann::ordered_json;

/// Field `key` of a message from another process, `fallback` when it has none (or null). A field
/// of another JSON type than T's (a string where a number belongs, 1.5 for an integer, a number
/// past T's range), or a message that is no object, is a UsageError naming the field: read this
/// way, a peer's malformed message is an error to handle, never a nlohmann exception thrown from
/// a `value()` deep in a loop.
template <typename T>
T json_field(const Json& message, const char* key, T fallback) {
  if (!message.is_object()) {
    throw UsageError(std::string("a message must be a JSON object, not ") + message.type_name());
  }
  const auto it = message.find(key);
  if (it == message.end() || it->is_null()) return fallback;
  const auto wrong = [&](const char* wanted) {
    return UsageError(std::string("field '") + key + "' is " + it->type_name() + " " +
                      it->dump().substr(0, 40) + ", not " + wanted);
  };
  if constexpr (std::is_same_v<T, bool>) {
    if (!it->is_boolean()) throw wrong("true or false");
  } else if constexpr (std::is_integral_v<T>) {
    if (!it->is_number_integer()) throw wrong("an integer");
    using Limits = std::numeric_limits<T>;
    const bool fits = it->is_number_unsigned()
                          ? it->template get<uint64_t>() <= static_cast<uint64_t>(Limits::max())
                          : it->template get<int64_t>() >= static_cast<int64_t>(Limits::min()) &&
                                (it->template get<int64_t>() < 0 ||
                                 static_cast<uint64_t>(it->template get<int64_t>()) <=
                                     static_cast<uint64_t>(Limits::max()));
    if (!fits) throw wrong("an integer in range");
  } else if constexpr (std::is_floating_point_v<T>) {
    if (!it->is_number()) throw wrong("a number");
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (!it->is_string()) throw wrong("a string");
  }
  return it->template get<T>();
}

}  // namespace cohort

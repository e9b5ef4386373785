// What the local driver hands each worker process it starts: one serialized spec in one variable
// (COHORT_WORKER_SPEC), read and checked here, instead of a variable per setting. The process's
// own settings are this layer's; `session` carries those of the loop the worker runs (the train
// layer's SessionSpec), as a JSON object this layer hands on without reading it.
#pragma once
#include <chrono>
#include <string>
#include <type_traits>

#include "cohort/error.h"
#include "cohort/json.h"
#include "cohort/runtime/coordinator.h"
#include "cohort/timeouts.h"

namespace cohort::runtime {

struct WorkerSpec {
  // The program that wrote it (program_build_id()) and the driver's pid: a spec left in the
  // environment by another build or another run is refused.
  std::string build;
  int driver_pid = 0;
  // Unique to this start of the group: nothing of an earlier start's store keys or staging
  // folders is mistaken for this one's.
  std::string run_token;
  int slot = 0;  // the worker slot (ScalingConfig) the process runs in
  int cpu_threads = 1;
  std::chrono::milliseconds setup_timeout = kDefaultSetupTimeout;
  std::chrono::milliseconds collective_timeout = kDefaultCollectiveTimeout;
  HeartbeatOptions heartbeat;
  int gpus_per_worker = 0;  // 0: CPU training
  std::string backend = "auto";
  int umask = 077;                // the worker process creates its files with it
  Json session = Json::object();  // the loop's settings, read by the layer that runs it
};

std::string to_text(const WorkerSpec& spec);
// Parses and checks a spec: a UsageError of one line naming the field and its value when it is
// malformed, of another build, or of another driver than this process's parent.
WorkerSpec worker_spec_from_text(const std::string& text);
// This worker's spec, from its environment; a UsageError when there is none.
WorkerSpec worker_spec_from_env();

// The fields of a spec's JSON object (the process's, or its session's), each required and checked
// for its type and range; a UsageError names the field, its value and `what` (e.g. "worker
// spec").
class SpecFields {
 public:
  SpecFields(const Json& object, std::string what) : object_(object), what_(std::move(what)) {}

  template <typename T>
  T get(const char* key) const {
    if (!object_.contains(key)) throw error(std::string("field '") + key + "' is missing");
    if constexpr (std::is_arithmetic_v<T>) {
      // Checked for its type and range: nlohmann's get() would narrow a number that does not fit
      // (undefined for a float past the integer's range).
      if (!object_.at(key).is_null()) {
        try {
          return json_field<T>(object_, key, T{});
        } catch (const UsageError& e) {
          throw error(e.what());
        }
      }
    }
    try {
      return object_.at(key).get<T>();
    } catch (const UsageError& e) {  // a field of an object, named by its own reader
      throw error(std::string("field '") + key + "': " + e.what());
    } catch (const std::exception&) {
      throw error(std::string("field '") + key + "' has the wrong type (" + object_.at(key).dump() +
                  ")");
    }
  }

  // An integer field that must be at least `least`.
  template <typename T>
  T at_least(const char* key, T least) const {
    const auto value = get<T>(key);
    if (value < least) {
      throw error(std::string(key) + " = " + std::to_string(value) +
                  ": it must be >= " + std::to_string(least));
    }
    return value;
  }

  // "<what>: <message>".
  UsageError error(const std::string& message) const { return UsageError(what_ + ": " + message); }

 private:
  const Json& object_;
  std::string what_;
};

}  // namespace cohort::runtime

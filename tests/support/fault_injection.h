// Faults a test's train loop injects once per run, so that the restarted or regrouped workers run
// clean.
#pragma once
#include <string>

namespace cohort::testing {

// True once per run directory (the train context's storage path) and `tag`: the first caller
// creates a marker file there, every later one finds it.
bool first_time_in_run(const std::string& tag);

}  // namespace cohort::testing

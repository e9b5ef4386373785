// A process group whose ranks are threads of the test process (Gloo is happy with that).
#pragma once
#include <chrono>
#include <functional>
#include <mutex>

#include "cohort/comm/process_group.h"

namespace cohort::testing {

// Runs fn(group) on `world` threads, each rank of one group; rethrows the first failure. The
// group's collectives have a test's deadline, 30 s, unless `options` say otherwise.
void run_ranks(int world, const std::function<void(comm::ProcessGroup&)>& fn,
               comm::ProcessGroupOptions options = {.timeout = std::chrono::seconds(30)});

// The ranks are threads sharing torch's generator: seed and draw under this lock, so that every
// draw is the same on every run.
inline std::mutex& generator_mutex() {
  static std::mutex mutex;
  return mutex;
}

}  // namespace cohort::testing

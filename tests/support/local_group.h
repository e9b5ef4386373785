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

// Runs fn(group) on `world` processes: copies of this test program running only the current
// test, each one rank. GPU ranks need this: libtorch's autograd runs a process's backward passes
// on one CUDA device in one thread, so ranks that are threads of one process and all-reduce
// inside backward (tensor parallelism, DDP's and ZeRO's hooks) wait for each other forever. In a
// copy, the call runs fn as its rank and ends the process (the test's other calls of this
// function do nothing there); here it returns once every rank has exited, and fails the test
// naming each rank that failed, with its output. Every rank has 120 s.
void run_rank_processes(int world, const std::function<void(comm::ProcessGroup&)>& fn,
                        comm::ProcessGroupOptions options);

// Options for ranks that share one GPU: Gloo's CUDA path (NCCL refuses two ranks on one GPU),
// or `backend` (NCCL at world size 1).
inline comm::ProcessGroupOptions gpu_group_options(comm::Backend backend = comm::Backend::kGloo) {
  comm::ProcessGroupOptions options{.timeout = std::chrono::seconds(30)};
  options.backend = backend;
  return options;
}

// The ranks are threads sharing torch's generator: seed and draw under this lock, so that every
// draw is the same on every run.
inline std::mutex& generator_mutex() {
  static std::mutex mutex;
  return mutex;
}

}  // namespace cohort::testing

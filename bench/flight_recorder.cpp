// The flight recorder's cost (issue 39): the time of one small all-reduce between 2 ranks
// (threads on loopback, Gloo) with the recorder on (its default ring) and off
// (ProcessGroupOptions::flight_recorder_entries = 0), alternated in one run; a small collective
// is where recording weighs most. Also how long a full ring takes to turn into a rank's file's
// JSON.
// Usage: flight_recorder [--ops 20000] [--rounds 3] [--elements 1]
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <thread>

#include "cohort/cohort.h"

namespace {

using Clock = std::chrono::steady_clock;

// Microseconds per all-reduce of `elements` floats, over `ops` of them, on 2 ranks.
double microseconds_per_op(size_t entries, int ops, int64_t elements) {
  auto server = cohort::comm::Store::connect({.is_server = true});
  std::vector<double> seconds(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      auto store = cohort::comm::Store::connect({.port = server.port()});
      cohort::comm::ProcessGroupOptions options;
      options.flight_recorder_entries = entries;
      auto group = cohort::comm::ProcessGroup::create(store, r, 2, options);
      std::vector<at::Tensor> t{torch::ones({elements})};
      for (int i = 0; i < 100; ++i) group.allreduce(t);  // warm up
      const auto start = Clock::now();
      for (int i = 0; i < ops; ++i) group.allreduce(t);
      seconds[static_cast<size_t>(r)] = std::chrono::duration<double>(Clock::now() - start).count();
      group.barrier();
    });
  }
  for (auto& t : ranks) t.join();
  return std::max(seconds[0], seconds[1]) / ops * 1e6;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"The flight recorder's cost per collective"};
  int ops = 20000, rounds = 3;
  int64_t elements = 1;
  app.add_option("--ops", ops)->check(CLI::PositiveNumber);
  app.add_option("--rounds", rounds)->check(CLI::PositiveNumber);
  app.add_option("--elements", elements)->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  at::set_num_threads(1);
  std::printf("all-reduce of %lld float(s), 2 ranks (threads, Gloo on loopback), %d ops a run\n",
              static_cast<long long>(elements), ops);
  std::printf("%-6s %14s %14s %8s\n", "round", "off_us_per_op", "on_us_per_op", "on/off");
  double off_sum = 0, on_sum = 0;
  for (int round = 1; round <= rounds; ++round) {
    const double off = microseconds_per_op(0, ops, elements);
    const double on =
        microseconds_per_op(cohort::comm::kDefaultFlightRecorderEntries, ops, elements);
    off_sum += off;
    on_sum += on;
    std::printf("%-6d %14.2f %14.2f %8.3f\n", round, off, on, on / off);
  }
  std::printf("%-6s %14.2f %14.2f %8.3f\n", "mean", off_sum / rounds, on_sum / rounds,
              on_sum / off_sum);

  // A full ring written out, as a rank does when asked.
  cohort::comm::FlightRecorder recorder;
  recorder.add_group("train/x", {0, 1});
  for (size_t i = 1; i <= cohort::comm::kDefaultFlightRecorderEntries; ++i) {
    const auto id = recorder.begin({.group = "train/x",
                                    .seq = static_cast<int64_t>(i),
                                    .op = "allreduce",
                                    .dtype = "Float",
                                    .numel = 1 << 20,
                                    .tensors = 1,
                                    .detail = "gloo"});
    recorder.end(id, cohort::comm::FlightState::kCompleted);
  }
  const auto start = Clock::now();
  const std::string text = recorder.to_json(0, "bench").dump(1);
  std::printf("a full ring of %zu operations as JSON: %.1f ms, %.0f KiB\n",
              cohort::comm::kDefaultFlightRecorderEntries,
              std::chrono::duration<double, std::milli>(Clock::now() - start).count(),
              static_cast<double>(text.size()) / 1024);
  return 0;
}

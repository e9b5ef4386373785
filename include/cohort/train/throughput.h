/// \file
/// The training throughput a loop reports: samples per second over the steps it measured.
#pragma once
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

namespace cohort::train {

/// Samples per second over a loop's steps, leaving out the first `warmup_steps` (start-up, the
/// first step's probes and allocations). A run with no more steps than that is measured over the
/// steps after its first, and says so (`measured_steps`); a run of one step is not measured
/// (`samples_per_second` is empty and `why_unmeasured` says why) rather than reported as 0.
///   train::Throughput throughput;
///   for (epoch ...) { throughput.start(); for (batch ...) { step(...); throughput.step(rows); } }
class Throughput {
 public:
  /// The clock of the time points (steady).
  using Clock = std::chrono::steady_clock;
  /// How a Throughput measures.
  struct Options {
    int64_t warmup_steps = 5;  ///< steps left out at the start
  };
  /// A meter whose clock starts now.
  explicit Throughput(Options options);
  Throughput();

  /// The clock starts (again): before a pass over the data, after an evaluation that is not
  /// training time. Construction starts it too.
  void start(Clock::time_point now = Clock::now());
  /// A step ended that trained on `samples` rows (over all ranks).
  void step(int64_t samples, Clock::time_point now = Clock::now());

  /// The steps counted so far.
  int64_t steps() const { return steps_; }
  /// The steps samples_per_second is measured over.
  int64_t measured_steps() const;
  /// Samples per second over the measured steps; empty when none was measured.
  std::optional<double> samples_per_second() const;
  /// Why samples_per_second() is empty; "" when it is not.
  std::string why_unmeasured() const;

 private:
  struct Span {
    int64_t steps = 0;
    int64_t samples = 0;
    double seconds = 0;
  };
  const Span* measured() const;

  Options options_;
  Clock::time_point last_;
  int64_t steps_ = 0;
  Span after_warmup_;
  Span after_first_;
};

}  // namespace cohort::train

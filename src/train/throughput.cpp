#include "cohort/train/throughput.h"

#include "cohort/error.h"

namespace cohort::train {

Throughput::Throughput(Options options) : options_(options), last_(Clock::now()) {
  if (options_.warmup_steps < 0) {
    throw UsageError("Throughput: warmup_steps " + std::to_string(options_.warmup_steps) +
                     " must be >= 0");
  }
}

Throughput::Throughput() : Throughput(Options{}) {}

void Throughput::start(Clock::time_point now) { last_ = now; }

void Throughput::step(int64_t samples, Clock::time_point now) {
  const double seconds = std::chrono::duration<double>(now - last_).count();
  last_ = now;
  ++steps_;
  const auto add = [&](Span& span) {
    ++span.steps;
    span.samples += samples;
    span.seconds += seconds;
  };
  if (steps_ > 1) add(after_first_);
  if (steps_ > options_.warmup_steps) add(after_warmup_);
}

const Throughput::Span* Throughput::measured() const {
  if (after_warmup_.steps > 0 && after_warmup_.seconds > 0) return &after_warmup_;
  if (after_first_.steps > 0 && after_first_.seconds > 0) return &after_first_;
  return nullptr;
}

int64_t Throughput::measured_steps() const {
  const auto* span = measured();
  return span ? span->steps : 0;
}

std::optional<double> Throughput::samples_per_second() const {
  const auto* span = measured();
  if (!span) return std::nullopt;
  return static_cast<double>(span->samples) / span->seconds;
}

std::string Throughput::why_unmeasured() const {
  if (measured()) return "";
  if (steps_ == 0) return "no step was taken";
  if (steps_ == 1) return "the run took 1 step, and the first step (start-up) is never timed";
  return "the steps took no measurable time";
}

}  // namespace cohort::train

#include "cohort/trace.h"

#include <algorithm>
#include <mutex>
#include <utility>

#include "cohort/json.h"

namespace cohort::trace {

namespace {

using Clock = std::chrono::steady_clock;

struct Recorder {
  std::mutex mutex;
  Totals totals;
  // Seconds of the step under way, added to the totals when it ends.
  std::array<double, kPhases> pending{};
  Clock::time_point totals_since = Clock::now();
  // When the first and the last step since totals_since ended, and the first one's waits for
  // peers.
  Clock::time_point first_end, last_end;
  double first_step_comm_wait = 0;
  int64_t step = 1;
  int64_t first = 0, last = 0;
  std::vector<Event> events;
  std::function<void(const std::vector<Event>&)> on_done;
};

Recorder& recorder() {
  static Recorder* r = new Recorder();  // never destroyed: spans may end during exit
  return *r;
}

double unix_us(Clock::time_point t) {
  const auto system_now = std::chrono::system_clock::now();
  const auto steady_now = Clock::now();
  return std::chrono::duration<double, std::micro>(system_now.time_since_epoch()).count() -
         std::chrono::duration<double, std::micro>(steady_now - t).count();
}

void record(Phase phase, Clock::time_point start, Clock::time_point end) {
  auto& r = recorder();
  const double seconds = std::chrono::duration<double>(end - start).count();
  std::lock_guard lock(r.mutex);
  (phase == Phase::kCheckpoint ? r.totals.seconds : r.pending)[static_cast<size_t>(phase)] +=
      seconds;
  if (r.first > 0 && r.step >= r.first && r.step <= r.last)
    r.events.push_back({phase, r.step, unix_us(start), seconds * 1e6});
}

}  // namespace

const char* to_string(Phase phase) {
  switch (phase) {
    case Phase::kDataWait:
      return "data_wait";
    case Phase::kForward:
      return "forward";
    case Phase::kBackward:
      return "backward";
    case Phase::kCommWait:
      return "comm_wait";
    case Phase::kOptimizer:
      return "optimizer";
    case Phase::kCheckpoint:
      return "checkpoint";
  }
  return "unknown";
}

Span::Span(Phase phase) : phase_(phase), start_(Clock::now()) {}

Span::Span(Span&& other) noexcept
    : phase_(other.phase_), start_(other.start_), active_(std::exchange(other.active_, false)) {}

Span::~Span() {
  if (active_) record(phase_, start_, Clock::now());
}

void add(Phase phase, double seconds) {
  const auto end = Clock::now();
  record(phase,
         end - std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds)),
         end);
}

void end_step() {
  auto& r = recorder();
  std::function<void(const std::vector<Event>&)> done;
  std::vector<Event> events;
  {
    std::lock_guard lock(r.mutex);
    r.last_end = Clock::now();
    if (r.totals.steps == 0) {
      r.first_end = r.last_end;
      r.first_step_comm_wait = r.pending[static_cast<size_t>(Phase::kCommWait)];
    }
    ++r.totals.steps;
    for (size_t p = 0; p < r.pending.size(); ++p) r.totals.seconds[p] += r.pending[p];
    r.pending = {};
    if (r.first > 0 && r.step == r.last && r.on_done) {
      done = std::exchange(r.on_done, nullptr);
      events = std::exchange(r.events, {});
    }
    ++r.step;
  }
  if (done) done(events);
}

int64_t current_step() {
  auto& r = recorder();
  std::lock_guard lock(r.mutex);
  return r.step;
}

Totals take_totals() {
  auto& r = recorder();
  const auto now = Clock::now();
  std::lock_guard lock(r.mutex);
  Totals out = std::exchange(r.totals, Totals{});
  r.pending = {};  // after the last step: an evaluation, the report, no step's
  const double comm_wait = out.seconds[static_cast<size_t>(Phase::kCommWait)];
  if (out.steps >= 2) {
    // From the first step's end to the last's, extended by one step: the time before the first
    // step (setup, evaluation, waiting at the last report) is no step's. The waits are those of
    // the same steps, extended alike.
    const double between = std::chrono::duration<double>(r.last_end - r.first_end).count();
    const double scale = static_cast<double>(out.steps) / static_cast<double>(out.steps - 1);
    out.wall_seconds = between * scale;
    out.busy_seconds = std::max(0.0, between - (comm_wait - r.first_step_comm_wait)) * scale;
  } else {
    out.wall_seconds =
        std::chrono::duration<double>((out.steps == 1 ? r.last_end : now) - r.totals_since).count();
    out.busy_seconds = std::max(0.0, out.wall_seconds - comm_wait);
  }
  r.totals_since = now;
  return out;
}

void set_profile_steps(int64_t first, int64_t last,
                       std::function<void(const std::vector<Event>&)> on_done) {
  auto& r = recorder();
  std::lock_guard lock(r.mutex);
  r.first = first;
  r.last = last;
  r.events.clear();
  r.on_done = first > 0 ? std::move(on_done) : nullptr;
}

void finish_profile() {
  auto& r = recorder();
  std::function<void(const std::vector<Event>&)> done;
  std::vector<Event> events;
  {
    std::lock_guard lock(r.mutex);
    done = std::exchange(r.on_done, nullptr);
    events = std::exchange(r.events, {});
    r.first = r.last = 0;
  }
  if (done) done(events);
}

std::string chrome_trace(const std::vector<Event>& events, int rank) {
  Json trace = Json::array();
  trace.push_back({{"name", "process_name"},
                   {"ph", "M"},
                   {"pid", rank},
                   {"args", {{"name", "rank " + std::to_string(rank)}}}});
  trace.push_back({{"name", "process_sort_index"},
                   {"ph", "M"},
                   {"pid", rank},
                   {"args", {{"sort_index", rank}}}});
  for (const auto& e : events) {
    trace.push_back({{"name", to_string(e.phase)},
                     {"cat", "step"},
                     {"ph", "X"},
                     {"ts", e.start_us},
                     {"dur", e.duration_us},
                     {"pid", rank},
                     {"tid", 0},
                     {"args", {{"step", e.step}}}});
  }
  return Json{{"traceEvents", trace}, {"displayTimeUnit", "ms"}}.dump() + "\n";
}

}  // namespace cohort::trace

/// \file
/// Where a worker's step time goes: the phases cohort times (waiting for data, forward, backward,
/// waiting for peers in collectives, the optimizer, checkpoints), summed for each report and, for
/// chosen steps, recorded as spans for a Chrome trace (RunConfig::profile_steps).
///
/// One recorder per process. cohort's own calls feed it: data loaders (data wait),
/// comm::Work::wait (communication wait), train::autocast (forward: the guard's lifetime),
/// train::backward, train::step_optimizer (optimizer; it also ends the step), train::report with a
/// checkpoint and train::save_checkpoint. A loop can time its own code with trace::Span.
#pragma once
#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace cohort::trace {

/// The phases of a step cohort times.
enum class Phase { kDataWait, kForward, kBackward, kCommWait, kOptimizer, kCheckpoint };
/// The number of phases.
inline constexpr int kPhases = 6;
/// "data_wait", "forward", "backward", "comm_wait", "optimizer", "checkpoint".
const char* to_string(Phase phase);

/// Times `phase` from construction to destruction. Spans nest (communication waits inside the
/// backward pass count in both).
class Span {
 public:
  /// Starts timing `phase`.
  explicit Span(Phase phase);
  ~Span();
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;
  /// Moves the running span (the moved-from one records nothing).
  Span(Span&& other) noexcept;
  Span& operator=(Span&&) = delete;

 private:
  Phase phase_;
  std::chrono::steady_clock::time_point start_;
  bool active_ = true;
};

/// A span of `seconds` that ended now.
void add(Phase phase, double seconds);

/// Ends the current step (train::step_optimizer calls it). Steps count from 1.
void end_step();
/// The number of the step running now (steps ended + 1).
int64_t current_step();

/// Seconds per phase and steps ended since the previous call (the first call: since the process
/// started), and the wall-clock seconds of those steps: from the first step's end to the last's,
/// times steps / (steps - 1), so that what came before the first step (setup) is left out; with
/// one step, since the previous call. A span counts toward the step it happens in (it ends with
/// end_step); those after the last step, before this call (an evaluation, waiting at a report),
/// count for no step and are dropped, checkpoints excepted: they always count.
struct Totals {
  std::array<double, kPhases> seconds{};  ///< per phase, indexed by Phase
  int64_t steps = 0;                      ///< steps ended
  double wall_seconds = 0;                ///< their wall-clock seconds
  /// Their wall-clock seconds without the waits for peers (kCommWait), over the same steps as
  /// wall_seconds: with two steps or more, the waits of the first step (before the window the wall
  /// time is measured over) are not subtracted from the others'. >= 0.
  double busy_seconds = 0;
};
/// The totals since the previous call (see Totals); resets them.
Totals take_totals();

/// One span of a profiled step; start in microseconds since the Unix epoch, so that the traces of
/// several ranks and hosts line up.
struct Event {
  Phase phase;         ///< the phase
  int64_t step;        ///< the step it belongs to, from 1
  double start_us;     ///< its start, microseconds since the Unix epoch
  double duration_us;  ///< its length in microseconds
};
/// Records the spans of steps first..last (inclusive, from 1). When step `last` ends (or at
/// finish_profile(), whichever is first), `on_done` gets the events, once. first = 0: none.
void set_profile_steps(int64_t first, int64_t last,
                       std::function<void(const std::vector<Event>&)> on_done);
/// Hands the events recorded so far to on_done when a profile was asked for and not yet handed
/// (a run that ended inside its window); then stops profiling.
void finish_profile();

/// The Chrome trace JSON (Perfetto, chrome://tracing) of one rank's events: complete ("X")
/// events named by phase, with the step in their args, in process `rank`.
std::string chrome_trace(const std::vector<Event>& events, int rank);

}  // namespace cohort::trace

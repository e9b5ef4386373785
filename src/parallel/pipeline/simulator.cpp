#include "cohort/parallel/pipeline/simulator.h"

#include <algorithm>
#include <map>
#include <tuple>

namespace cohort::parallel::pipeline {

SimulationResult simulate(const Program& program, const SimulationCosts& costs) {
  validate(program);
  const int p = program.layout.ranks;
  SimulationResult result;
  result.busy.assign(p, 0.0);
  result.peak_live_activations.assign(p, 0);
  result.start.resize(p);
  // Arrival time of each message, keyed by its receive: (type of the receive, stage, micro-batch).
  std::map<std::tuple<ActionType, int, int>, double> arrival;
  std::vector<size_t> next(p, 0);
  std::vector<double> clock(p, 0.0);
  std::vector<int> live(p, 0);
  size_t left = 0;
  for (const auto& actions : program.ranks) left += actions.size();
  while (left > 0) {
    bool progressed = false;
    for (int r = 0; r < p; ++r) {
      const auto& actions = program.ranks[r];
      while (next[r] < actions.size()) {
        const Action& a = actions[next[r]];
        double start = clock[r], cost = 0.0;
        bool waiting = false;  // a receive whose message has not been sent yet
        switch (a.type) {
          case ActionType::kRecvActivation:
          case ActionType::kRecvGradient: {
            const auto it = arrival.find({a.type, a.stage, a.micro_batch});
            waiting = it == arrival.end();
            if (!waiting) start = std::max(start, it->second);
            break;
          }
          case ActionType::kSendActivation:
            arrival[{ActionType::kRecvActivation, a.stage + 1, a.micro_batch}] =
                clock[r] + costs.latency;
            break;
          case ActionType::kSendGradient:
            arrival[{ActionType::kRecvGradient, a.stage - 1, a.micro_batch}] =
                clock[r] + costs.latency;
            break;
          case ActionType::kForward:
            cost = costs.forward;
            result.peak_live_activations[r] = std::max(result.peak_live_activations[r], ++live[r]);
            break;
          case ActionType::kBackward:
            cost = costs.backward_input + costs.backward_weight;
            --live[r];
            break;
          case ActionType::kBackwardInput:
            cost = costs.backward_input;
            break;
          case ActionType::kBackwardWeight:
            cost = costs.backward_weight;
            --live[r];
            break;
          case ActionType::kOptimizerStep:
            cost = costs.optimizer_step;
            break;
        }
        if (waiting) break;
        result.start[r].push_back(start);
        clock[r] = start + cost;
        result.busy[r] += cost;
        ++next[r];
        --left;
        progressed = true;
      }
    }
    if (!progressed) {
      std::string blocked;
      for (int r = 0; r < p; ++r) {
        if (next[r] >= program.ranks[r].size()) continue;
        blocked += std::string(blocked.empty() ? "" : "; ") + "rank " + std::to_string(r) +
                   " waits in action " + std::to_string(next[r]) + " (" +
                   to_string(program.ranks[r][next[r]]) + ")";
      }
      throw ScheduleError("the schedule deadlocks: " + blocked +
                          ", and no rank can send what they wait for");
    }
  }
  result.makespan = *std::max_element(clock.begin(), clock.end());
  double busy = 0.0;
  for (double b : result.busy) busy += b;
  result.bubble_fraction = result.makespan > 0.0 ? 1.0 - busy / (p * result.makespan) : 0.0;
  return result;
}

double expected_bubble(const ScheduleOptions& options, const SimulationCosts& costs) {
  const double p = options.layout.ranks, m = options.micro_batches,
               v = options.layout.virtual_stages;
  switch (options.kind) {
    case ScheduleKind::kGPipe:
    case ScheduleKind::kOneFOneB:
      return (p - 1) / (m + p - 1);
    case ScheduleKind::kInterleaved:
      return (p - 1) / (v * m + p - 1);
    case ScheduleKind::kZeroBubble: {
      const double f = costs.forward, b = costs.backward_input, w = costs.backward_weight;
      const double bubble = (p - 1) * std::max(0.0, f + b - w);
      return bubble / (m * (f + b + w) + bubble);
    }
  }
  return 0.0;
}

}  // namespace cohort::parallel::pipeline

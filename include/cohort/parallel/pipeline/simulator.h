/// \file
/// Runs every rank's action list of a pipeline program without processes, with given costs: finds
/// deadlocks and measures the bubble and the activation memory a schedule needs.
#pragma once
#include <vector>

#include "cohort/parallel/pipeline/schedule.h"

namespace cohort::parallel::pipeline {

/// Time of each action for one stage and one micro-batch, in any unit. A whole backward costs
/// backward_input + backward_weight. Sends take no time on the sender (they are asynchronous);
/// a message arrives `latency` after its send.
struct SimulationCosts {
  double forward = 1.0;          ///< one stage's forward of one micro-batch
  double backward_input = 1.0;   ///< its input-gradient backward
  double backward_weight = 1.0;  ///< its weight-gradient backward
  double optimizer_step = 0.0;   ///< a rank's optimizer step
  double latency = 0.0;          ///< a message's time in flight
};

/// What simulate() finds: the makespan, each rank's busy time, the bubble and the peak activations.
struct SimulationResult {
  /// When the last rank finishes.
  double makespan = 0.0;
  /// Time each rank computes.
  std::vector<double> busy;
  /// Idle share of all ranks' time until the makespan: 1 - sum(busy) / (ranks x makespan).
  double bubble_fraction = 0.0;
  /// Most (stage, micro-batch) activations a rank holds at once: from its forward to its whole
  /// backward, or to its weight backward when the backward is split.
  std::vector<int> peak_live_activations;
  /// Start time of every action, per rank, in program order.
  std::vector<std::vector<double>> start;
};

/// Validates the program (validate()), then runs it: a rank waits in a receive until the matching
/// send has happened and its latency passed. Throws ScheduleError on a deadlock, naming every
/// blocked rank and the action it waits in.
SimulationResult simulate(const Program& program, const SimulationCosts& costs = {});

/// The bubble fraction the literature gives for a schedule with uniform costs and no latency:
/// (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v m + p - 1) for interleaved 1F1B (stages of 1/v the
/// cost) and (p-1)(F+B-W)/(m(F+B+W) + (p-1)(F+B-W)) for ZB-H1.
double expected_bubble(const ScheduleOptions& options, const SimulationCosts& costs = {});

}  // namespace cohort::parallel::pipeline

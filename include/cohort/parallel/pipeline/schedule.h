/// \file
/// Pipeline schedules as data: every schedule compiles to one list of actions per rank, which one
/// executor runs (Pipeline) and the simulator checks without processes (simulate()).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "cohort/error.h"

namespace cohort::parallel::pipeline {

/// A program that cannot run: an action missing, repeated or on the wrong rank, or (found by the
/// simulator) a deadlock. The message names the rank and the action.
class ScheduleError : public UsageError {
 public:
  using UsageError::UsageError;
};

/// The pipeline schedules: the order in which each rank runs its stages' forwards and backwards.
enum class ScheduleKind {
  /// All forwards, then all backwards (Huang et al. 2019). Bubble (p-1)/(m+p-1); every rank
  /// holds the activations of all m micro-batches.
  kGPipe,
  /// One forward, one backward (PipeDream-Flush, Narayanan et al. 2021): GPipe's bubble, with at
  /// most p - r micro-batches' activations alive on rank r.
  kOneFOneB,
  /// 1F1B over v virtual stages per rank (Megatron-LM, Narayanan et al. 2021): rank r holds
  /// stages r, r+p, r+2p, ...; bubble (p-1)/(v m + p - 1). Needs m a multiple of p.
  kInterleaved,
  /// ZB-H1 (Qi et al. 2023): 1F1B with the backward split into the input gradient (B), which the
  /// previous stage waits for, and the weight gradient (W), which fills the bubbles. Bubble about
  /// (p-1)(F+B-W)/(m(F+B+W) + (p-1)(F+B-W)): a third of 1F1B's when F = B = W, with at most
  /// p micro-batches' activations alive on every rank (1F1B's peak, rank 0's).
  kZeroBubble,
};
/// "gpipe", "1f1b", "interleaved" or "zero-bubble".
const char* to_string(ScheduleKind kind);
/// "gpipe", "1f1b", "interleaved" or "zero-bubble"; anything else is a UsageError naming the value.
ScheduleKind schedule_from_string(const std::string& name);

/// What a step of a pipeline rank does.
enum class ActionType : uint8_t {
  kForward,
  /// The whole backward of a stage: input and weight gradients.
  kBackward,
  /// Only the gradient of the stage's input (what the previous stage waits for).
  kBackwardInput,
  /// Only the gradients of the stage's parameters (after its kBackwardInput).
  kBackwardWeight,
  /// A stage's output to the next stage's rank; a stage's input gradient to the previous one's.
  kSendActivation,
  kRecvActivation,
  kSendGradient,
  kRecvGradient,
  /// Gradients complete on this rank: reduce them over the data-parallel group, step.
  kOptimizerStep,
};

/// `stage` is the global stage index (0 .. stages - 1), `micro_batch` 0 .. m - 1; both -1 for the
/// optimizer step. Sends are named by the sending stage's (stage, micro-batch), receives by the
/// receiving stage's: kSendActivation (s, m) pairs with kRecvActivation (s + 1, m) and
/// kSendGradient (s, m) with kRecvGradient (s - 1, m).
struct Action {
  ActionType type = ActionType::kForward;  ///< what it does
  int stage = -1;                          ///< the global stage index (-1: the optimizer step)
  int micro_batch = -1;                    ///< the micro-batch (-1: the optimizer step)
  /// Same type, stage and micro-batch.
  bool operator==(const Action&) const = default;
};
/// "forward of stage 2, micro-batch 3", "recv activation of stage 1, micro-batch 0", ...
std::string to_string(const Action& action);
/// Short form for tables: F2.3, B2.3, I2.3 (input gradient), W2.3, sA2.3, rA2.3, sG2.3, rG2.3, OPT.
std::string short_name(const Action& action);

/// Where the stages live: `ranks` pipeline ranks with `virtual_stages` stages each; stage s is on
/// rank s % ranks.
struct PipelineLayout {
  int ranks = 1;           ///< pipeline ranks
  int virtual_stages = 1;  ///< stages per rank (the interleaved schedule's)
  /// All stages.
  int stages() const { return ranks * virtual_stages; }
  /// The rank that holds stage `stage`.
  int rank_of(int stage) const { return stage % ranks; }
  /// This rank's stages, in order: r, r + ranks, r + 2 ranks, ...
  std::vector<int> stages_of(int rank) const;
};

/// What compile_schedule() compiles: the schedule, the layout and the micro-batches.
struct ScheduleOptions {
  ScheduleKind kind = ScheduleKind::kOneFOneB;  ///< the schedule
  PipelineLayout layout;                        ///< where the stages live
  int micro_batches = 4;                        ///< micro-batches per step
};

/// One action list per pipeline rank.
struct Program {
  PipelineLayout layout;                   ///< where the stages live
  int micro_batches = 0;                   ///< micro-batches per step
  std::vector<std::vector<Action>> ranks;  ///< by pipeline rank, its actions in order
};

/// Compiles a schedule: the computation order of every rank, with the sends and receives between
/// ranks inserted (a receive right before the computation that needs it, a send right after the
/// one that produced it) and the optimizer step last. A bad combination (micro-batches < 1, virtual
/// stages with a schedule that has none, interleaving with m not a multiple of p) is a UsageError
/// that says what works.
Program compile_schedule(const ScheduleOptions& options);

/// Checks that a program is complete and consistent: every (stage, micro-batch) has one forward
/// and one backward (or one input and one weight backward after it) on the stage's rank, local
/// order respects the data flow, and every send has its receive. Throws ScheduleError naming the
/// first problem. The simulator also finds deadlocks, which need the ranks' interleaving.
void validate(const Program& program);

}  // namespace cohort::parallel::pipeline

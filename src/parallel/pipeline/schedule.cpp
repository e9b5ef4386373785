#include "cohort/parallel/pipeline/schedule.h"

#include <algorithm>
#include <map>
#include <tuple>

namespace cohort::parallel::pipeline {
namespace {

std::string slot(int stage, int micro_batch) {
  return "stage " + std::to_string(stage) + ", micro-batch " + std::to_string(micro_batch);
}

// ---------------------------------------------------------------------------------------------
// Computation orders, one per rank: forwards and backwards only.

using Order = std::vector<Action>;

Action forward(int stage, int mb) { return {ActionType::kForward, stage, mb}; }
Action backward(int stage, int mb) { return {ActionType::kBackward, stage, mb}; }

std::vector<Order> gpipe(const PipelineLayout& layout, int m) {
  std::vector<Order> orders(static_cast<size_t>(layout.ranks));
  for (int r = 0; r < layout.ranks; ++r) {
    const std::vector<int> stages = layout.stages_of(r);
    for (int stage : stages)
      for (int mb = 0; mb < m; ++mb) orders[r].push_back(forward(stage, mb));
    for (auto it = stages.rbegin(); it != stages.rend(); ++it)
      for (int mb = 0; mb < m; ++mb) orders[r].push_back(backward(*it, mb));
  }
  return orders;
}

std::vector<Order> one_f_one_b(const PipelineLayout& layout, int m) {
  std::vector<Order> orders(static_cast<size_t>(layout.ranks));
  for (int r = 0; r < layout.ranks; ++r) {
    const int warmup = std::min(layout.ranks - r - 1, m);
    Order& order = orders[r];
    for (int mb = 0; mb < warmup; ++mb) order.push_back(forward(r, mb));
    for (int i = 0; i < m - warmup; ++i) {
      order.push_back(forward(r, warmup + i));
      order.push_back(backward(r, i));
    }
    for (int mb = m - warmup; mb < m; ++mb) order.push_back(backward(r, mb));
  }
  return orders;
}

// Megatron-LM's interleaved order: micro-batches go through the rank's v stages in groups of p,
// forwards through stages r, r+p, ..., backwards through them in reverse; a warm-up of
// 2(p-r-1) + (v-1)p forwards, then one forward and one backward.
std::vector<Order> interleaved(const PipelineLayout& layout, int m) {
  const int p = layout.ranks, v = layout.virtual_stages, total = m * v;
  std::vector<Order> orders(static_cast<size_t>(p));
  for (int r = 0; r < p; ++r) {
    auto unit = [&](int k, bool is_forward) {
      const int group = k / (p * v), within = k % (p * v);
      const int chunk = is_forward ? within / p : v - 1 - within / p;
      return Action{is_forward ? ActionType::kForward : ActionType::kBackward, chunk * p + r,
                    group * p + within % p};
    };
    const int warmup = std::min(2 * (p - r - 1) + (v - 1) * p, total);
    Order& order = orders[r];
    for (int k = 0; k < warmup; ++k) order.push_back(unit(k, true));
    for (int i = 0; i < total - warmup; ++i) {
      order.push_back(unit(warmup + i, true));
      order.push_back(unit(i, false));
    }
    for (int k = total - warmup; k < total; ++k) order.push_back(unit(k, false));
  }
  return orders;
}

// ZB-H1 by list scheduling on unit costs: each rank, whenever it is free, runs the first of
//   1. a forward whose input is there, while fewer than p - r micro-batches wait for their input
//      backward on rank r (1F1B's bound) and fewer than p wait for their weight backward (1F1B's
//      peak memory, that of rank 0),
//   2. the input backward whose output gradient has arrived (it unblocks the previous stage),
//   3. a pending weight backward (it needs nothing from other ranks: it fills the bubble).
// This reproduces the schedule of Qi et al.: 1F1B's warm-up, a steady F-B-W rhythm, and weight
// backwards of the later ranks moved into their cool-down, for a bubble of (p-1)(F+B-W).
std::vector<Order> zero_bubble_h1(const PipelineLayout& layout, int m) {
  const int p = layout.ranks;
  // Finish times of each stage's forward and input backward per micro-batch; -1: not yet run.
  std::vector<std::vector<int>> f_done(p, std::vector<int>(m, -1));
  std::vector<std::vector<int>> b_done(p, std::vector<int>(m, -1));
  std::vector<int> next_f(p, 0), next_b(p, 0), next_w(p, 0), busy_until(p, 0);
  std::vector<Order> orders(static_cast<size_t>(p));
  size_t remaining = static_cast<size_t>(3 * p * m);
  for (int t = 0; remaining > 0; ++t) {
    for (int r = 0; r < p; ++r) {
      if (busy_until[r] > t) continue;
      const int fb = next_b[r];
      const bool b_ready =
          fb < next_f[r] &&
          (r == p - 1 ? f_done[r][fb] <= t : b_done[r + 1][fb] >= 0 && b_done[r + 1][fb] <= t);
      const int ff = next_f[r];
      const bool f_ready = ff < m && next_f[r] - next_b[r] < p - r && next_f[r] - next_w[r] < p &&
                           (r == 0 || (f_done[r - 1][ff] >= 0 && f_done[r - 1][ff] <= t));
      if (f_ready) {
        orders[r].push_back(forward(r, ff));
        f_done[r][ff] = t + 1;
        ++next_f[r];
      } else if (b_ready) {
        orders[r].push_back({ActionType::kBackwardInput, r, fb});
        b_done[r][fb] = t + 1;
        ++next_b[r];
      } else if (next_w[r] < next_b[r] && b_done[r][next_w[r]] <= t) {
        orders[r].push_back({ActionType::kBackwardWeight, r, next_w[r]});
        ++next_w[r];
      } else {
        continue;
      }
      busy_until[r] = t + 1;
      --remaining;
    }
  }
  return orders;
}

// Adds the sends and receives between ranks and the optimizer step.
Program with_communication(const PipelineLayout& layout, int m, std::vector<Order> orders) {
  Program program{.layout = layout, .micro_batches = m, .ranks = {}};
  const int last = layout.stages() - 1;
  for (int r = 0; r < layout.ranks; ++r) {
    std::vector<Action> actions;
    auto remote = [&](int stage) { return layout.rank_of(stage) != r; };
    for (const Action& a : orders[r]) {
      const int s = a.stage, mb = a.micro_batch;
      const bool takes_gradient =
          a.type == ActionType::kBackward || a.type == ActionType::kBackwardInput;
      if (a.type == ActionType::kForward && s > 0 && remote(s - 1))
        actions.push_back({ActionType::kRecvActivation, s, mb});
      if (takes_gradient && s < last && remote(s + 1))
        actions.push_back({ActionType::kRecvGradient, s, mb});
      actions.push_back(a);
      if (a.type == ActionType::kForward && s < last && remote(s + 1))
        actions.push_back({ActionType::kSendActivation, s, mb});
      if (takes_gradient && s > 0 && remote(s - 1))
        actions.push_back({ActionType::kSendGradient, s, mb});
    }
    actions.push_back({ActionType::kOptimizerStep, -1, -1});
    program.ranks.push_back(std::move(actions));
  }
  return program;
}

}  // namespace

const char* to_string(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kGPipe:
      return "gpipe";
    case ScheduleKind::kOneFOneB:
      return "1f1b";
    case ScheduleKind::kInterleaved:
      return "interleaved";
    case ScheduleKind::kZeroBubble:
      return "zero-bubble";
  }
  return "?";
}

ScheduleKind schedule_from_string(const std::string& name) {
  for (ScheduleKind kind : {ScheduleKind::kGPipe, ScheduleKind::kOneFOneB,
                            ScheduleKind::kInterleaved, ScheduleKind::kZeroBubble}) {
    if (name == to_string(kind)) return kind;
  }
  throw UsageError("unknown pipeline schedule '" + name +
                   "': use gpipe, 1f1b, interleaved or zero-bubble");
}

std::string to_string(const Action& a) {
  const std::string where = slot(a.stage, a.micro_batch);
  switch (a.type) {
    case ActionType::kForward:
      return "forward of " + where;
    case ActionType::kBackward:
      return "backward of " + where;
    case ActionType::kBackwardInput:
      return "input backward of " + where;
    case ActionType::kBackwardWeight:
      return "weight backward of " + where;
    case ActionType::kSendActivation:
      return "send activation of " + where;
    case ActionType::kRecvActivation:
      return "recv activation of " + where;
    case ActionType::kSendGradient:
      return "send gradient of " + where;
    case ActionType::kRecvGradient:
      return "recv gradient of " + where;
    case ActionType::kOptimizerStep:
      return "optimizer step";
  }
  return "?";
}

std::string short_name(const Action& a) {
  static const char* const prefix[] = {"F", "B", "I", "W", "sA", "rA", "sG", "rG"};
  if (a.type == ActionType::kOptimizerStep) return "OPT";
  return prefix[static_cast<int>(a.type)] + std::to_string(a.stage) + "." +
         std::to_string(a.micro_batch);
}

std::vector<int> PipelineLayout::stages_of(int rank) const {
  std::vector<int> out;
  for (int v = 0; v < virtual_stages; ++v) out.push_back(v * ranks + rank);
  return out;
}

Program compile_schedule(const ScheduleOptions& options) {
  const PipelineLayout& layout = options.layout;
  const int m = options.micro_batches, p = layout.ranks, v = layout.virtual_stages;
  const std::string name = to_string(options.kind);
  if (p < 1) throw UsageError("pipeline ranks must be >= 1, got " + std::to_string(p));
  if (v < 1) throw UsageError("virtual stages per rank must be >= 1, got " + std::to_string(v));
  if (m < 1) {
    throw UsageError("micro-batches must be >= 1, got " + std::to_string(m) +
                     " (use at least the number of pipeline stages, " + std::to_string(p) +
                     ", to keep the bubble small)");
  }
  std::vector<Order> orders;
  switch (options.kind) {
    case ScheduleKind::kGPipe:
      orders = gpipe(layout, m);
      break;
    case ScheduleKind::kOneFOneB:
    case ScheduleKind::kZeroBubble:
      if (v != 1) {
        throw UsageError("schedule " + name + " runs one stage per rank, got " + std::to_string(v) +
                         " virtual stages: use the interleaved schedule for more");
      }
      orders = options.kind == ScheduleKind::kOneFOneB ? one_f_one_b(layout, m)
                                                       : zero_bubble_h1(layout, m);
      break;
    case ScheduleKind::kInterleaved:
      if (v == 1) {
        orders = one_f_one_b(layout, m);
        break;
      }
      if (m % p != 0) {
        const int up = (m + p - 1) / p * p;
        throw UsageError("the interleaved schedule needs micro-batches a multiple of the " +
                         std::to_string(p) + " pipeline ranks, got " + std::to_string(m) +
                         ": use " + std::to_string(up) +
                         (m > p ? " or " + std::to_string(m / p * p) : std::string()) +
                         ", or the 1f1b schedule");
      }
      orders = interleaved(layout, m);
      break;
  }
  Program program = with_communication(layout, m, std::move(orders));
  validate(program);
  return program;
}

void validate(const Program& program) {
  const PipelineLayout& layout = program.layout;
  const int stages = layout.stages(), m = program.micro_batches, last = stages - 1;
  if (static_cast<int>(program.ranks.size()) != layout.ranks) {
    throw ScheduleError("the program has " + std::to_string(program.ranks.size()) +
                        " action lists for " + std::to_string(layout.ranks) + " pipeline ranks");
  }
  // Per (type, stage, micro-batch): the rank and position where it runs.
  std::map<std::tuple<ActionType, int, int>, std::pair<int, size_t>> seen;
  for (int r = 0; r < layout.ranks; ++r) {
    const auto& actions = program.ranks[r];
    auto fail = [&](size_t i, const std::string& why) {
      throw ScheduleError("rank " + std::to_string(r) + ", action " + std::to_string(i) + " (" +
                          to_string(actions[i]) + "): " + why);
    };
    auto done_before = [&](ActionType type, int stage, int mb) {
      const auto it = seen.find({type, stage, mb});
      return it != seen.end() && it->second.first == r;
    };
    for (size_t i = 0; i < actions.size(); ++i) {
      const Action& a = actions[i];
      if (a.type == ActionType::kOptimizerStep) {
        if (i + 1 != actions.size()) fail(i, "the optimizer step must be the last action");
        continue;
      }
      if (a.stage < 0 || a.stage >= stages || a.micro_batch < 0 || a.micro_batch >= m)
        fail(i, "no such stage or micro-batch");
      const int s = a.stage, mb = a.micro_batch;
      const bool on_rank = layout.rank_of(s) == r;
      if (!on_rank)
        fail(i,
             "stage " + std::to_string(s) + " lives on rank " + std::to_string(layout.rank_of(s)));
      if (!seen.emplace(std::tuple{a.type, s, mb}, std::pair{r, i}).second)
        fail(i, "it appears twice");
      const bool local_prev = s > 0 && layout.rank_of(s - 1) == r;
      const bool local_next = s < last && layout.rank_of(s + 1) == r;
      switch (a.type) {
        case ActionType::kForward:
          if (s > 0 && !done_before(local_prev ? ActionType::kForward : ActionType::kRecvActivation,
                                    local_prev ? s - 1 : s, mb))
            fail(i, "its input is not there yet");
          break;
        case ActionType::kBackward:
        case ActionType::kBackwardInput:
          if (!done_before(ActionType::kForward, s, mb)) fail(i, "its forward has not run");
          if (s < last) {
            const bool ok = local_next ? done_before(ActionType::kBackward, s + 1, mb) ||
                                             done_before(ActionType::kBackwardInput, s + 1, mb)
                                       : done_before(ActionType::kRecvGradient, s, mb);
            if (!ok) fail(i, "the gradient of its output is not there yet");
          }
          if (a.type == ActionType::kBackward && done_before(ActionType::kBackwardInput, s, mb))
            fail(i, "the backward is also split into input and weight backwards");
          break;
        case ActionType::kBackwardWeight:
          if (!done_before(ActionType::kBackwardInput, s, mb))
            fail(i, "its input backward has not run");
          break;
        case ActionType::kSendActivation:
          if (s == last || local_next) fail(i, "there is no other rank to send it to");
          if (!done_before(ActionType::kForward, s, mb)) fail(i, "its forward has not run");
          break;
        case ActionType::kSendGradient:
          if (s == 0 || local_prev) fail(i, "there is no other rank to send it to");
          if (!done_before(ActionType::kBackward, s, mb) &&
              !done_before(ActionType::kBackwardInput, s, mb))
            fail(i, "its backward has not run");
          break;
        case ActionType::kRecvActivation:
          if (s == 0 || local_prev) fail(i, "there is no other rank to receive it from");
          break;
        case ActionType::kRecvGradient:
          if (s == last || local_next) fail(i, "there is no other rank to receive it from");
          break;
        case ActionType::kOptimizerStep:
          break;
      }
    }
    if (actions.empty() || actions.back().type != ActionType::kOptimizerStep)
      throw ScheduleError("rank " + std::to_string(r) + " never runs its optimizer step");
  }
  auto has = [&](ActionType type, int s, int mb) { return seen.count({type, s, mb}) > 0; };
  for (int s = 0; s < stages; ++s) {
    const int r = layout.rank_of(s);
    for (int mb = 0; mb < m; ++mb) {
      const std::string where = "rank " + std::to_string(r) + " never runs the ";
      if (!has(ActionType::kForward, s, mb))
        throw ScheduleError(where + to_string(Action{ActionType::kForward, s, mb}));
      const bool whole = has(ActionType::kBackward, s, mb);
      const bool split =
          has(ActionType::kBackwardInput, s, mb) && has(ActionType::kBackwardWeight, s, mb);
      if (!whole && !split)
        throw ScheduleError(where + to_string(Action{ActionType::kBackward, s, mb}));
    }
  }
  // Every message crossing ranks is sent and received.
  for (int s = 0; s < stages; ++s) {
    const int r = layout.rank_of(s);
    for (int mb = 0; mb < m; ++mb) {
      if (s < last && layout.rank_of(s + 1) != r) {
        if (has(ActionType::kSendActivation, s, mb) !=
                has(ActionType::kRecvActivation, s + 1, mb) ||
            !has(ActionType::kSendActivation, s, mb))
          throw ScheduleError("the activation of " + slot(s, mb) +
                              " is not both sent and received");
        if (has(ActionType::kSendGradient, s + 1, mb) != has(ActionType::kRecvGradient, s, mb) ||
            !has(ActionType::kRecvGradient, s, mb))
          throw ScheduleError("the gradient of " + slot(s + 1, mb) +
                              "'s input is not both sent and received");
      }
    }
  }
}

}  // namespace cohort::parallel::pipeline

#include "cohort/parallel/sync_mode.h"

#include <cmath>
#include <exception>

#include "cohort/error.h"
#include "cohort/json.h"

namespace cohort::parallel {

SyncMode parse_sync_mode(const std::string& text) {
  if (text == "ddp") return Synchronous{};
  const auto colon = text.find(':');
  const std::string kind = text.substr(0, colon);
  const std::string usage =
      "choose ddp, local-sgd:H, diloco:H (H: optimizer steps between synchronisations, >= 1) or "
      "async-ps:K (K: steps a worker may run ahead of the slowest, >= 0)";
  if (colon == std::string::npos ||
      (kind != "local-sgd" && kind != "diloco" && kind != "async-ps")) {
    throw UsageError("unknown sync mode '" + text + "': " + usage);
  }
  const std::string digits = text.substr(colon + 1);
  int64_t number = 0;
  size_t used = 0;
  try {
    number = std::stoll(digits, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  const char* what = kind == "async-ps" ? "K" : "H";
  if (digits.empty() || used != digits.size()) {
    throw UsageError("sync mode '" + text + "': " + what + " '" + digits + "' is not an integer; " +
                     usage);
  }
  if (kind == "async-ps") {
    if (number < 0) {
      throw UsageError("sync mode '" + text + "': K " + digits +
                       " must be >= 0 steps a worker may run ahead of the slowest (0: lock-step)");
    }
    return AsyncParameterServer{.max_staleness = number};
  }
  if (number < 1) {
    throw UsageError("sync mode '" + text + "': H " + digits +
                     " must be >= 1 optimizer steps between synchronisations");
  }
  return kind == "local-sgd" ? SyncMode(LocalSgd{.every = number})
                             : SyncMode(DiLoCo{.inner_steps = number});
}

std::string to_string(const SyncMode& mode) {
  if (const auto* local = std::get_if<LocalSgd>(&mode))
    return "local-sgd:" + std::to_string(local->every);
  if (const auto* diloco = std::get_if<DiLoCo>(&mode))
    return "diloco:" + std::to_string(diloco->inner_steps);
  if (const auto* ps = std::get_if<AsyncParameterServer>(&mode))
    return "async-ps:" + std::to_string(ps->max_staleness);
  return "ddp";
}

bool is_synchronous(const SyncMode& mode) { return std::holds_alternative<Synchronous>(mode); }

std::optional<std::string> zero_conflict(const SyncMode& mode, int zero_stage) {
  if (is_synchronous(mode) || zero_stage == 0) return std::nullopt;
  return to_string(mode) + " cannot be combined with ZeRO stage " + std::to_string(zero_stage) +
         ": ZeRO's shards need every replica to step the same gradients";
}

void validate(const SyncMode& mode) {
  if (const auto* local = std::get_if<LocalSgd>(&mode); local && local->every < 1) {
    throw UsageError("local SGD: every " + std::to_string(local->every) +
                     " must be >= 1 optimizer steps between synchronisations");
  }
  if (const auto* d = std::get_if<DiLoCo>(&mode)) {
    if (d->inner_steps < 1) {
      throw UsageError("DiLoCo: inner_steps " + std::to_string(d->inner_steps) +
                       " must be >= 1 optimizer steps between synchronisations");
    }
    if (!std::isfinite(d->outer_lr) || d->outer_lr <= 0) {
      throw UsageError("DiLoCo: outer_lr " + Json(d->outer_lr).dump() +
                       " must be a finite number > 0 (the paper's: 0.7)");
    }
    if (!std::isfinite(d->outer_momentum) || d->outer_momentum < 0 || d->outer_momentum >= 1) {
      throw UsageError("DiLoCo: outer_momentum " + Json(d->outer_momentum).dump() +
                       " must be in [0, 1) (the paper's: 0.9; 0: none)");
    }
  }
  if (const auto* ps = std::get_if<AsyncParameterServer>(&mode)) {
    if (ps->max_staleness < 0) {
      throw UsageError("async parameter server: max_staleness " +
                       std::to_string(ps->max_staleness) +
                       " must be >= 0 steps a worker may run ahead of the slowest (0: lock-step)");
    }
    if (ps->servers < 0) {
      throw UsageError("async parameter server: servers " + std::to_string(ps->servers) +
                       " must be >= 0 (0: ScalingConfig::num_parameter_servers, else 1)");
    }
  }
}

}  // namespace cohort::parallel

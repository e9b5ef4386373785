// Fuzz target: a DeepSpeed JSON config (a program's --deepspeed FILE, cohort train --deepspeed)
// read by cli::load_deepspeed_config into a plan of flags for 1 to 8 workers (the input's first
// byte), then made a train::Plan. A file may be refused with a UsageError naming it; nothing else
// may escape. A file that is taken gives options that each engine's own check accepts (ZeRO, the
// loss scaler, the schedule, activation checkpointing), a batch that adds up, and a plan that
// travels to the workers as JSON (PlanOptions to_json) and reads back as the same plan.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>

#include "cohort/cli/plan_options.h"
#include "cohort/error.h"
#include "cohort/json.h"
#include "memory_file.h"

namespace {

// Runs `check`; a UsageError from it means the decoder let through what the engine refuses.
template <typename F>
void must_accept(F&& check) {
  try {
    check();
  } catch (const cohort::UsageError& e) {
    std::cerr << "taken, then refused: " << e.what() << "\n";
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const int world_size = 1 + data[0] % 8;
  const cohort::fuzz::MemoryFile input(
      std::string(reinterpret_cast<const char*>(data) + 1, size - 1));
  // The warning about ignored keys goes to std::cerr; not the point here.
  std::ostringstream ignored;
  auto* const saved_cerr = std::cerr.rdbuf(ignored.rdbuf());
  cohort::cli::PlanOptions options;
  cohort::train::DeepSpeedConfig ds;
  bool taken = true;
  try {
    ds = cohort::cli::load_deepspeed_config(input.path(), world_size, options);
  } catch (const cohort::UsageError&) {
    taken = false;
  }
  std::cerr.rdbuf(saved_cerr);
  if (!taken) return 0;

  must_accept([&] { ds.zero.validate(); });
  must_accept([&] { ds.loss_scaler.validate(); });
  must_accept([&] { ds.activation_checkpointing.validate(); });
  if (ds.schedule) must_accept([&] { ds.schedule->validate(); });
  if (ds.precision != "fp32" && ds.precision != "bf16" && ds.precision != "fp16") std::abort();
  if (ds.gradient_accumulation_steps < 1 || ds.micro_batch_size < 0) std::abort();
  if (ds.train_batch_size > 0 && ds.micro_batch_size > 0 &&
      ds.train_batch_size != ds.micro_batch_size * ds.gradient_accumulation_steps * world_size)
    std::abort();
  if (!(ds.gradient_clipping >= 0) || !std::isfinite(ds.gradient_clipping)) std::abort();
  if (ds.lr && !std::isfinite(*ds.lr)) std::abort();

  // The plan may still conflict with the world size (a sharding group that does not divide it):
  // refused with a UsageError, as a worker would be.
  try {
    (void)options.plan(world_size);
  } catch (const cohort::UsageError&) {
    return 0;
  }
  // What the driver sends its workers reads back as the same options, and the same plan.
  const cohort::Json sent = options;
  cohort::cli::PlanOptions received;
  must_accept([&] { received = sent.get<cohort::cli::PlanOptions>(); });
  if (cohort::Json(received) != sent) std::abort();
  must_accept([&] { (void)received.plan(world_size); });
  return 0;
}

#include "cohort/cli/loop_options.h"

#include "cohort/error.h"

namespace cohort::cli {

void LoopOptions::validate() const {
  if (epochs < 1) throw UsageError("--epochs " + std::to_string(epochs) + " must be >= 1");
  if (batch_size < 1) {
    throw UsageError("--batch-size " + std::to_string(batch_size) + " must be >= 1");
  }
  if (max_steps < 0) {
    throw UsageError("--max-steps " + std::to_string(max_steps) + " must be >= 0 (0: no limit)");
  }
  if (warmup_steps < 0)
    throw UsageError("--warmup-steps " + std::to_string(warmup_steps) + " must be >= 0");
  if (lr_decay != "none" && lr_decay != "cosine" && lr_decay != "linear")
    throw UsageError("unknown --lr-decay '" + lr_decay + "': choose none, cosine or linear");
}

optim::LrScheduleOptions LoopOptions::lr_schedule(int64_t total_steps) const {
  if (schedule) return *schedule;
  optim::LrScheduleOptions out{
      .warmup_steps = warmup_steps, .decay = lr_decay, .total_steps = total_steps};
  // A run shorter than its warmup decays over what is left: nothing.
  if (out.decay != "none" && out.total_steps <= out.warmup_steps) out.decay = "none";
  return out;
}

void LoopOptions::apply(train::EpochLoopOptions& loop) const {
  loop.epochs = epochs;
  loop.batch_size = batch_size;
  loop.max_steps = max_steps;
}

void to_json(Json& j, const LoopOptions& o) {
  j = Json{{"epochs", o.epochs}, {"batch_size", o.batch_size},     {"max_steps", o.max_steps},
           {"seed", o.seed},     {"warmup_steps", o.warmup_steps}, {"lr_decay", o.lr_decay}};
  if (o.schedule) j["lr_schedule"] = *o.schedule;
}

void from_json(const Json& j, LoopOptions& o) {
  const LoopOptions d;
  o.epochs = json_field(j, "epochs", d.epochs);
  o.batch_size = json_field(j, "batch_size", d.batch_size);
  o.max_steps = json_field(j, "max_steps", d.max_steps);
  o.seed = json_field(j, "seed", d.seed);
  o.warmup_steps = json_field(j, "warmup_steps", d.warmup_steps);
  o.lr_decay = json_field(j, "lr_decay", d.lr_decay);
  o.schedule.reset();
  if (j.contains("lr_schedule")) {
    try {
      o.schedule = j.at("lr_schedule").get<optim::LrScheduleOptions>();
    } catch (const UsageError& e) {
      throw UsageError(std::string("field 'lr_schedule': ") + e.what());
    }
  }
}

void add_loop_options(CLI::App* cmd, LoopOptions& o) {
  cmd->option_defaults()->group("Training");
  cmd->add_option("--epochs", o.epochs, "passes over the training set")->capture_default_str();
  cmd->add_option("--batch-size", o.batch_size, "examples per step per worker")
      ->capture_default_str();
  cmd->add_option("--max-steps", o.max_steps,
                  "stop after this many optimizer steps in all (0: no limit), with a checkpoint "
                  "that a run with more steps resumes from")
      ->capture_default_str();
  cmd->add_option("--seed", o.seed, "seed for weights and data order")->capture_default_str();
  cmd->add_option("--warmup-steps", o.warmup_steps, "linear lr warmup over this many steps")
      ->capture_default_str();
  cmd->add_option("--lr-decay", o.lr_decay,
                  "after the warmup: none, cosine or linear (to 0 at the end of the last epoch)")
      ->capture_default_str();
}

}  // namespace cohort::cli

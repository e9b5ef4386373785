#include "cohort/train/plan.h"

#include <string>
#include <variant>

#include "cohort/error.h"

namespace cohort::train {

namespace pipeline = parallel::pipeline;

int Plan::virtual_stages() const {
  return schedule == pipeline::ScheduleKind::kInterleaved ? 2 : 1;
}

int Plan::micro_batches_per_step() const {
  const int per_batch = micro_batches > 0 ? micro_batches : pp > 1 ? 2 * pp : 1;
  return per_batch * static_cast<int>(std::max<int64_t>(gradient_accumulation_steps, 1));
}

namespace {

// The micro-batches a batch is cut into: --micro-batches with a pipeline, else 1.
int micro_batches_per_batch(const Plan& plan) {
  return plan.micro_batches_per_step() /
         static_cast<int>(std::max<int64_t>(plan.gradient_accumulation_steps, 1));
}

}  // namespace

int64_t Plan::micro_batch_rows(int64_t batch_size) const {
  return std::max<int64_t>(1, batch_size / micro_batches_per_batch(*this));
}

void Plan::check_batch_size(int64_t rows) const {
  const int per_batch = micro_batches_per_batch(*this);
  if (rows < per_batch) {
    throw UsageError("--batch-size " + std::to_string(rows) + " cannot be split into " +
                     std::to_string(per_batch) +
                     " micro-batches (--micro-batches): use a batch of at least " +
                     std::to_string(per_batch) + " rows");
  }
}

OptimizerOffload parse_optimizer_offload(const std::string& text) {
  if (text.empty() || text == "none") return {};
  if (text == "cpu") return {.device = OptimizerOffload::Device::kCpu};
  if (text.rfind("disk:", 0) == 0 && text.size() > 5)
    return {.device = OptimizerOffload::Device::kDisk, .path = text.substr(5)};
  throw UsageError("--offload-optimizer '" + text +
                   "': give none, cpu (host memory) or disk:PATH (files in the folder PATH)");
}

std::string to_string(const OptimizerOffload& offload) {
  switch (offload.device) {
    case OptimizerOffload::Device::kCpu:
      return "cpu";
    case OptimizerOffload::Device::kDisk:
      return "disk:" + offload.path.string();
    case OptimizerOffload::Device::kNone:
      break;
  }
  return "none";
}

void Plan::validate(int world_size) const {
  const auto fail = [](const std::string& message) { throw UsageError(message); };
  if (pp < 1) fail("--pp " + std::to_string(pp) + " must be >= 1 (1: no pipeline)");
  if (tp < 1) fail("--tp " + std::to_string(tp) + " must be >= 1 (1: no tensor parallelism)");
  if (micro_batches < 0) {
    fail("--micro-batches " + std::to_string(micro_batches) + " must be >= 1 (0: 2 x --pp)");
  }
  if (gradient_accumulation_steps < 1) {
    fail("--gradient-accumulation-steps " + std::to_string(gradient_accumulation_steps) +
         " must be >= 1");
  }
  if (gradient_clipping < 0) {
    fail("--gradient-clipping " + std::to_string(gradient_clipping) +
         " must be >= 0 (0: no clipping)");
  }
  zero.validate();
  loss_scaler.validate();
  activation_checkpointing.validate();
  if (offload_optimizer.device == OptimizerOffload::Device::kDisk && offload_optimizer.path.empty())
    fail("--offload-optimizer disk: needs a folder: disk:PATH");
  parallel::validate(sync);
  const std::string sync_flag = "--sync " + parallel::to_string(sync);
  if (zero.shard_group_size > 0 && zero.stage == 0) {
    fail("--shard-group-size " + std::to_string(zero.shard_group_size) +
         " shards ZeRO's state inside groups: use it with --zero-stage 1, 2 or 3");
  }
  if (zero.shard_group_size > 0 && world_size > 0 && world_size % (pp * tp) == 0) {
    const int dp = world_size / (pp * tp);
    if (dp % zero.shard_group_size != 0) {
      fail("--shard-group-size " + std::to_string(zero.shard_group_size) + " does not divide the " +
           std::to_string(dp) + " data-parallel workers (--workers " + std::to_string(world_size) +
           (has_mesh() ? " / (--pp x --tp)" : "") + "): use a divisor of " + std::to_string(dp));
    }
  }
  if (const auto conflict = parallel::zero_conflict(sync, zero.stage))
    fail("--sync " + *conflict + " (--zero-stage); use --zero-stage 0 or --sync ddp");
  if (cuda_graph) {
    // What a captured step can hold: one micro-batch, DDP's all-reduce, no mesh.
    const auto refuse = [&](const std::string& why) { fail("--cuda-graph " + why); };
    if (gradient_accumulation_steps > 1) {
      refuse(
          "captures one micro-batch per step: drop --gradient-accumulation-steps or "
          "--cuda-graph");
    }
    if (has_mesh()) {
      refuse("does not capture pipelines or tensor parallelism: drop --pp/--tp or --cuda-graph");
    }
    if (zero.stage > 0)
      refuse("does not capture ZeRO's steps: use stage 0 (DDP) or drop --cuda-graph");
    if (activation_checkpointing.enabled()) {
      refuse(
          "does not capture checkpointed units (their recomputation reads the random "
          "generators' state on the host): drop --activation-checkpointing or --cuda-graph");
    }
    if (!parallel::is_synchronous(sync)) {
      refuse("needs --sync ddp: " + parallel::to_string(sync) +
             " decides on the host when to communicate");
    }
  }
  if (!has_mesh()) return;
  const std::string flags = "--pp " + std::to_string(pp) + " --tp " + std::to_string(tp);
  if (world_size > 0 && world_size % (pp * tp) != 0) {
    fail(flags + " makes groups of " + std::to_string(pp * tp) +
         " workers, which does not divide --workers " + std::to_string(world_size) +
         ": use --workers a multiple of " + std::to_string(pp * tp));
  }
  // The schedule compiles (e.g. interleaved needs the micro-batches a multiple of pp) for the
  // micro-batches of an optimizer step.
  pipeline::compile_schedule({.kind = schedule,
                              .layout = {.ranks = pp, .virtual_stages = virtual_stages()},
                              .micro_batches = micro_batches_per_step()});
  // What a mesh does not combine with yet.
  const auto refuse = [&](bool set, const std::string& what, const std::string& fix) {
    if (set) fail(what + " with " + flags + " is not supported yet: " + fix);
  };
  refuse(precision == optim::Precision::kFp16, "--precision fp16",
         "the pipeline's loss scaler is not there yet; use --precision bf16 or fp32");
  refuse(std::holds_alternative<parallel::AsyncParameterServer>(sync), sync_flag,
         "the parameter server serves whole models; use --sync ddp, local-sgd:H or diloco:H");
}

std::string Plan::live_recovery_refusal(int world_size) const {
  std::string what;
  // In sharding groups smaller than the group, every shard has replicas in the other groups.
  const bool shards_replicated =
      zero.shard_group_size > 0 && (world_size == 0 || zero.shard_group_size < world_size);
  if (has_mesh()) {
    what = "a pipeline or tensor parallelism (--pp " + std::to_string(pp) + ", --tp " +
           std::to_string(tp) + ": the lost worker's stage or slices live nowhere else)";
  } else if (zero.stage > 0 && !shards_replicated) {
    return "live recovery (--recovery live) cannot go on without a lost worker of ZeRO stage " +
           std::to_string(zero.stage) + " sharded over every worker (--zero-stage: its " +
           (zero.stage == 3 ? "shard of the parameters and " : "") +
           "optimizer shard lives nowhere else): "
           "give each shard a replica with --shard-group-size S (S a divisor of the workers, "
           "below them), or use --recovery restart, with --snapshot-every-steps K to restore "
           "from in-memory snapshots instead of the disk";
  } else if (std::holds_alternative<parallel::AsyncParameterServer>(sync)) {
    what = parallel::to_string(sync) +
           " (--sync: the parameters the lost worker served live nowhere else)";
  } else {
    return "";
  }
  return "live recovery (--recovery live) cannot go on without a lost worker of " + what +
         ": use --recovery restart, with --snapshot-every-steps K to restore from in-memory "
         "snapshots instead of the disk";
}

}  // namespace cohort::train

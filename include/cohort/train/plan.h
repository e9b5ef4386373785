/// \file
/// How a model trains over the workers: the parallel degrees and everything that shapes a step,
/// in one options struct checked in one place (torchtitan's ParallelDims and job config,
/// DeepSpeed's JSON). train::parallelize (parallel_model.h) carries it out.
#pragma once
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

#include "cohort/optim/precision.h"
#include "cohort/parallel/activation_checkpointing_policy.h"
#include "cohort/parallel/pipeline/schedule.h"
#include "cohort/parallel/sync_mode.h"
#include "cohort/parallel/zero_options.h"

namespace cohort::train {

/// Where the optimizer state lives (--offload-optimizer; DeepSpeed's offload_optimizer).
struct OptimizerOffload {
  /// kNone: with the parameters. kCpu: in host memory (on a CPU run it is there already: a no-op,
  /// said once; GPU parameters: not supported yet, a UsageError). kDisk: in files under `path`,
  /// streamed through a chunk at a time (optim::FlatOptimizer::offload_state), CPU state only.
  enum class Device {
    kNone,  ///< with the parameters
    kCpu,   ///< host memory
    kDisk   ///< files under `path`
  };
  Device device = Device::kNone;  ///< see Device
  std::filesystem::path path;     ///< kDisk's folder
};
/// Parses --offload-optimizer: "none", "cpu" or "disk:PATH"; a UsageError naming the text and the
/// forms otherwise.
OptimizerOffload parse_optimizer_offload(const std::string& text);
/// The flag's text of `offload` ("none", "cpu", "disk:/scratch/state").
std::string to_string(const OptimizerOffload& offload);

/// How a model trains over the workers: the parallel degrees, ZeRO, the sync mode, the precision
/// and loss scaling, accumulation, clipping, CUDA-graph capture and the pipeline schedule
/// (`cohort train`'s flags), checked by validate(). train::parallelize carries it out.
struct Plan {
  /// Pipeline stages (--pp) and tensor-parallel degree (--tp); the data-parallel degree is what is
  /// left of the world: world size / (pp x tp). They equal ScalingConfig::mesh's.
  int pp = 1;
  int tp = 1;  ///< tensor-parallel degree (--tp)
  /// ZeRO over the data-parallel group (--zero-stage); stage 0: DDP.
  parallel::ZeroOptions zero;
  /// How the replicas agree (--sync): synchronous DDP or ZeRO, local SGD, DiLoCo, the parameter
  /// server.
  parallel::SyncMode sync;
  /// The numerics of a step (--precision): fp32; bf16 (bfloat16 autocast, CPU or GPU); fp16 (GPU:
  /// float16 autocast and dynamic loss scaling, an overflowing step skipped on every rank).
  /// parallelize makes it the worker's precision, which train::autocast(), backward(),
  /// step_optimizer(), the reports and the checkpoints then follow. Unset: the run's
  /// (ScalingConfig::precision); set, the run's must be fp32 or the same.
  std::optional<optim::Precision> precision;
  /// fp16's dynamic loss scaling (DeepSpeed's "fp16" section), with precision fp16.
  optim::LossScalerOptions loss_scaler;
  /// Micro-batches per optimizer step (--gradient-accumulation-steps): a step's rows are split into
  /// this many, communicating after the last only; with a pipeline, one pipeline step over all
  /// their micro-batches.
  int64_t gradient_accumulation_steps = 1;
  /// The gradients' global L2 norm clipped to this before each step (--gradient-clipping); 0: no
  /// clipping.
  double gradient_clipping = 0;
  /// Each step captured as one CUDA graph and replayed (--cuda-graph): one micro-batch a step,
  /// synchronous DDP, no mesh.
  bool cuda_graph = false;
  /// The pipeline's schedule (--schedule) and micro-batches per batch (--micro-batches; 0: 2 x pp).
  parallel::pipeline::ScheduleKind schedule = parallel::pipeline::ScheduleKind::kOneFOneB;
  int micro_batches = 0;  ///< micro-batches per pipeline step (--micro-batches; 0: 2 x pp)
  /// The units of the model (its parallel::FullyShard layers) that keep only their input in
  /// forward and recompute the rest in backward (--activation-checkpointing); parallelize marks
  /// them, naming a unit the model lacks in a UsageError.
  parallel::ActivationCheckpointing activation_checkpointing;
  /// Where the optimizer state lives (--offload-optimizer): parallelize moves a flat optimizer's
  /// (ZeRO's included) into files for kDisk.
  OptimizerOffload offload_optimizer;

  /// A pipeline or tensor parallelism: the workers form a mesh.
  bool has_mesh() const { return pp > 1 || tp > 1; }
  /// Stages per pipeline rank: the interleaved schedule's two, else one.
  int virtual_stages() const;
  /// How the model's units run, for choosing the ones activation_checkpointing checkpoints:
  /// every:K leaves the last unit plain without a pipeline.
  parallel::UnitChoiceOptions unit_choice() const { return {.pipeline = pp > 1}; }
  /// Micro-batches of one optimizer step through the pipeline: --micro-batches (its default
  /// resolved) times the accumulation steps. Without a pipeline, the accumulation steps.
  int micro_batches_per_step() const;
  /// The rows of one micro-batch of a batch of `batch_size` rows: the batch without a pipeline,
  /// else its share of --micro-batches (at least 1).
  int64_t micro_batch_rows(int64_t batch_size) const;
  /// Checks that a batch of `rows` rows per worker splits into the pipeline's micro-batches (a
  /// smaller batch never steps): a UsageError naming --batch-size, --micro-batches and the
  /// smallest batch.
  void check_batch_size(int64_t rows) const;
  /// Checks the plan for `world_size` workers (0: the degrees alone). A UsageError of one line
  /// names the options that conflict (by their flags) and the fix.
  void validate(int world_size = 0) const;
  /// Why the survivors of this plan cannot go on without a lost worker in the same processes
  /// (FailureConfig::Recovery::kLive), naming the options and the fallback; empty when they can.
  /// Live recovery takes the lost worker's state from a survivor: plans whose every worker holds
  /// the whole state (DDP), or a replica of it (local SGD, DiLoCo), allow it, and ZeRO stages 1
  /// and 2 in sharding groups (zero.shard_group_size below the `world_size` workers: every
  /// shard has a replica in another group). `world_size` 0: the plan's degrees alone, a ZeRO
  /// plan in sharding groups allowed.
  std::string live_recovery_refusal(int world_size = 0) const;
};

}  // namespace cohort::train

/// \file
/// How much memory a plan needs on each worker, before any worker starts (DeepSpeed's
/// estimate_zero2/3_model_states_mem_needs, with the activations measured on the real model):
///
///   auto estimate = train::estimate_memory(spec, plan, {.world_size = 8, .optimizer_states = 2,
///                                                       .activation_bytes = probe});
///   std::cout << estimate.table();
///   estimate.check_budget(int64_t{16} << 30);   // UsageError naming the largest item and the fix
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <torch/nn/module.h>

#include "cohort/train/parallel_model.h"
#include "cohort/train/plan.h"

namespace cohort::train {

/// What estimate_memory needs besides the model and the plan.
struct MemoryEstimateOptions {
  int world_size = 1;  ///< workers
  /// State tensors the optimizer keeps per parameter: Adam and AdamW 2, SGD with momentum 1,
  /// plain SGD 0.
  int optimizer_states = 2;
  /// cohort's flat optimizers (optim::FlatOptimizer) keep a gradient buffer of their own beside
  /// DDP's (ZeRO's engine is the flat optimizer: nothing more there).
  bool flat_optimizer = false;
  /// Bytes one micro-batch's forward and backward need beyond the parameters and gradients, on
  /// the whole model (measure_step_memory); 0: not counted.
  int64_t activation_bytes = 0;
  /// Bytes a worker holds before its model: libtorch, its threads, the communication; 0: not
  /// counted.
  int64_t runtime_bytes = 0;
  /// Checkpoints saved asynchronously (SaveOptions::async): the worker keeps its files' buffers,
  /// the first one the whole model's parameters with its optimizer state.
  bool async_checkpoint = false;
  /// In-memory snapshots (train::snapshot): the same buffers, and on the node's memory-backed
  /// storage the newest two snapshots of the worker's files and two buddy copies of another's.
  bool snapshots = false;
  /// The parameters on a GPU: with --offload-optimizer cpu the optimizer state, the float32
  /// master weights and a copy of the gradients are in host memory (MemoryEstimate::host_bytes),
  /// not among the items (optim::FlatOptimizer::offload_to_host). On a CPU run that option
  /// changes nothing.
  bool gpu = false;
};

/// One item of a worker's memory.
struct MemoryItem {
  /// "parameters", "gradients", "optimizer state", "gathered units", "gradient buckets",
  /// "replica copies", "checkpoint buffers", "activations" or "runtime".
  std::string name;
  int64_t bytes = 0;   ///< on the worker that holds the most (a pipeline's largest stage)
  std::string shrink;  ///< what would make it smaller ("--zero-stage 1 shards it ...")
  /// The option that alone adds this item, which leaving out removes ("in-memory snapshots
  /// (--snapshot-every-steps)", plural: "... hold 4.4 MB of it"); empty where the plan needs the
  /// item, or where two options each need it.
  std::string added_by;
};

/// estimate_memory's answer: the items of the worker that holds the most.
struct MemoryEstimate {
  std::vector<MemoryItem> items;  ///< in the order above; items of 0 bytes left out
  /// With --offload-optimizer disk:PATH, the optimizer state's bytes in files there, per worker
  /// (not in memory: only a chunk of it is, counted in the items).
  int64_t disk_bytes = 0;
  /// With --offload-optimizer cpu and the parameters on a GPU (MemoryEstimateOptions::gpu), the
  /// optimizer state, float32 masters and gradient copy in host memory, per worker (not among the
  /// items).
  int64_t host_bytes = 0;
  /// The sum of the items.
  int64_t total() const;
  /// The largest item other than the runtime (which no option shrinks).
  const MemoryItem& largest() const;
  /// One line per item and the total, in MB, for the log.
  std::string table() const;
  /// A UsageError of one line when total() exceeds `budget_bytes`: both figures, and the option
  /// whose items tip the plan over (the plan fits without them: "in-memory snapshots
  /// (--snapshot-every-steps) hold ... of it"), else the largest item and what would shrink it
  /// (exit code 2 in the CLI).
  void check_budget(int64_t budget_bytes) const;
};

/// The bytes each worker needs to train `model` under `plan` (its parameters, gradients and
/// optimizer state in the plan's layout, ZeRO's gather buffers and buckets, local SGD's and
/// DiLoCo's copies, the activations of the micro-batches a pipeline stage keeps at once), for the
/// worker that holds the most. The forms count what the engines allocate: DDP's gradients are
/// its buckets' views; ZeRO-1 keeps the whole gradient and its shard; ZeRO-2 its shard and at
/// most two buckets in flight (each with a receive buffer on Gloo); ZeRO-3 the shards, the
/// parameters that stay whole (below param_persistence_threshold or outside every unit) and the
/// largest unit with what is prefetched after it. With tensor parallelism the parameters are
/// divided by tp (an upper bound for the parts that are not cut). A plan that does not validate
/// for options.world_size: its UsageError.
MemoryEstimate estimate_memory(const ModelSpec& model, const Plan& plan,
                               const MemoryEstimateOptions& options);

/// The memory `step` (one forward and backward of `module`, in training mode) adds to this
/// process at its peak: the larger of the growth of Linux's resident high-water mark (reset
/// before the step and read after, minus the resident memory before) and the peak of the bytes
/// of the CPU tensors the step allocates (which counts them also where they reuse memory this
/// process already holds). The parameters' gradients are allocated first, so that only the
/// activations and backward's own scratch are counted. The step's allocations are reported to
/// this function, not to libtorch's profiler, when one runs with memory profiling around the
/// call. Linux only; 0 where /proc is not there.
int64_t measure_step_memory(torch::nn::Module& module, const std::function<void()>& step);

/// For --offload-optimizer disk:PATH, before any worker starts: a UsageError of one line when
/// PATH is not a folder, is not writable, or its disk has less room than `bytes` (the state of
/// the workers that share it: the bytes needed and the bytes free named). Nothing for other
/// kinds of offload.
void check_offload_room(const OptimizerOffload& offload, int64_t bytes);

/// The resident memory of process `pid` now (Linux's VmRSS; 0: this process); 0 where /proc is
/// not there or the process is gone.
int64_t resident_bytes(int pid = 0);

/// The most resident memory process `pid` has held (Linux's VmHWM; 0: this process) since it
/// started its program; 0 where /proc is not there or the process is gone. Unlike getrusage's
/// ru_maxrss, it does not carry over the resident memory of the process that started it (a
/// spawned worker's ru_maxrss begins at its driver's), nor of the threads that ended.
int64_t peak_resident_bytes(int pid = 0);

/// Gives back to the system the memory this process's heap holds free (glibc's malloc_trim) and
/// returns how many bytes its resident memory fell by (0 with another C library, and built with
/// AddressSanitizer, whose allocator replaces glibc's heap: nothing is done then). Preparing a
/// model frees the tensors it replaced (DDP's buckets, ZeRO's and the flat optimizers' flat
/// buffers, ZeRO-3's shards) and a checkpoint's load its staging; glibc keeps such blocks in its
/// heap, where tensors of other sizes often do not fit, and a worker's peak then exceeds what it
/// holds by the model's size or more. parallelize, prepare_optimizer, load_checkpoint and
/// ParallelModel::load call it; call it after freeing large tensors of your own (after building
/// a flat optimizer of your own over a prepared model, say).
int64_t release_free_memory();

}  // namespace cohort::train

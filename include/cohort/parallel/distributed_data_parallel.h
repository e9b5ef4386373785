#pragma once
#include <functional>
#include <memory>
#include <string>

#include <torch/nn/module.h>

#include "cohort/comm/process_group.h"

namespace cohort::parallel {

/// Reduces one bucket (a flat buffer of gradients) across the group: when the returned Work has
/// been waited on, `bucket` holds the sum over ranks. DDP then divides by the world size.
using CommHook = std::function<comm::Work(comm::ProcessGroup& group, at::Tensor& bucket)>;

/// The default: all-reduce in the gradients' own dtype.
CommHook allreduce_hook();
/// Compress to float16 / bfloat16 for the wire, sum, and decompress: half the bytes, at the cost
/// of precision (as PyTorch's fp16_compress_hook and bf16_compress_hook).
CommHook fp16_compress_hook();
/// See fp16_compress_hook(): bfloat16 on the wire.
CommHook bf16_compress_hook();

/// How DistributedDataParallel buckets and reduces gradients.
struct DdpOptions {
  /// Gradients travel in flat buckets of at most this size; the first is smaller so that
  /// communication starts early in backward.
  double bucket_cap_mb = 25.0;
  double first_bucket_cap_mb = 1.0;  ///< the first bucket's size
  /// After each synchronised backward rank 0's buffers (batch-norm statistics) are broadcast, so
  /// every rank's next forward uses the same buffers (PyTorch broadcasts before each forward).
  bool broadcast_buffers = true;
  /// Parameters that get no gradient on some rank never block the others, whatever this says.
  /// With it set, a parameter that got no gradient on any rank also keeps an undefined gradient,
  /// so the optimizer skips it exactly as in single-process training (costs one small extra
  /// all-reduce per step); without it such a parameter gets a zero gradient.
  bool find_unused_parameters = false;
  /// Parameters' .grad are views into the buckets: no copy in or out of the communication buffer.
  bool gradient_as_bucket_view = true;
  /// Empty: allreduce_hook().
  CommHook comm_hook;
  /// Every rank takes rank 0's parameters and buffers at construction. Without it the
  /// construction checks the ranks' layouts only, and the replicas start from rank 0's state at
  /// DistributedDataParallel::take_rank0_state(), or from a state every rank loads alike (a
  /// checkpoint): train::parallelize defers it to the first step, which a load makes needless.
  bool take_rank0_state = true;
};

/// Counters for the curious and for benchmarks.
struct DdpStats {
  int64_t synchronized_steps = 0;  ///< backward passes whose gradients were averaged
  int64_t buckets = 0;             ///< buckets in the current layout
  /// Launched while backward was still running (overlapped), vs at the end of backward.
  int64_t buckets_launched_early = 0;
  int64_t buckets_launched_late = 0;  ///< launched at the end of backward
  /// Time the training thread spent waiting for communication at the end of backward.
  double wait_seconds = 0;
  bool buckets_rebuilt =
      false;  ///< whether the buckets were rebuilt in the order gradients arrived
};

/// Data parallelism for any torch::nn::Module (PyTorch's DistributedDataParallel, in C++).
///
/// At construction every rank checks that all ranks built the same parameters (a mismatch names
/// the first differing parameter and the ranks), then takes rank 0's parameters and buffers.
/// During each backward, gradients are gathered in buckets, in the reverse order of registration;
/// a bucket is all-reduced asynchronously as soon as all its gradients are ready, so
/// communication overlaps the rest of backward. After the first step the buckets are rebuilt
/// once in the order gradients really arrived (rank 0's order, so all ranks agree). At the end of
/// backward the averaged gradients are in place, before the user's optimizer step.
class DistributedDataParallel {
 public:
  /// Wraps `module` for data parallelism over `group` (a collective: every rank constructs it at
  /// the same point).
  DistributedDataParallel(std::shared_ptr<torch::nn::Module> module, comm::ProcessGroup group,
                          DdpOptions options = {});
  ~DistributedDataParallel();
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  /// Every rank takes rank 0's parameters and buffers (what the construction does unless
  /// DdpOptions::take_rank0_state is off). Collective.
  void take_rank0_state();

  /// While the guard lives, backward passes accumulate gradients locally without communication
  /// (gradient accumulation); the first backward after it ends synchronises the sum.
  class NoSyncGuard {
   public:
    /// Stops synchronising `ddp`'s backward passes until the guard ends.
    explicit NoSyncGuard(DistributedDataParallel& ddp);
    ~NoSyncGuard();
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    DistributedDataParallel& ddp_;
    bool previous_;
  };
  /// A guard under which backward passes accumulate without communication.
  NoSyncGuard no_sync() { return NoSyncGuard(*this); }

  /// The wrapped module.
  const std::shared_ptr<torch::nn::Module>& module() const;
  /// The group gradients are averaged over.
  const comm::ProcessGroup& process_group() const;
  /// Backward passes whose gradients were averaged.
  int64_t synchronized_steps() const { return stats().synchronized_steps; }
  /// The counters (see DdpStats).
  DdpStats stats() const;

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

}  // namespace cohort::parallel

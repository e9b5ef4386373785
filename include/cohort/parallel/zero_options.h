/// \file
/// ZeRO's options, without libtorch (DeepSpeed JSON, plans and their fuzz targets read them);
/// parallel::ZeroOptimizer is the engine that applies them.
#pragma once
#include <cstdint>

namespace cohort::parallel {

/// ZeRO (Rajbhandari et al. 2020), with DeepSpeed's names and defaults.
struct ZeroOptions {
  /// 0: plain data parallelism (DDP, no ZeRO). 1: the optimizer state is sharded over the ranks.
  /// 2: the gradients too. 3: the parameters too, those of each FullyShard unit of the model
  /// gathered only around its forward and its backward.
  int stage = 0;
  /// Gradients are reduce-scattered in buckets of at most this many elements (a parameter larger
  /// than that is a bucket of its own).
  int64_t reduce_bucket_size = 500'000'000;
  /// After the step, parameters are all-gathered at most this many elements at a time.
  int64_t allgather_bucket_size = 500'000'000;
  /// Reduce-scatter each bucket from the backward hooks as soon as its gradients are ready, so
  /// that communication overlaps the rest of backward; else all buckets at the end of backward.
  bool overlap_comm = true;
  /// After each synchronised backward rank 0's buffers (batch-norm statistics) are broadcast.
  bool broadcast_buffers = true;

  /// Stage 3 (DeepSpeed's stage3_* keys). While a unit runs forward (or backward), the units
  /// that ran after it on the previous step (before it, in backward) are all-gathered ahead,
  /// up to this many elements ahead of it (the units gathered ahead already count), and the
  /// next unit even where it alone is larger (DeepSpeed's rule); 0: none ahead.
  int64_t prefetch_bucket_size = 50'000'000;
  /// Prefetching stops where the gathered units would hold more elements than this; a unit that
  /// is about to run is gathered regardless.
  int64_t max_live_parameters = 1'000'000'000;
  /// A unit with fewer trainable elements than this is not sharded: its parameters stay whole on
  /// every rank, as do those outside every unit (their gradients and state are sharded as at
  /// stage 2).
  int64_t param_persistence_threshold = 100'000;
  /// Sharding groups (HSDP; torchtitan's dp_shard x dp_replicate): the state (and at stage 3 the
  /// parameters) sharded over groups of this many consecutive ranks of the data-parallel group,
  /// and replicated across the groups: a bucket's gradients are reduce-scattered inside a group
  /// and the shard all-reduced across the groups; parameters are all-gathered inside a group
  /// only. Less memory saved than sharding over every rank, collectives that stay inside a node.
  /// 0: one group of every rank (plain ZeRO). Must divide the data-parallel group's size
  /// (--shard-group-size).
  int shard_group_size = 0;
  /// Free a unit's gathered parameters after its forward (gathered again for its backward); false
  /// keeps them from the forward to the end of the backward: one gather less, more memory.
  bool reshard_after_forward = true;

  /// Throws UsageError naming the option: a stage outside 0-3, a bucket size <= 0, a negative
  /// stage-3 limit.
  void validate() const;
};

}  // namespace cohort::parallel

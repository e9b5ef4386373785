/// \file
/// glibc's heap in a training process: how large blocks go back to the system, and the tensor
/// cache that holds a step's activations.
///
/// By default glibc maps each block of 128 KiB or more on its own, but once such a block is
/// freed it raises that threshold to the block's size, up to 32 MiB. From then on the tensors a
/// model is built from (4-32 MiB each in a model of 100 M parameters) come from the heap, and
/// when preparing the model frees them (a flat optimizer's or DDP's buffers replace them, ZeRO
/// shards them) they stay there, resident, in pieces that later tensors of other sizes seldom
/// fill: a DDP worker of a 101 M-parameter GPT peaked 510 MB (22%) higher than with blocks of
/// 4 MiB or more always mapped on their own. A worker therefore maps blocks of 4 MiB or more on
/// their own while it builds and prepares its model, and then takes the policy glibc's own
/// threshold reaches after a few steps (blocks under 32 MiB from the heap, kept for the next
/// step's activations: mapping each step's activations afresh costs a ResNet-18 step a fifth of
/// its speed), with the tensors of 128 KiB to 32 MiB in the tensor cache (install_tensor_cache).
#pragma once

#include <cstdint>

namespace cohort::runtime {

/// Whether this process's heap is glibc's and left to cohort: false with another C library,
/// built with AddressSanitizer (whose allocator replaces glibc's), or when the environment sets
/// any of glibc's malloc tunables (MALLOC_*_ variables, GLIBC_TUNABLES' glibc.malloc.*): the
/// user's choice is then left as it is.
bool heap_is_cohorts();

/// Blocks of 4 MiB or more each mapped on their own, so that freeing them gives them back:
/// for a worker while it builds and prepares its model. Returns false, doing nothing, where
/// heap_is_cohorts() is false.
bool heap_for_setup();

/// The policy for training steps (blocks under 32 MiB from the heap, which keeps up to 64 MiB
/// free at its top; tensors of 128 KiB to 32 MiB from the tensor cache, install_tensor_cache)
/// and what setup left free given back (malloc_trim). Does nothing where heap_is_cohorts() is
/// false.
void heap_for_steps();

/// Makes the tensor cache libtorch's CPU allocator for the rest of the process (once; later
/// calls do nothing). It holds tensors of 128 KiB to 32 MiB (a step's activations) in blocks of
/// eight size classes a power of two, each block mapped on its own: a freed block is kept whole
/// for the next tensor of its class (or of a class down to half its size), never split nor merged
/// with others, so that a step which repeats the last one's shapes takes the same blocks, and
/// what it holds, in use and kept, stays within a tenth above the most ever in use at once (kept
/// blocks of the classes used longest ago are given back first). glibc's heap, which it replaces
/// for them, served each step best fit from what the last one freed, in an order that the
/// collectives' threads' timing changed: two runs of one plan peaked up to 15% apart, and the
/// zoo's GPT (2 workers, batch 64) peaked at 793-808 MB where the cache holds it to 583-587. Other
/// tensors go to libtorch's default CPU allocator. The allocator is one for the process because
/// libtorch's is.
void install_tensor_cache();

/// What the tensor cache holds, in bytes of its blocks (a tensor's size rounded up to its class).
struct TensorCacheStats {
  bool installed = false;       ///< whether it is libtorch's CPU allocator; all else 0 where not
  int64_t live_bytes = 0;       ///< blocks in tensors now
  int64_t cached_bytes = 0;     ///< blocks freed and kept for the next tensor of their class
  int64_t peak_bytes = 0;       ///< the most it has held, in use and kept
  int64_t peak_live_bytes = 0;  ///< the most in use at once
  int64_t hits = 0;             ///< tensors that took a kept block
  int64_t misses = 0;           ///< tensors that mapped a new one
  int64_t evictions = 0;        ///< kept blocks given back to make room for another class
};
/// The tensor cache's figures now (all 0, `installed` false, where it is not installed).
TensorCacheStats tensor_cache_stats();

/// Gives back to the system the blocks the tensor cache keeps (trim_heap does this too). Does
/// nothing where it is not installed.
void release_kept_tensor_blocks();

/// Gives back to the system the memory the heap holds free (glibc's malloc_trim) and the tensor
/// cache's kept blocks, even where the environment tunes malloc. Returns false, doing nothing, with
/// another C library or under AddressSanitizer.
bool trim_heap();

}  // namespace cohort::runtime

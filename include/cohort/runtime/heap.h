/// \file
/// glibc's heap in a training process: how large blocks go back to the system.
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
/// its speed).
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
/// free at its top) and what setup left free given back (malloc_trim). Does nothing where
/// heap_is_cohorts() is false.
void heap_for_steps();

/// Gives back to the system the memory the heap holds free (glibc's malloc_trim), even where the
/// environment tunes malloc. Returns false, doing nothing, with another C library or under
/// AddressSanitizer.
bool trim_heap();

}  // namespace cohort::runtime

#pragma once
#include <cstddef>
#include <cstdint>

namespace cohort {

// The caps on what cohort reads from a peer or a file, each checked before anything is allocated
// for it: a message or header past its cap is an error naming the cap, never an allocation of
// whatever size the input announces.

/// The longest line the coordinator reads from a connection: a longer one closes it (a rank's
/// messages are a few kB; an endless line must not grow the server's memory).
inline constexpr size_t kMaxCoordinatorLine = size_t{1} << 20;
/// The longest frame of the rendezvous store's protocol (1 GiB): a longer announced length closes
/// the connection before anything is buffered for it.
inline constexpr uint32_t kMaxStoreFrame = uint32_t{1} << 30;
/// The most reply bytes the rendezvous store keeps for one client that does not read them
/// (256 MiB): it serves the others meanwhile, and drops that client past this.
inline constexpr size_t kMaxStoreClientBacklog = size_t{256} << 20;
/// The longest JSON header of a safetensors file (100 MiB, the reference implementation's cap).
inline constexpr uint64_t kMaxSafetensorsHeader = uint64_t{100} << 20;
/// The longest JSON header of a data-plane message (64 MiB: a task's row indexes, a batch's
/// column layout): a longer announced length closes the connection before it is buffered.
inline constexpr uint32_t kMaxDataHeader = uint32_t{64} << 20;
/// The most bytes one batch from a preprocessing worker may announce (16 GiB): a larger one is
/// refused before a buffer is allocated for it.
inline constexpr int64_t kMaxDataBlockBytes = int64_t{1} << 34;
/// The most data bytes an IDX file may announce (64 GiB): a header whose dimensions multiply past
/// it is refused before the tensor is allocated.
inline constexpr int64_t kMaxIdxBytes = int64_t{1} << 36;

/// The bytes of a tensor of `sizes` (each >= 0) and `element_bytes` per element, read from a file
/// or a peer, multiplied without overflow: `cap` + 1 when they pass `cap` (0 when a size is 0).
template <typename Sizes>
int64_t bytes_up_to(const Sizes& sizes, int64_t element_bytes, int64_t cap) {
  int64_t bytes = element_bytes;
  for (const auto size : sizes) {
    const auto extent = static_cast<int64_t>(size);
    bytes = extent != 0 && bytes > cap / extent ? cap + 1 : bytes * extent;
  }
  return bytes;
}

}  // namespace cohort

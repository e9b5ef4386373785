#pragma once
#include <cstdint>
#include <string_view>

namespace cohort {

/// The 64-bit FNV-1a hash of `bytes`: the same in every build and on every host, for names made
/// from text (a pipeline's fingerprint, a run's snapshot folder). Not a cryptographic hash.
inline uint64_t fnv1a(std::string_view bytes) {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  return h;
}

}  // namespace cohort

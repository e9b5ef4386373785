#include "cohort/runtime/heap.h"

#include <malloc.h>

#include <cstdlib>
#include <cstring>
#include <initializer_list>

// Built with AddressSanitizer (GCC's macro, clang's feature test), whose allocator replaces
// glibc's: glibc's heap then holds nothing, and malloc_trim would first initialise it, which two
// threads' calls race on (a sanitized test's ranks are threads; one crashed there).
#if defined(__SANITIZE_ADDRESS__)
#define COHORT_HEAP_IS_NOT_GLIBCS 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define COHORT_HEAP_IS_NOT_GLIBCS 1
#endif
#endif
#if !defined(__GLIBC__)
#define COHORT_HEAP_IS_NOT_GLIBCS 1
#endif

namespace cohort::runtime {

namespace {

// While a model is built and prepared: its parameters' blocks (a 1024 x 1024 float32 matrix is
// 4 MiB) mapped on their own.
constexpr int kSetupMmapThreshold = 4 << 20;
// For steps: glibc's own ceiling of its dynamic threshold on 64-bit systems
// (DEFAULT_MMAP_THRESHOLD_MAX), and the trim threshold it sets beside it (twice that).
constexpr int kStepsMmapThreshold = 32 << 20;
constexpr int kStepsTrimThreshold = 2 * kStepsMmapThreshold;

#if !defined(COHORT_HEAP_IS_NOT_GLIBCS)
bool environment_tunes_malloc() {
  for (const char* name : {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                           "MALLOC_MMAP_MAX_", "MALLOC_ARENA_MAX", "MALLOC_ARENA_TEST"}) {
    if (std::getenv(name) != nullptr) return true;
  }
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  return tunables != nullptr && std::strstr(tunables, "glibc.malloc.") != nullptr;
}
#endif

}  // namespace

bool heap_is_cohorts() {
#if defined(COHORT_HEAP_IS_NOT_GLIBCS)
  return false;
#else
  return !environment_tunes_malloc();
#endif
}

bool heap_for_setup() {
#if defined(COHORT_HEAP_IS_NOT_GLIBCS)
  return false;
#else
  return heap_is_cohorts() && ::mallopt(M_MMAP_THRESHOLD, kSetupMmapThreshold) == 1;
#endif
}

void heap_for_steps() {
#if !defined(COHORT_HEAP_IS_NOT_GLIBCS)
  if (!heap_is_cohorts()) return;
  ::mallopt(M_MMAP_THRESHOLD, kStepsMmapThreshold);
  ::mallopt(M_TRIM_THRESHOLD, kStepsTrimThreshold);
  ::malloc_trim(0);
  install_tensor_cache();
#endif
}

bool trim_heap() {
#if defined(COHORT_HEAP_IS_NOT_GLIBCS)
  return false;
#else
  release_kept_tensor_blocks();
  ::malloc_trim(0);
  return true;
#endif
}

}  // namespace cohort::runtime

#include "cohort/runtime/heap.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

namespace cohort::runtime {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

// This process's resident bytes (the second field of /proc/self/statm, in pages).
int64_t resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t size = 0, resident = 0;
  statm >> size >> resident;
  return resident * ::sysconf(_SC_PAGESIZE);
}

// A block of `bytes` from malloc, each of its pages written, so that it is resident.
void* touched_block(size_t bytes) {
  auto* block = static_cast<volatile char*>(std::malloc(bytes));
  for (size_t i = 0; i < bytes; i += 4096) block[i] = 1;
  return const_cast<char*>(block);
}

// Sets an environment variable for one scope and puts back what was there.
class ScopedVariable {
 public:
  ScopedVariable(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) saved_ = old;
    ::setenv(name, value, 1);
  }
  ~ScopedVariable() {
    if (saved_) {
      ::setenv(name_, saved_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> saved_;
};

constexpr const char* kNotCohorts =
    "this process's heap is not glibc's, is AddressSanitizer's, or the environment tunes glibc's "
    "malloc: cohort leaves it alone";

// A model's construction: blocks of 8 MiB (its parameters) between small ones that stay, then
// freed when preparing it replaces them. glibc's default would serve them from its heap (a
// mapped block freed before raised its threshold) and keep them there, resident.
TEST(Heap, BlocksFreedDuringSetupGoBackToTheSystem) {
  if (!heap_is_cohorts()) GTEST_SKIP() << kNotCohorts;
  ASSERT_TRUE(heap_for_setup());
  std::free(touched_block(16 * kMiB));  // what raises glibc's own threshold to 16 MiB
  std::vector<void*> parameters, small;
  for (int i = 0; i < 32; ++i) {
    parameters.push_back(touched_block(8 * kMiB));
    small.push_back(touched_block(256 * 1024));
  }
  const int64_t held = resident_bytes();
  for (void* p : parameters) std::free(p);
  const int64_t given_back = held - resident_bytes();
  EXPECT_GE(given_back, static_cast<int64_t>(32 * 8 * kMiB * 9 / 10))
      << "freeing 256 MiB of 8 MiB blocks gave back " << given_back / kMiB << " MiB";
  for (void* p : small) std::free(p);
}

// A step's activations: a block under 32 MiB freed stays in the heap, and the next step's block
// of that size takes it without new pages.
TEST(Heap, StepsKeepBlocksUnder32MiBForTheNextStep) {
  if (!heap_is_cohorts()) GTEST_SKIP() << kNotCohorts;
  heap_for_steps();
  void* activation = touched_block(8 * kMiB);
  void* kept = touched_block(256 * 1024);
  const int64_t held = resident_bytes();
  std::free(activation);
  EXPECT_GE(resident_bytes(), held - static_cast<int64_t>(kMiB))
      << "an 8 MiB block freed between steps went back to the system";
  void* next = touched_block(8 * kMiB);
  EXPECT_LE(resident_bytes(), held + static_cast<int64_t>(kMiB))
      << "the next step's 8 MiB block took new pages instead of the freed one's";
  std::free(next);
  std::free(kept);
}

// A user who tunes glibc's malloc through the environment keeps that choice.
TEST(Heap, MallocTunedByTheEnvironmentIsLeftAlone) {
  const bool cohorts = heap_is_cohorts();
  {
    const ScopedVariable arenas("MALLOC_ARENA_MAX", "2");
    EXPECT_FALSE(heap_is_cohorts());
    EXPECT_FALSE(heap_for_setup());
  }
  {
    const ScopedVariable tunables("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=65536");
    EXPECT_FALSE(heap_is_cohorts());
    EXPECT_FALSE(heap_for_setup());
  }
  {
    // Tunables of glibc's other parts leave the heap to cohort.
    const ScopedVariable tunables("GLIBC_TUNABLES", "glibc.rtld.nns=2");
    EXPECT_EQ(heap_is_cohorts(), cohorts);
  }
}

}  // namespace
}  // namespace cohort::runtime

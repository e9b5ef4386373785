#include "cohort/runtime/heap.h"

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <thread>
#include <vector>

#include "support/scoped_variable.h"

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

using cohort::testing::ScopedVariable;

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

// A float tensor of `bytes`, every element written (its pages resident).
at::Tensor written_tensor(size_t bytes, float value = 1) {
  return at::full({static_cast<int64_t>(bytes / sizeof(float))}, value, at::kFloat);
}

// The cache for a step's activations, where the heap is cohort's (heap_for_steps installs it),
// holding no kept blocks (what earlier tests in this process left).
bool tensor_cache_here() {
  if (!heap_is_cohorts()) return false;
  install_tensor_cache();
  release_kept_tensor_blocks();
  return tensor_cache_stats().installed && tensor_cache_stats().cached_bytes == 0;
}

// Two steps of one model's shapes, their tensors freed in other orders (as the collectives'
// threads' timing changes it): the second takes the first's blocks, maps none, holds no more.
TEST(TensorCache, AStepThatRepeatsTheLastOnesShapesTakesItsBlocks) {
  if (!tensor_cache_here()) GTEST_SKIP() << kNotCohorts;
  const std::vector<size_t> sizes = {6 * kMiB, 3 * kMiB / 2, 2 * kMiB,   200 * 1024, 6 * kMiB,
                                     5 * kMiB, 3 * kMiB / 2, 300 * 1024, 12 * kMiB};
  auto step = [&](const std::vector<size_t>& free_order) {
    std::vector<at::Tensor> activations;
    for (size_t bytes : sizes) activations.push_back(written_tensor(bytes));
    for (size_t i : free_order) activations[i].reset();
  };
  step({0, 1, 2, 3, 4, 5, 6, 7, 8});
  const auto first = tensor_cache_stats();
  step({8, 3, 5, 0, 7, 1, 6, 4, 2});
  step({4, 6, 2, 8, 0, 3, 1, 5, 7});
  const auto third = tensor_cache_stats();
  EXPECT_EQ(third.misses, first.misses) << "a repeated step mapped new blocks";
  EXPECT_EQ(third.hits - first.hits, static_cast<int64_t>(2 * sizes.size()));
  EXPECT_EQ(third.peak_bytes, first.peak_bytes);
  EXPECT_EQ(third.live_bytes, first.live_bytes);
}

// A freed block serves the next tensor of its class (3 MiB less 8 KiB rounds up to 3 MiB's).
TEST(TensorCache, AFreedBlockServesTheNextTensorOfItsClass) {
  if (!tensor_cache_here()) GTEST_SKIP() << kNotCohorts;
  auto activation = written_tensor(3 * kMiB);
  const void* block = activation.data_ptr();
  const auto before = tensor_cache_stats();
  activation.reset();
  EXPECT_EQ(tensor_cache_stats().cached_bytes,
            before.cached_bytes + static_cast<int64_t>(3 * kMiB));
  const auto next = written_tensor(3 * kMiB - 8 * 1024, 2);
  EXPECT_EQ(next.data_ptr(), block);
  EXPECT_EQ(tensor_cache_stats().hits, before.hits + 1);
  EXPECT_EQ(next[0].item<float>(), 2);
}

// trim_heap gives the kept blocks back, as it gives back what glibc's heap holds free.
TEST(TensorCache, TrimHeapGivesTheKeptBlocksBack) {
  if (!tensor_cache_here()) GTEST_SKIP() << kNotCohorts;
  written_tensor(16 * kMiB).reset();
  ASSERT_EQ(tensor_cache_stats().cached_bytes, static_cast<int64_t>(16 * kMiB));
  const int64_t held = resident_bytes();
  ASSERT_TRUE(trim_heap());
  EXPECT_EQ(tensor_cache_stats().cached_bytes, 0);
  EXPECT_LE(resident_bytes(), held - static_cast<int64_t>(15 * kMiB));
}

// Another class's tensors, where the kept blocks and those in use would pass a tenth above the
// most ever in use at once: kept blocks are given back first, so the cache holds no more.
TEST(TensorCache, KeptBlocksMakeRoomForAnotherClass) {
  if (!tensor_cache_here()) GTEST_SKIP() << kNotCohorts;
  std::vector<at::Tensor> small;
  for (int i = 0; i < 4; ++i) small.push_back(written_tensor(2 * kMiB));
  small.clear();  // 8 MiB kept in 2 MiB blocks
  const auto before = tensor_cache_stats();
  std::vector<at::Tensor> large;
  for (int i = 0; i < 3; ++i) large.push_back(written_tensor(5 * kMiB));
  const auto after = tensor_cache_stats();
  EXPECT_LE(after.live_bytes + after.cached_bytes, after.peak_live_bytes * 11 / 10);
  const int64_t most_in_use = std::max(before.peak_live_bytes, after.live_bytes);
  if (before.live_bytes + before.cached_bytes + static_cast<int64_t>(15 * kMiB) >
      most_in_use * 11 / 10) {
    EXPECT_GT(after.evictions, before.evictions);
  }
}

// Tensors of 32 MiB or more go to libtorch's default allocator (glibc maps them on their own in
// a worker's steps and gives them back when freed), and so do those under 128 KiB.
TEST(TensorCache, TensorsOutsideItsRangeAreNotKept) {
  if (!tensor_cache_here()) GTEST_SKIP() << kNotCohorts;
  const auto before = tensor_cache_stats();
  written_tensor(40 * kMiB).reset();
  written_tensor(64 * 1024).reset();
  const auto after = tensor_cache_stats();
  EXPECT_EQ(after.cached_bytes, before.cached_bytes);
  EXPECT_EQ(after.misses + after.hits, before.misses + before.hits);
}

// oneDNN's allocations (ideep: the CPU allocator's raw_allocate and raw_deallocate), the
// cache's and the default allocator's, including a block from before the cache was installed.
TEST(TensorCache, RawBlocksComeBackToWhereTheyCameFrom) {
  void* from_before = c10::GetDefaultCPUAllocator()->raw_allocate(4 * kMiB);
  if (!tensor_cache_here()) {
    c10::GetDefaultCPUAllocator()->raw_deallocate(from_before);
    GTEST_SKIP() << kNotCohorts;
  }
  auto* allocator = c10::GetCPUAllocator();
  const auto before = tensor_cache_stats();
  void* cached = allocator->raw_allocate(4 * kMiB);
  void* small = allocator->raw_allocate(1024);
  EXPECT_EQ(tensor_cache_stats().live_bytes, before.live_bytes + static_cast<int64_t>(4 * kMiB));
  allocator->raw_deallocate(cached);
  allocator->raw_deallocate(small);
  allocator->raw_deallocate(from_before);
  const auto after = tensor_cache_stats();
  EXPECT_EQ(after.live_bytes, before.live_bytes);
  EXPECT_EQ(after.cached_bytes, before.cached_bytes + static_cast<int64_t>(4 * kMiB));
}

// Threads that allocate and free at once (the collectives' threads free what the step's made):
// each tensor keeps what it was given, and every block comes back.
TEST(TensorCache, ThreadsShareItSafely) {
  if (!tensor_cache_here()) GTEST_SKIP() << kNotCohorts;
  const auto before = tensor_cache_stats();
  std::vector<std::thread> threads;
  std::vector<int> wrong(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([t, &wrong] {
      for (int i = 0; i < 200; ++i) {
        const size_t bytes = (size_t{256} << 10) * static_cast<size_t>(1 + (i + t) % 7);
        auto a = written_tensor(bytes, static_cast<float>(t));
        auto b = written_tensor(bytes / 2, static_cast<float>(t + 10));
        if (a.min().item<float>() != t || b.max().item<float>() != t + 10) ++wrong[t];
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (int t = 0; t < 4; ++t) EXPECT_EQ(wrong[t], 0) << "thread " << t;
  EXPECT_EQ(tensor_cache_stats().live_bytes, before.live_bytes);
}

}  // namespace
}  // namespace cohort::runtime

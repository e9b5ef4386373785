// The tensor cache: libtorch's CPU allocator for a worker's steps (runtime::heap_for_steps).
//
// glibc's heap serves a step's activations (blocks of 128 KiB to 32 MiB) best fit from what the
// last step freed, splitting larger free blocks and merging neighbours, so how much it grows
// depends on the order the tensors were freed in and on what it held before. Two runs of one plan
// peaked up to 15% apart (the zoo's CNN under ZeRO-1, 2 workers: 221-258 MB; the collectives'
// threads' timing changes the order), and a single worker's peak, the same from run to run,
// moved by 25 MB with the plans its driver had run before it. This cache never splits or merges:
// a freed block waits, whole, for the next tensor of its size class (or of a class down to half
// its size), and what it keeps beside the blocks in use stays within a tenth above the most ever
// in use at once, so that a step which repeats the last one's shapes takes the same blocks and
// maps no new pages.
#include "cohort/runtime/heap.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <sys/mman.h>
#include <torch/version.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cohort/runtime/allocator.h"

namespace cohort::runtime {

namespace {

constexpr size_t kPageBytes = 4096;

// Blocks in [kSmallestCached, kLargestCached) are cached: glibc's heap keeps smaller ones well
// (its bins hold blocks of one size), and maps larger ones on their own in a worker's steps
// (heap_for_steps' threshold), which gives them back when they are freed: a checkpoint's
// temporary copy of a large state does not stay resident.
constexpr size_t kSmallestCached = size_t{128} << 10;
constexpr size_t kLargestCached = size_t{32} << 20;

// What the cache may hold, in use and kept, where `peak_live` bytes were the most in use at once.
// Kept to that alone, a step whose tensors of one class give way to another's later gave back
// and mapped blocks every step (ResNet-18 under DDP, 2 workers: 17% slower than glibc's heap); a
// tenth more keeps them (as fast as glibc's heap).
int64_t ceiling_above(int64_t peak_live) { return peak_live + peak_live / 10; }

// Eight size classes a power of two: a new block is at most an eighth larger than its tensor, and
// the pages past the tensor's end are resident only once a larger tensor used them.
size_t size_class(size_t bytes) {
  const int top_bit = 63 - __builtin_clzll(static_cast<unsigned long long>(bytes));
  const size_t step = std::max(kPageBytes, size_t{1} << (top_bit - 3));
  return (bytes + step - 1) / step * step;
}

class TensorCache final : public c10::Allocator {
 public:
  explicit TensorCache(c10::Allocator* fallback) : fallback_(fallback) {}

  c10::DataPtr allocate(size_t bytes) COHORT_ALLOCATE_CONST override {
    if (bytes < kSmallestCached || bytes >= kLargestCached) return fallback_->allocate(bytes);
    void* data = const_cast<TensorCache*>(this)->take(size_class(bytes));
    if (data == nullptr) return fallback_->allocate(bytes);  // no mapping to be had
    return {data, data, &give_back_to_the_cache, c10::Device(c10::DeviceType::CPU)};
  }

  // Gives every kept block back to the system.
  void release_kept() {
    std::vector<std::pair<void*, size_t>> unmapped;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto& [bytes, c] : classes_) {
        for (void* block : c.free) unmapped.emplace_back(block, bytes);
        stats_.cached_bytes -= static_cast<int64_t>(bytes * c.free.size());
        c.free.clear();
      }
    }
    for (const auto& [block, bytes] : unmapped) ::munmap(block, bytes);
  }

  // raw_allocate's blocks (oneDNN's, through ideep) come back here: the cache's own, and the
  // fallback's, which the default CPU allocator made (before the cache was installed, or too
  // small or large for it).
  c10::DeleterFnPtr raw_deleter() const override { return &give_back_to_the_cache; }

#if COHORT_ALLOCATOR_COPIES_DATA
  void copy_data(void* destination, const void* source, std::size_t count) const override {
    default_copy_data(destination, source, count);
  }
#endif

  TensorCacheStats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    auto s = stats_;
    s.installed = true;
    return s;
  }

  static TensorCache& instance() {
    // Never destroyed: tensors freed while the process exits still come back to it.
    static auto* cache = new TensorCache(c10::GetDefaultCPUAllocator());
    return *cache;
  }

 private:
  struct SizeClass {
    std::vector<void*> free;
    uint64_t last_used = 0;  // the cache's tick when a block of it was last taken or given back
  };

  static void give_back_to_the_cache(void* data) { instance().give_back(data); }

  void* take(size_t bytes) {
    std::unique_lock<std::mutex> lock(mutex_);
    classes_[bytes].last_used = ++tick_;
    void* data = nullptr;
    size_t block_bytes = bytes;
    // The smallest kept block of its class or one up to twice its size: its pages are resident
    // already, where a new block's would be more.
    for (auto it = classes_.lower_bound(bytes); it != classes_.end() && it->first <= 2 * bytes;
         ++it) {
      if (it->second.free.empty()) continue;
      data = it->second.free.back();
      it->second.free.pop_back();
      it->second.last_used = tick_;
      block_bytes = it->first;
      break;
    }
    if (data != nullptr) {
      stats_.cached_bytes -= static_cast<int64_t>(block_bytes);
      ++stats_.hits;
    } else {
      // Held plus kept stays within a tenth above the most ever held at once: kept blocks of the
      // classes used longest ago make room before a new one is mapped.
      const int64_t need = static_cast<int64_t>(bytes);
      const int64_t ceiling =
          ceiling_above(std::max(stats_.peak_live_bytes, stats_.live_bytes + need));
      std::vector<std::pair<void*, size_t>> unmapped;
      while (stats_.cached_bytes > 0 && stats_.live_bytes + stats_.cached_bytes + need > ceiling) {
        SizeClass* oldest = nullptr;
        size_t oldest_bytes = 0;
        for (auto& [class_bytes, c] : classes_) {
          if (!c.free.empty() && (oldest == nullptr || c.last_used < oldest->last_used)) {
            oldest = &c;
            oldest_bytes = class_bytes;
          }
        }
        unmapped.emplace_back(oldest->free.back(), oldest_bytes);
        oldest->free.pop_back();
        stats_.cached_bytes -= static_cast<int64_t>(oldest_bytes);
        ++stats_.evictions;
      }
      lock.unlock();
      for (const auto& [block, unmapped_bytes] : unmapped) ::munmap(block, unmapped_bytes);
      data = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      lock.lock();
      if (data == MAP_FAILED) return nullptr;
      ++stats_.misses;
    }
    live_.emplace(data, block_bytes);
    stats_.live_bytes += static_cast<int64_t>(block_bytes);
    stats_.peak_live_bytes = std::max(stats_.peak_live_bytes, stats_.live_bytes);
    stats_.peak_bytes = std::max(stats_.peak_bytes, stats_.live_bytes + stats_.cached_bytes);
    report(data, static_cast<int64_t>(block_bytes));
    return data;
  }

  // To libtorch's profiler, where it profiles memory on this thread (as the default CPU
  // allocator does; train::measure_step_memory counts a step's tensors so).
  void report(void* data, int64_t bytes) {
    c10::reportMemoryUsageToProfiler(data, bytes, stats_.live_bytes,
                                     stats_.live_bytes + stats_.cached_bytes,
                                     c10::Device(c10::DeviceType::CPU));
  }

  void give_back(void* data) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = live_.find(data);
      if (it != live_.end()) {
        const size_t bytes = it->second;
        report(data, -static_cast<int64_t>(bytes));
        live_.erase(it);
        auto& cls = classes_[bytes];
        cls.free.push_back(data);
        cls.last_used = ++tick_;
        stats_.live_bytes -= static_cast<int64_t>(bytes);
        stats_.cached_bytes += static_cast<int64_t>(bytes);
        return;
      }
    }
    fallback_->raw_deleter()(data);  // the default CPU allocator's
  }

  c10::Allocator* fallback_;
  std::mutex mutex_;
  std::unordered_map<void*, size_t> live_;  // the cache's blocks in tensors: their class bytes
  std::map<size_t, SizeClass> classes_;
  uint64_t tick_ = 0;
  TensorCacheStats stats_;
};

}  // namespace

void install_tensor_cache() {
  static const bool installed = [] {
    c10::SetCPUAllocator(&TensorCache::instance(), /*priority=*/1);
    return true;
  }();
  (void)installed;
}

void release_kept_tensor_blocks() {
  if (c10::GetCPUAllocator() == &TensorCache::instance()) TensorCache::instance().release_kept();
}

TensorCacheStats tensor_cache_stats() {
  if (c10::GetCPUAllocator() != &TensorCache::instance()) return {};
  return TensorCache::instance().stats();
}

}  // namespace cohort::runtime

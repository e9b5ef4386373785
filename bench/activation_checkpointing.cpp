// Activation checkpointing on the CPU: peak activation memory and step time of the zoo's
// ResNet-18, ViT and GPT at batch 128 (images of Fashion-MNIST's shape, 1 x 28 x 28; the GPT's
// default rows of 128 tokens, 4 blocks of width 128), without checkpointing
// and with each policy given. The variants run interleaved, round by round; the step time is the
// median over rounds.
//
// Activation memory is measured, not estimated: this program counts every byte the CPU allocator
// hands out (c10::SetCPUAllocator with a counting wrapper around the one a worker steps with). A
// step's activation memory is the peak of the bytes live during its forward and backward minus the
// bytes live before its forward (the parameters, gradients and optimizer state, and the batch):
// it includes backward's own gradients and scratch, and a checkpointed unit's recomputed
// activations. "held" is what the forward left live for backward (the bytes live after it, minus
// those before).
//
// Prints a table, then one JSON line per model and policy.
#include <c10/core/CPUAllocator.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <iomanip>
#include <iostream>
#include <mutex>
#include <unordered_map>

#include "cohort/cohort.h"
#include "cohort/models/zoo.h"
#include "cohort/runtime/allocator.h"
#include "cohort/runtime/blas.h"
#include "cohort/runtime/heap.h"

namespace {

using Clock = std::chrono::steady_clock;

// The default CPU allocator, with the bytes it has live and their peak since reset_peak(). Its
// pointers are their own context (libtorch's raw_allocate asks that): the default allocator's
// allocation behind each is kept in a map until it is freed.
class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(size_t bytes) COHORT_ALLOCATE_CONST override {
    c10::DataPtr inner = base_->allocate(bytes);
    void* data = inner.get();
    {
      std::lock_guard lock(mutex_);
      live_ += static_cast<int64_t>(bytes);
      peak_ = std::max(peak_, live_);
      allocations_.emplace(data, std::make_pair(std::move(inner), static_cast<int64_t>(bytes)));
    }
    return {data, data, &release, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
#if COHORT_ALLOCATOR_COPIES_DATA
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
#endif

  int64_t live() const {
    std::lock_guard lock(mutex_);
    return live_;
  }
  int64_t peak() const {
    std::lock_guard lock(mutex_);
    return peak_;
  }
  void reset_peak() {
    std::lock_guard lock(mutex_);
    peak_ = live_;
  }

  static CountingAllocator* instance;

 private:
  static void release(void* data) {
    if (data == nullptr) return;
    c10::DataPtr inner;
    {
      std::lock_guard lock(instance->mutex_);
      auto it = instance->allocations_.find(data);
      if (it == instance->allocations_.end()) return;
      instance->live_ -= it->second.second;
      inner = std::move(it->second.first);
      instance->allocations_.erase(it);
    }
    // `inner` frees the memory here, outside the lock.
  }

  c10::Allocator* base_;
  mutable std::mutex mutex_;
  mutable int64_t live_ = 0, peak_ = 0;
  mutable std::unordered_map<void*, std::pair<c10::DataPtr, int64_t>> allocations_;
};
CountingAllocator* CountingAllocator::instance = nullptr;

struct Variant {
  std::string policy;  // "none", "every:1", ...
  cohort::models::ZooModel model;
  std::unique_ptr<torch::optim::SGD> optimizer;
  std::vector<double> step_ms;
  int64_t activation_bytes = 0;  // peak over forward and backward
  int64_t held_bytes = 0;        // what the forward left for backward
  double loss = 0;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app(
      "Activation checkpointing: peak activation memory and step time with and without, on the "
      "CPU");
  std::vector<std::string> models{"resnet18", "vit", "gpt"};
  std::vector<std::string> policies{"every:1", "every:2"};
  int64_t batch = 128;
  int rounds = 5;
  int threads = 0;
  app.add_option("--models", models, "zoo models")->capture_default_str();
  app.add_option("--policies", policies, "--activation-checkpointing policies, each against none")
      ->capture_default_str();
  app.add_option("--batch-size", batch, "rows per step")->capture_default_str();
  app.add_option("--rounds", rounds, "timed rounds (each variant one step per round)")
      ->capture_default_str();
  app.add_option("--threads", threads, "torch threads (0: torch's default)");
  CLI11_PARSE(app, argc, argv);
  // Every model and policy checked before any step: an unknown model or unit is one line, not
  // an exception after minutes of the models before it.
  try {
    for (const auto& name : models) {
      const auto model = cohort::models::create_model(name);
      for (const auto& policy : policies) {
        cohort::parallel::checkpointed_units(
            *model, cohort::parallel::parse_activation_checkpointing(policy));
      }
    }
  } catch (const cohort::UsageError& e) {
    std::cerr << "activation_checkpointing: " << e.what() << std::endl;
    return 2;
  }

  // The heap a worker steps under (runtime/heap.h): tensors of 128 KiB to 32 MiB from the tensor
  // cache, which keeps a step's blocks for the next. Under glibc's heap alone the GPT's larger
  // activations were mapped afresh each step, and their page faults were most of a step's time.
  cohort::runtime::heap_for_steps();
  static CountingAllocator counting(c10::GetCPUAllocator());
  CountingAllocator::instance = &counting;
  c10::SetCPUAllocator(&counting, /*priority=*/100);
  if (threads > 0) torch::set_num_threads(threads);
  std::cout << "activation checkpointing, CPU, batch " << batch << ", " << rounds
            << " rounds, torch threads " << torch::get_num_threads() << ", libtorch "
            << TORCH_VERSION << ", BLAS " << cohort::runtime::blas_library().name << std::endl;
  std::cout << std::left << std::setw(10) << "model" << std::setw(10) << "policy" << std::right
            << std::setw(8) << "units" << std::setw(16) << "activation MB" << std::setw(10)
            << "vs none" << std::setw(12) << "held MB" << std::setw(12) << "step ms"
            << std::setw(10) << "vs none" << std::setw(14) << "same loss" << std::endl;
  for (const auto& name : models) {
    torch::manual_seed(0);
    // Images of Fashion-MNIST's shape, or the GPT's tokens (its default: 128 of them a row).
    const auto [x, y] = cohort::models::create_model(name)->sample_batch(batch);
    std::vector<Variant> variants;
    std::vector<std::string> all{"none"};
    all.insert(all.end(), policies.begin(), policies.end());
    std::vector<size_t> units;
    for (const auto& policy : all) {
      torch::manual_seed(1);
      Variant v{.policy = policy, .model = cohort::models::create_model(name)};
      units.push_back(cohort::parallel::apply_activation_checkpointing(
                          *v.model, cohort::parallel::parse_activation_checkpointing(policy))
                          .size());
      v.optimizer = std::make_unique<torch::optim::SGD>(
          v.model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
      variants.push_back(std::move(v));
    }
    // Round 0 warms up (the gradients and momentum buffers come to exist); its figures are not
    // kept. The same batch every step: the losses of the variants must agree.
    for (int round = 0; round <= rounds; ++round) {
      for (auto& v : variants) {
        // The gradients are zeroed where they are, as libtorch 1.13's zero_grad() does; 2.x's
        // frees them, and backward's allocating them again would count as activation memory.
        for (const auto& p : v.model->parameters())
          if (p.grad().defined()) p.grad().zero_();
        const int64_t before = counting.live();
        counting.reset_peak();
        const auto start = Clock::now();
        const auto loss = cohort::models::logits_cross_entropy(v.model->forward(x), y);
        const int64_t held = counting.live() - before;
        loss.backward();
        const auto end = Clock::now();
        const int64_t activations = counting.peak() - before;
        v.optimizer->step();
        if (round == 0) continue;
        v.step_ms.push_back(std::chrono::duration<double, std::milli>(end - start).count());
        v.activation_bytes = std::max(v.activation_bytes, activations);
        v.held_bytes = std::max(v.held_bytes, held);
        v.loss = loss.item<double>();
      }
    }
    const auto& base = variants[0];
    for (size_t i = 0; i < variants.size(); ++i) {
      const auto& v = variants[i];
      const double mb = static_cast<double>(v.activation_bytes) / 1e6;
      const double memory_ratio =
          static_cast<double>(v.activation_bytes) / static_cast<double>(base.activation_bytes);
      const double time_ratio = median(v.step_ms) / median(base.step_ms);
      const bool same_loss = std::abs(v.loss - base.loss) <= 1e-5 * std::abs(base.loss);
      std::cout << std::left << std::setw(10) << name << std::setw(10) << v.policy << std::right
                << std::setw(8) << units[i] << std::setw(16) << std::fixed << std::setprecision(1)
                << mb << std::setw(9) << std::setprecision(2) << memory_ratio << "x"
                << std::setw(12) << std::setprecision(1) << static_cast<double>(v.held_bytes) / 1e6
                << std::setw(12) << std::setprecision(1) << median(v.step_ms) << std::setw(9)
                << std::setprecision(2) << time_ratio << "x" << std::setw(14)
                << (same_loss ? "yes" : "NO") << std::endl;
      std::cout << cohort::Json{{"model", name},
                                {"policy", v.policy},
                                {"units", units[i]},
                                {"batch_size", batch},
                                {"activation_bytes", v.activation_bytes},
                                {"activation_ratio", memory_ratio},
                                {"held_after_forward_bytes", v.held_bytes},
                                {"step_ms", median(v.step_ms)},
                                {"step_time_ratio", time_ratio},
                                {"loss", v.loss},
                                {"same_loss", same_loss}}
                       .dump()
                << std::endl;
    }
  }
}

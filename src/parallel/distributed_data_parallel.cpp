#include "cohort/parallel/distributed_data_parallel.h"

#include <c10/util/strides.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>

#include <mutex>
#include <utility>

#include "cohort/error.h"
#include "replicas.h"

namespace cohort::parallel {
namespace {

using Clock = std::chrono::steady_clock;

// Sums `bucket` over the group through a narrower dtype.
CommHook compress_hook(at::ScalarType wire) {
  return [wire](comm::ProcessGroup& group, at::Tensor& bucket) {
    std::vector<at::Tensor> compressed{bucket.to(wire)};
    auto work = group.allreduce_async(compressed);
    work.then([bucket, compressed]() mutable { bucket.copy_(compressed[0]); });
    return work;
  };
}

}  // namespace

CommHook allreduce_hook() {
  return [](comm::ProcessGroup& group, at::Tensor& bucket) {
    std::vector<at::Tensor> tensors{bucket};
    return group.allreduce_async(tensors);
  };
}
CommHook fp16_compress_hook() { return compress_hook(at::kHalf); }
CommHook bf16_compress_hook() { return compress_hook(at::kBFloat16); }

struct DistributedDataParallel::Impl {
  struct Bucket {
    std::vector<size_t> params;  // indices into `params`
    at::Tensor flat;
    size_t pending = 0;
    comm::Work work;
  };
  struct Slot {
    size_t bucket = 0;
    int64_t offset = 0;
  };

  std::shared_ptr<torch::nn::Module> module;
  comm::ProcessGroup group;
  DdpOptions options;
  CommHook hook;
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  std::vector<size_t> trainable;  // indices of parameters that require grad
  std::vector<at::Tensor> buffers;
  std::vector<Bucket> buckets;
  std::vector<Slot> slots;
  std::vector<at::Tensor> aliases;
  // A parameter's gradient accumulator: a shared_ptr in libtorch 1.13, an intrusive_ptr in 2.x.
  using Accumulator =
      decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));
  std::vector<std::pair<Accumulator, uintptr_t>> hooks;
  std::weak_ptr<Impl> self;

  std::mutex mutex;
  bool sync_enabled = true;
  // Per synchronised backward.
  bool step_active = false;
  size_t next_bucket = 0;
  std::vector<char> ready;
  std::vector<char> used_since_sync;  // got a gradient since the last synchronisation
  // The order gradients arrived in the first synchronised step, for the one rebuild.
  std::vector<size_t> arrival;
  DdpStats stats;

  Impl(std::shared_ptr<torch::nn::Module> m, comm::ProcessGroup g, DdpOptions o)
      : module(std::move(m)), group(std::move(g)), options(std::move(o)) {
    hook = options.comm_hook ? options.comm_hook : allreduce_hook();
  }

  // Parameter i's slot in its bucket. An alias of the bucket's storage made with set_() rather
  // than an autograd view: libtorch's Optimizer::zero_grad() calls detach_(), which views refuse.
  at::Tensor& view_of(size_t i) { return aliases[i]; }

  bool is_view_of_slot(size_t i, const at::Tensor& grad) {
    return grad.defined() && grad.data_ptr() == view_of(i).data_ptr() && grad.is_contiguous();
  }

  // Buckets filled in `order` (the first bucket is the first to be ready in backward).
  void build_buckets(const std::vector<size_t>& order) {
    const double first_cap = options.first_bucket_cap_mb * 1024 * 1024;
    const double cap = options.bucket_cap_mb * 1024 * 1024;
    std::vector<Bucket> built;
    Bucket current;
    double bytes = 0;
    for (size_t i : order) {
      const auto& p = params[i];
      const double limit = built.empty() ? first_cap : cap;
      const double size = static_cast<double>(p.numel() * p.element_size());
      const bool compatible = current.params.empty() ||
                              (params[current.params.front()].scalar_type() == p.scalar_type() &&
                               params[current.params.front()].device() == p.device());
      if (!current.params.empty() && (bytes + size > limit || !compatible)) {
        built.push_back(std::move(current));
        current = Bucket{};
        bytes = 0;
      }
      current.params.push_back(i);
      bytes += size;
    }
    if (!current.params.empty()) built.push_back(std::move(current));

    torch::NoGradGuard no_grad;
    std::vector<at::Tensor> previous(params.size());
    for (size_t i : trainable) previous[i] = params[i].grad();
    buckets = std::move(built);
    slots.assign(params.size(), Slot{});
    for (size_t b = 0; b < buckets.size(); ++b) {
      int64_t numel = 0;
      for (size_t i : buckets[b].params) {
        slots[i] = Slot{b, numel};
        numel += params[i].numel();
      }
      buckets[b].flat = torch::zeros({numel}, params[buckets[b].params.front()].options());
    }
    aliases.assign(params.size(), at::Tensor());
    for (size_t i : trainable) {
      const auto& p = params[i];
      const auto& flat = buckets[slots[i].bucket].flat;
      aliases[i] = torch::empty({0}, flat.options());
      aliases[i].set_(flat.storage(), flat.storage_offset() + slots[i].offset, p.sizes(),
                      c10::contiguous_strides(p.sizes()));
    }
    // Gradients keep their values across a rebuild: the optimizer step has yet to use them.
    for (size_t i : trainable) {
      auto& view = view_of(i);
      if (previous[i].defined()) view.copy_(previous[i]);
      if (options.gradient_as_bucket_view && previous[i].defined()) params[i].mutable_grad() = view;
    }
    stats.buckets = static_cast<int64_t>(buckets.size());
  }

  void launch_ready_buckets(bool early) {
    while (next_bucket < buckets.size() && buckets[next_bucket].pending == 0) {
      auto& bucket = buckets[next_bucket++];
      bucket.work = hook(group, bucket.flat);
      (early ? stats.buckets_launched_early : stats.buckets_launched_late)++;
    }
  }

  void begin_step() {
    step_active = true;
    next_bucket = 0;
    std::fill(ready.begin(), ready.end(), 0);
    for (auto& b : buckets) b.pending = b.params.size();
    std::weak_ptr<Impl> weak = self;
    torch::autograd::Engine::get_default_engine().queue_callback([weak] {
      if (auto impl = weak.lock()) impl->finalize();
    });
  }

  // Puts parameter i's gradient into its bucket slot (a no-op when .grad already is the slot).
  void stage(size_t i) {
    auto& p = params[i];
    auto& view = view_of(i);
    const auto& grad = p.grad();
    if (!grad.defined()) {
      view.zero_();
    } else if (!is_view_of_slot(i, grad)) {
      view.copy_(grad);
      if (options.gradient_as_bucket_view) p.mutable_grad() = view;
    }
  }

  void on_gradient_ready(size_t i) {
    std::lock_guard lock(mutex);
    used_since_sync[i] = 1;
    if (!sync_enabled) return;
    if (!step_active) begin_step();
    if (ready[i]) return;
    ready[i] = 1;
    if (!stats.buckets_rebuilt) arrival.push_back(i);
    torch::NoGradGuard no_grad;
    stage(i);
    auto& bucket = buckets[slots[i].bucket];
    if (--bucket.pending == 0) launch_ready_buckets(/*early=*/true);
  }

  void finalize() {
    std::lock_guard lock(mutex);
    torch::NoGradGuard no_grad;
    step_active = false;
    // Parameters without a gradient this step still take part, so that no rank waits on them.
    for (size_t i : trainable) {
      if (ready[i]) continue;
      ready[i] = 1;
      stage(i);
      --buckets[slots[i].bucket].pending;
    }
    launch_ready_buckets(/*early=*/false);

    std::vector<char> unused_everywhere(params.size(), 0);
    if (options.find_unused_parameters) {
      std::vector<at::Tensor> used{
          torch::zeros({static_cast<int64_t>(params.size())}, torch::kInt)};
      for (size_t i : trainable) used[0][static_cast<int64_t>(i)] = used_since_sync[i] ? 1 : 0;
      group.allreduce(used);
      auto counts = used[0].accessor<int, 1>();
      for (size_t i : trainable) unused_everywhere[i] = counts[static_cast<int64_t>(i)] == 0;
    }

    const auto wait_start = Clock::now();
    for (auto& bucket : buckets) bucket.work.wait();
    stats.wait_seconds += std::chrono::duration<double>(Clock::now() - wait_start).count();

    const double scale = 1.0 / group.world_size();
    for (auto& bucket : buckets) {
      bucket.flat.mul_(scale);
      bucket.work = comm::Work();
    }
    for (size_t i : trainable) {
      auto& p = params[i];
      if (unused_everywhere[i]) {
        // As in single-process training: no gradient, so the optimizer leaves it alone.
        p.mutable_grad() = at::Tensor();
      } else if (!is_view_of_slot(i, p.grad())) {
        if (p.grad().defined()) {
          p.mutable_grad().copy_(view_of(i));
        } else {
          p.mutable_grad() = view_of(i).clone();
        }
      }
      used_since_sync[i] = 0;
    }
    if (options.broadcast_buffers && !buffers.empty()) detail::broadcast_from_rank0(group, buffers);
    ++stats.synchronized_steps;
    if (!stats.buckets_rebuilt) rebuild_from_arrival_order();
  }

  void rebuild_from_arrival_order() {
    stats.buckets_rebuilt = true;
    std::vector<char> seen(params.size(), 0);
    for (size_t i : arrival) seen[i] = 1;
    for (auto it = trainable.rbegin(); it != trainable.rend(); ++it) {
      if (!seen[*it]) arrival.push_back(*it);
    }
    // Rank 0's order for all, so that every rank launches the same buckets in the same order.
    std::vector<at::Tensor> order{
        torch::tensor(std::vector<int64_t>(arrival.begin(), arrival.end()), torch::kLong)};
    group.broadcast(order, 0);
    std::vector<size_t> agreed;
    for (int64_t k = 0; k < order[0].numel(); ++k)
      agreed.push_back(static_cast<size_t>(order[0][k].item<int64_t>()));
    arrival.clear();
    arrival.shrink_to_fit();
    build_buckets(agreed);
  }

  void install_hooks() {
    std::weak_ptr<Impl> weak = self;
    for (size_t i : trainable) {
      auto accumulator = torch::autograd::impl::grad_accumulator(params[i]);
      auto key =
          accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
              [weak, i](const torch::autograd::variable_list& outputs,
                        const torch::autograd::variable_list&) {
                if (auto impl = weak.lock()) impl->on_gradient_ready(i);
                return outputs;
              }));
      hooks.emplace_back(std::move(accumulator), key);
    }
  }
};

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<torch::nn::Module> module,
                                                 comm::ProcessGroup group, DdpOptions options) {
  if (!module) throw UsageError("DistributedDataParallel: the module is null");
  if (!group.valid()) throw UsageError("DistributedDataParallel: the process group is empty");
  if (options.bucket_cap_mb <= 0 || options.first_bucket_cap_mb <= 0) {
    throw UsageError("DdpOptions: bucket_cap_mb and first_bucket_cap_mb must be > 0");
  }
  impl_ = std::make_shared<Impl>(std::move(module), std::move(group), std::move(options));
  auto& impl = *impl_;
  impl.self = impl_;
  for (const auto& item : impl.module->named_parameters()) {
    impl.names.push_back(item.key());
    impl.params.push_back(item.value());
  }
  for (size_t i = 0; i < impl.params.size(); ++i) {
    if (impl.params[i].requires_grad()) impl.trainable.push_back(i);
  }
  for (const auto& b : impl.module->buffers()) impl.buffers.push_back(b);
  detail::start_replicas(impl.group, impl.names, impl.params, impl.buffers, "prepare_model");
  impl.ready.assign(impl.params.size(), 0);
  impl.used_since_sync.assign(impl.params.size(), 0);
  impl.build_buckets(std::vector<size_t>(impl.trainable.rbegin(), impl.trainable.rend()));
  impl.install_hooks();
}

DistributedDataParallel::~DistributedDataParallel() {
  for (auto& [node, key] : impl_->hooks) node->del_post_hook(key);
}

DistributedDataParallel::NoSyncGuard::NoSyncGuard(DistributedDataParallel& ddp)
    : ddp_(ddp), previous_(ddp.impl_->sync_enabled) {
  ddp_.impl_->sync_enabled = false;
}

DistributedDataParallel::NoSyncGuard::~NoSyncGuard() { ddp_.impl_->sync_enabled = previous_; }

const std::shared_ptr<torch::nn::Module>& DistributedDataParallel::module() const {
  return impl_->module;
}

const comm::ProcessGroup& DistributedDataParallel::process_group() const { return impl_->group; }

DdpStats DistributedDataParallel::stats() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->stats;
}

}  // namespace cohort::parallel

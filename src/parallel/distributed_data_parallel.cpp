#include "cohort/parallel/distributed_data_parallel.h"

#include <mutex>
#include <utility>

#include "cohort/error.h"
#include "gradient_buckets.h"
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
  std::shared_ptr<torch::nn::Module> module;
  comm::ProcessGroup group;
  DdpOptions options;
  CommHook hook;
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  std::vector<size_t> trainable;  // indices of parameters that require grad
  std::vector<at::Tensor> buffers;
  detail::BucketLayout layout;
  std::vector<at::Tensor> flats;  // per bucket: its gradients, side by side
  std::vector<comm::Work> works;  // per bucket: its reduction in flight
  std::vector<at::Tensor> slots;  // per parameter: its place in its bucket's flat tensor

  std::mutex mutex;
  std::vector<char> used_since_sync;  // got a gradient since the last synchronisation
  DdpStats stats;
  // Last: its hooks go first, before what their callbacks use.
  std::unique_ptr<detail::GradientBuckets> gradients;

  Impl(std::shared_ptr<torch::nn::Module> m, comm::ProcessGroup g, DdpOptions o)
      : module(std::move(m)), group(std::move(g)), options(std::move(o)) {
    hook = options.comm_hook ? options.comm_hook : allreduce_hook();
  }

  // Buckets filled in `order` (the first bucket is the first to be ready in backward).
  void build_buckets(const std::vector<size_t>& order) {
    layout =
        detail::lay_out_buckets(params, order,
                                {.first_bucket_bytes = options.first_bucket_cap_mb * 1024 * 1024,
                                 .bucket_bytes = options.bucket_cap_mb * 1024 * 1024});
    torch::NoGradGuard no_grad;
    std::vector<at::Tensor> previous(params.size());
    for (size_t i : trainable) previous[i] = params[i].grad();
    flats.clear();
    for (const auto& b : layout.buckets)
      flats.push_back(torch::zeros({b.numel}, params[b.params.front()].options()));
    works.assign(layout.buckets.size(), comm::Work());
    slots.assign(params.size(), at::Tensor());
    for (size_t i : trainable) {
      const auto& b = layout.buckets[layout.bucket_of[i]];
      slots[i] = detail::alias_into(flats[layout.bucket_of[i]], layout.offsets[i] - b.offset,
                                    params[i].sizes());
    }
    // Gradients keep their values across a rebuild: the optimizer step has yet to use them.
    for (size_t i : trainable) {
      if (!previous[i].defined()) continue;
      slots[i].copy_(previous[i]);
      if (options.gradient_as_bucket_view) params[i].mutable_grad() = slots[i];
    }
    gradients->set_layout(layout.bucket_of, layout.buckets.size());
    stats.buckets = static_cast<int64_t>(layout.buckets.size());
  }

  // The bucket's gradients into its flat tensor (a no-op for those whose .grad is their slot),
  // then its reduction.
  void launch(size_t b, bool early) {
    torch::NoGradGuard no_grad;
    for (size_t i : layout.buckets[b].params)
      detail::stage_gradient(params[i], slots[i], options.gradient_as_bucket_view);
    works[b] = hook(group, flats[b]);
    (early ? stats.buckets_launched_early : stats.buckets_launched_late)++;
  }

  void finish() {
    torch::NoGradGuard no_grad;
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
    for (auto& work : works) work.wait();
    stats.wait_seconds += std::chrono::duration<double>(Clock::now() - wait_start).count();

    const double scale = 1.0 / group.world_size();
    for (size_t b = 0; b < flats.size(); ++b) {
      flats[b].mul_(scale);
      works[b] = comm::Work();
    }
    for (size_t i : trainable) {
      auto& p = params[i];
      if (unused_everywhere[i]) {
        // As in single-process training: no gradient, so the optimizer leaves it alone.
        p.mutable_grad() = at::Tensor();
      } else if (!detail::is_slot(p.grad(), slots[i])) {
        if (p.grad().defined()) {
          p.mutable_grad().copy_(slots[i]);
        } else {
          p.mutable_grad() = slots[i].clone();
        }
      }
      used_since_sync[i] = 0;
    }
    if (options.broadcast_buffers && !buffers.empty()) detail::broadcast_from_rank0(group, buffers);
    ++stats.synchronized_steps;
    if (!stats.buckets_rebuilt) rebuild_from_arrival_order();
  }

  // Once, after the first synchronised step: the buckets in the order gradients really arrived.
  void rebuild_from_arrival_order() {
    stats.buckets_rebuilt = true;
    std::vector<size_t> arrival = gradients->arrival();
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
    build_buckets(agreed);
  }

  void install_hooks() {
    gradients = std::make_unique<detail::GradientBuckets>(
        params, trainable, mutex,
        detail::GradientBuckets::Callbacks{
            .on_gradient = [this](size_t i) { used_since_sync[i] = 1; },
            .launch = [this](size_t b, bool early) { launch(b, early); },
            .finish = [this] { finish(); },
            .aborted = [this] { return group.aborted(); }});
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
  for (const auto& item : impl.module->named_parameters()) {
    impl.names.push_back(item.key());
    impl.params.push_back(item.value());
  }
  for (size_t i = 0; i < impl.params.size(); ++i) {
    if (impl.params[i].requires_grad()) impl.trainable.push_back(i);
  }
  for (const auto& b : impl.module->buffers()) impl.buffers.push_back(b);
  if (impl.options.take_rank0_state) {
    detail::start_replicas(impl.group, impl.names, impl.params, impl.buffers, "prepare_model");
  } else if (impl.group.world_size() > 1) {
    detail::verify_same_layout(impl.group, impl.names, impl.params, "prepare_model");
  }
  impl.used_since_sync.assign(impl.params.size(), 0);
  // The hooks first: laying out the buckets gives them the layout to track.
  impl.install_hooks();
  impl.build_buckets(std::vector<size_t>(impl.trainable.rbegin(), impl.trainable.rend()));
}

DistributedDataParallel::~DistributedDataParallel() { impl_->gradients->remove_hooks(); }

void DistributedDataParallel::take_rank0_state() {
  detail::take_rank0_state(impl_->group, impl_->params, impl_->buffers);
}

DistributedDataParallel::NoSyncGuard::NoSyncGuard(DistributedDataParallel& ddp)
    : ddp_(ddp), previous_(ddp.impl_->gradients->sync()) {
  ddp_.impl_->gradients->set_sync(false);
}

DistributedDataParallel::NoSyncGuard::~NoSyncGuard() { ddp_.impl_->gradients->set_sync(previous_); }

const std::shared_ptr<torch::nn::Module>& DistributedDataParallel::module() const {
  return impl_->module;
}

const comm::ProcessGroup& DistributedDataParallel::process_group() const { return impl_->group; }

DdpStats DistributedDataParallel::stats() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->stats;
}

}  // namespace cohort::parallel

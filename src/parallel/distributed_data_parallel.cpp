#include "cohort/parallel/distributed_data_parallel.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>

#include <mutex>

#include "cohort/error.h"

namespace cohort::parallel {
namespace {

struct Bucket {
  std::vector<size_t> params;  // indices into Impl::params
  at::Tensor flat;
};

std::string describe(const at::Tensor& t) {
  std::string shape = "[";
  for (int64_t i = 0; i < t.dim(); ++i) shape += (i ? "," : "") + std::to_string(t.size(i));
  return shape + "] " + std::string(c10::toString(t.scalar_type()));
}

}  // namespace

struct DistributedDataParallel::Impl {
  std::shared_ptr<torch::nn::Module> module;
  comm::ProcessGroup group;
  DdpOptions options;
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  std::vector<at::Tensor> buffers;
  std::vector<Bucket> buckets;
  std::vector<std::pair<std::shared_ptr<torch::autograd::Node>, uintptr_t>> hooks;
  std::mutex mutex;
  bool sync_enabled = true;
  bool finalize_queued = false;
  int64_t synchronized_steps = 0;

  Impl(std::shared_ptr<torch::nn::Module> m, comm::ProcessGroup g, DdpOptions o)
      : module(std::move(m)), group(std::move(g)), options(o) {}

  void verify_same_layout() {
    // Every rank publishes a digest of its parameters' names, shapes and dtypes; a mismatch is
    // named precisely instead of surfacing later as a hang or a size error inside Gloo.
    std::vector<int64_t> local;
    for (const auto& p : params) {
      local.push_back(p.dim());
      for (int64_t d : p.sizes()) local.push_back(d);
      local.push_back(static_cast<int64_t>(p.scalar_type()));
    }
    auto count = torch::tensor({static_cast<int64_t>(local.size())}, torch::kLong);
    auto counts = group.allgather(count);
    bool same_length = true;
    for (const auto& c : counts) same_length &= c.item<int64_t>() == count.item<int64_t>();
    auto layout = torch::tensor(local, torch::kLong);
    if (!same_length) {
      std::string sizes;
      for (size_t r = 0; r < counts.size(); ++r) {
        sizes += (r ? ", " : "") + std::string("rank ") + std::to_string(r) + ": " +
                 std::to_string(counts[r].item<int64_t>());
      }
      throw UsageError("prepare_model: the model differs across ranks (parameter layout lengths " +
                       sizes + "): every rank must build the same architecture");
    }
    auto layouts = group.allgather(layout);
    for (size_t r = 0; r < layouts.size(); ++r) {
      if (torch::equal(layouts[r], layout)) continue;
      // Walk both layouts to find the first parameter that differs.
      auto theirs = layouts[r];
      int64_t offset = 0;
      for (size_t i = 0; i < params.size(); ++i) {
        const int64_t width = params[i].dim() + 2;
        if (!torch::equal(theirs.narrow(0, offset, width), layout.narrow(0, offset, width))) {
          auto dims = theirs.narrow(0, offset + 1, theirs[offset].item<int64_t>());
          std::string shape = "[";
          for (int64_t d = 0; d < dims.size(0); ++d) {
            shape += (d ? "," : "") + std::to_string(dims[d].item<int64_t>());
          }
          shape += "]";
          throw UsageError("prepare_model: parameter '" + names[i] + "' is " +
                           describe(params[i]) + " on rank " + std::to_string(group.rank()) +
                           " but has shape " + shape + " on rank " + std::to_string(r) +
                           ": every rank must build the same architecture");
        }
        offset += width;
      }
    }
  }

  void broadcast_state() {
    std::vector<at::Tensor> tensors;
    {
      torch::NoGradGuard no_grad;
      for (auto& p : params) tensors.push_back(p.detach());
      for (auto& b : buffers) tensors.push_back(b);
    }
    // One collective per tensor keeps memory flat; this runs once.
    for (auto& t : tensors) {
      std::vector<at::Tensor> one{t};
      group.broadcast(one, 0);
    }
  }

  void build_buckets() {
    // Reverse registration order approximates the order in which backward produces gradients.
    const double first_cap = options.first_bucket_cap_mb * 1024 * 1024;
    const double cap = options.bucket_cap_mb * 1024 * 1024;
    Bucket current;
    double bytes = 0;
    for (size_t k = params.size(); k-- > 0;) {
      const auto& p = params[k];
      if (!p.requires_grad()) continue;
      const double limit = buckets.empty() ? first_cap : cap;
      const double size = static_cast<double>(p.numel() * p.element_size());
      const bool same_type =
          current.params.empty() || (params[current.params.front()].scalar_type() ==
                                         p.scalar_type() &&
                                     params[current.params.front()].device() == p.device());
      if (!current.params.empty() && (bytes + size > limit || !same_type)) {
        buckets.push_back(std::move(current));
        current = Bucket{};
        bytes = 0;
      }
      current.params.push_back(k);
      bytes += size;
    }
    if (!current.params.empty()) buckets.push_back(std::move(current));
    for (auto& bucket : buckets) {
      int64_t numel = 0;
      for (size_t k : bucket.params) numel += params[k].numel();
      bucket.flat = torch::zeros({numel}, params[bucket.params.front()].options());
    }
  }

  void on_gradient_ready() {
    std::lock_guard lock(mutex);
    if (!sync_enabled || finalize_queued) return;
    finalize_queued = true;
    std::weak_ptr<Impl> weak = self;
    torch::autograd::Engine::get_default_engine().queue_callback([weak] {
      if (auto impl = weak.lock()) impl->finalize_backward();
    });
  }

  void finalize_backward() {
    {
      std::lock_guard lock(mutex);
      finalize_queued = false;
    }
    torch::NoGradGuard no_grad;
    std::vector<comm::Work> pending;
    for (auto& bucket : buckets) {
      int64_t offset = 0;
      for (size_t k : bucket.params) {
        auto& p = params[k];
        auto slot = bucket.flat.narrow(0, offset, p.numel());
        // A parameter that got no gradient this step contributes zeros, so no rank waits on it.
        if (p.grad().defined()) {
          slot.copy_(p.grad().reshape(-1));
        } else {
          slot.zero_();
        }
        offset += p.numel();
      }
      std::vector<at::Tensor> one{bucket.flat};
      pending.push_back(group.allreduce_async(one, comm::ReduceOp::kSum));
    }
    const double scale = 1.0 / group.world_size();
    for (size_t b = 0; b < buckets.size(); ++b) {
      pending[b].wait();
      auto& bucket = buckets[b];
      int64_t offset = 0;
      for (size_t k : bucket.params) {
        auto& p = params[k];
        auto averaged = bucket.flat.narrow(0, offset, p.numel()).view(p.sizes()).mul(scale);
        if (p.grad().defined()) {
          p.mutable_grad().copy_(averaged);
        } else {
          p.mutable_grad() = averaged;
        }
        offset += p.numel();
      }
    }
    if (options.broadcast_buffers && !buffers.empty()) {
      for (auto& b : buffers) {
        std::vector<at::Tensor> one{b};
        group.broadcast(one, 0);
      }
    }
    ++synchronized_steps;
  }

  void install_hooks() {
    std::weak_ptr<Impl> weak = self;
    for (auto& p : params) {
      if (!p.requires_grad()) continue;
      auto accumulator = torch::autograd::impl::grad_accumulator(p);
      auto key = accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
          [weak](const torch::autograd::variable_list& outputs,
                 const torch::autograd::variable_list&) {
            if (auto impl = weak.lock()) impl->on_gradient_ready();
            return outputs;
          }));
      hooks.emplace_back(std::move(accumulator), key);
    }
  }

  std::weak_ptr<Impl> self;
};

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<torch::nn::Module> module,
                                                 comm::ProcessGroup group, DdpOptions options) {
  if (!module) throw UsageError("prepare_model: the module is null");
  if (options.bucket_cap_mb <= 0 || options.first_bucket_cap_mb <= 0) {
    throw UsageError("DdpOptions: bucket sizes must be > 0 MB");
  }
  impl_ = std::make_shared<Impl>(std::move(module), std::move(group), options);
  impl_->self = impl_;
  for (const auto& item : impl_->module->named_parameters()) {
    impl_->names.push_back(item.key());
    impl_->params.push_back(item.value());
  }
  for (const auto& b : impl_->module->buffers()) impl_->buffers.push_back(b);
  if (impl_->group.world_size() > 1) {
    impl_->verify_same_layout();
    impl_->broadcast_state();
  }
  impl_->build_buckets();
  impl_->install_hooks();
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

int64_t DistributedDataParallel::synchronized_steps() const { return impl_->synchronized_steps; }

}  // namespace cohort::parallel

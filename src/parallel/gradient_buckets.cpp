#include "gradient_buckets.h"

#include <c10/util/strides.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>

#include <algorithm>
#include <utility>

#include "cohort/error.h"
#include "grad_accumulator.h"

namespace cohort::parallel::detail {

at::Tensor alias_into(const at::Tensor& flat, int64_t offset, at::IntArrayRef sizes) {
  auto t = at::empty({0}, flat.options());
  t.set_(flat.storage(), flat.storage_offset() + offset, sizes, c10::contiguous_strides(sizes));
  return t;
}

BucketLayout lay_out_buckets(const std::vector<at::Tensor>& params,
                             const std::vector<size_t>& order, const BucketLayoutOptions& options) {
  BucketLayout layout;
  layout.bucket_of.assign(params.size(), 0);
  layout.offsets.assign(params.size(), 0);
  const int64_t pad = std::max<int64_t>(options.pad_to, 1);
  GradientBucket current;
  double bytes = 0;
  bool current_alone = false;  // the open bucket holds a parameter marked `alone`
  auto close = [&] {
    current.numel = (current.numel + pad - 1) / pad * pad;
    layout.numel = current.offset + current.numel;
    layout.buckets.push_back(std::move(current));
    current = GradientBucket{};
    current.offset = layout.numel;
    bytes = 0;
  };
  for (size_t i : order) {
    const auto& p = params[i];
    const int unit = options.unit_of.empty() ? -1 : options.unit_of[i];
    const bool alone = !options.alone.empty() && options.alone[i] != 0;
    const double size = static_cast<double>(p.numel()) * static_cast<double>(p.element_size());
    if (!current.params.empty()) {
      const auto& first = params[current.params.front()];
      const double cap = layout.buckets.empty() ? options.first_bucket_bytes : options.bucket_bytes;
      if (alone || current_alone || unit != current.unit ||
          first.scalar_type() != p.scalar_type() || first.device() != p.device() ||
          (unit < 0 && bytes + size > cap)) {
        close();
      }
    }
    current.unit = unit;
    current_alone = alone;
    layout.offsets[i] = current.offset + current.numel;
    layout.bucket_of[i] = layout.buckets.size();
    current.params.push_back(i);
    current.numel += p.numel();
    bytes += size;
  }
  if (!current.params.empty()) close();
  return layout;
}

bool is_slot(const at::Tensor& grad, const at::Tensor& slot) {
  return grad.defined() && grad.data_ptr() == slot.data_ptr() && grad.is_contiguous();
}

void stage_gradient(at::Tensor& param, at::Tensor& slot, bool point_grad_at_slot) {
  const auto& grad = param.grad();
  if (is_slot(grad, slot)) return;
  if (grad.defined()) {
    slot.copy_(grad);
  } else {
    slot.zero_();
  }
  if (point_grad_at_slot) param.mutable_grad() = slot;
}

struct GradientBuckets::State {
  std::mutex& mutex;
  Callbacks callbacks;
  bool launch_early;
  std::vector<size_t> hooked;
  std::vector<std::pair<GradAccumulator, uintptr_t>> hooks;
  std::vector<size_t> bucket_of;  // per parameter index
  std::vector<size_t> sizes;      // per bucket: its hooked parameters
  bool sync = true;
  // Per synchronised backward.
  bool active = false;
  size_t next = 0;  // the next bucket to launch
  std::vector<size_t> pending;
  std::vector<char> ready;  // per parameter index
  std::vector<size_t> arrival;

  State(std::mutex& m, Callbacks c, bool early)
      : mutex(m), callbacks(std::move(c)), launch_early(early) {}

  void launch_ready(bool early) {
    while (next < pending.size() && pending[next] == 0) callbacks.launch(next++, early);
  }

  void begin(const std::weak_ptr<State>& weak) {
    active = true;
    next = 0;
    pending = sizes;
    std::fill(ready.begin(), ready.end(), 0);
    arrival.clear();
    torch::autograd::Engine::get_default_engine().queue_callback([weak] {
      if (auto state = weak.lock()) state->end();
    });
  }

  void on_gradient(size_t i, const std::weak_ptr<State>& weak) {
    // Thrown through autograd, which skips the rest of the backward and rethrows it from
    // backward() as it is.
    if (callbacks.aborted && callbacks.aborted())
      throw PeerFailureError("the backward stopped: a peer of the group was lost");
    std::lock_guard lock(mutex);
    if (callbacks.on_gradient) callbacks.on_gradient(i);
    if (!sync) return;
    if (!active) begin(weak);
    if (ready[i]) return;
    ready[i] = 1;
    arrival.push_back(i);
    if (--pending[bucket_of[i]] == 0 && launch_early) launch_ready(/*early=*/true);
  }

  // The end of a synchronised backward: parameters without a gradient still take part, so that
  // no rank waits on them.
  void end() {
    std::lock_guard lock(mutex);
    active = false;
    for (size_t i : hooked) {
      if (ready[i]) continue;
      ready[i] = 1;
      --pending[bucket_of[i]];
    }
    launch_ready(/*early=*/false);
    callbacks.finish();
  }
};

GradientBuckets::GradientBuckets(const std::vector<at::Tensor>& params,
                                 const std::vector<size_t>& hooked, std::mutex& mutex,
                                 Callbacks callbacks, bool launch_early)
    : state_(std::make_shared<State>(mutex, std::move(callbacks), launch_early)) {
  state_->hooked = hooked;
  state_->ready.assign(params.size(), 0);
  std::weak_ptr<State> weak = state_;
  for (size_t i : hooked) {
    auto accumulator = torch::autograd::impl::grad_accumulator(params[i]);
    auto key = accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [weak, i](const torch::autograd::variable_list& outputs,
                  const torch::autograd::variable_list&) {
          if (auto state = weak.lock()) state->on_gradient(i, weak);
          return outputs;
        }));
    state_->hooks.emplace_back(std::move(accumulator), key);
  }
}

GradientBuckets::~GradientBuckets() { remove_hooks(); }

void GradientBuckets::set_layout(const std::vector<size_t>& bucket_of, size_t buckets) {
  state_->bucket_of = bucket_of;
  state_->sizes.assign(buckets, 0);
  for (size_t i : state_->hooked) ++state_->sizes[bucket_of[i]];
  state_->pending = state_->sizes;
}

void GradientBuckets::set_sync(bool sync) { state_->sync = sync; }
bool GradientBuckets::sync() const { return state_->sync; }
const std::vector<size_t>& GradientBuckets::arrival() const { return state_->arrival; }

void GradientBuckets::remove_hooks() {
  for (auto& [node, key] : state_->hooks) node->del_post_hook(key);
  state_->hooks.clear();
}

}  // namespace cohort::parallel::detail

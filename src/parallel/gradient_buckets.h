#pragma once
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include <ATen/core/Tensor.h>

// The gradient path that DistributedDataParallel and ZeroOptimizer share (Megatron's bucketed
// gradient buffer): the parameters laid out in buckets of one flat index space, a hook on each
// parameter's gradient accumulator, and each bucket handed to the engine's reduction (an
// all-reduce for DDP, a reduce-scatter for ZeRO) as soon as all its gradients are ready, in the
// same bucket order on every rank so that the collectives pair up.
namespace cohort::parallel::detail {

// A tensor of `sizes` over flat's storage from element `offset` on, made with set_() rather than
// as an autograd view: libtorch's Optimizer::zero_grad() calls detach_() on gradients, which
// views refuse, and a parameter re-pointed into a flat buffer must stay a leaf.
at::Tensor alias_into(const at::Tensor& flat, int64_t offset, at::IntArrayRef sizes);

// One bucket: parameters whose gradients travel together.
struct GradientBucket {
  std::vector<size_t> params;  // indices into the engine's parameters, in the flat order
  int64_t offset = 0;          // the bucket's first element in the flat index space
  int64_t numel = 0;           // its elements, padded to a multiple of pad_to
  int unit = -1;               // ZeRO-3: the unit whose parameters it holds, if any
};

struct BucketLayout {
  std::vector<GradientBucket> buckets;  // in launch order: the first is the first ready
  std::vector<size_t> bucket_of;        // per parameter index (those laid out)
  std::vector<int64_t> offsets;         // per parameter index, in the flat index space
  int64_t numel = 0;                    // the whole flat space, padding included
};

struct BucketLayoutOptions {
  double first_bucket_bytes = 0;  // the first bucket's cap (smaller, so communication starts early)
  double bucket_bytes = 0;        // every other bucket's cap
  // Each bucket's elements rounded up to a multiple of this (the world size for a
  // reduce-scatter, so that every rank's piece has the same size).
  int64_t pad_to = 1;
  // Per parameter index, or empty: parameters of the same unit (>= 0) make one bucket of their
  // own whatever its size (a ZeRO-3 unit gathers and reduces whole); -1 for none.
  std::vector<int> unit_of;
  // Per parameter index, or empty: a parameter marked here makes a bucket of its own (a
  // pipeline's tied parameter, whose shards then cover the same elements in every engine that
  // holds a copy of it).
  std::vector<char> alone;
};

// Buckets filled with `order`'s parameters in turn: a bucket closes before the parameter that
// would take it over its cap, at a change of dtype or device, and at a unit's edge.
BucketLayout lay_out_buckets(const std::vector<at::Tensor>& params,
                             const std::vector<size_t>& order, const BucketLayoutOptions& options);

// Whether `grad` is `slot` itself (a gradient the backward accumulated straight into its bucket).
bool is_slot(const at::Tensor& grad, const at::Tensor& slot);

// A parameter's gradient into its slot (zeros when it has none); `point_grad_at_slot` then makes
// the slot its .grad, so that the next backward accumulates straight into the bucket. Nothing is
// copied when .grad already is the slot.
void stage_gradient(at::Tensor& param, at::Tensor& slot, bool point_grad_at_slot);

// Hooks on the parameters' gradient accumulators that tell the engine when each bucket of a
// layout is ready. Every callback runs with the engine's mutex held.
class GradientBuckets {
 public:
  struct Callbacks {
    // Every gradient as autograd accumulates it, synchronised or not (may be empty).
    std::function<void(size_t param)> on_gradient;
    // All of the bucket's gradients are in (`early`: while backward still runs), or the
    // synchronised backward ended: reduce it. Buckets are launched in order 0, 1, ...
    std::function<void(size_t bucket, bool early)> launch;
    // The synchronised backward ended and every bucket has been launched.
    std::function<void()> finish;
    // Asked at each gradient (may be empty): true ends the backward with PeerFailureError, as a
    // peer was lost and no collective will take the gradients (comm::ProcessGroup::aborted).
    // Otherwise a survivor of live recovery would compute its whole backward first.
    std::function<bool()> aborted;
  };

  // Hooks `params[i]` for every i in `hooked`; `launch_early` false holds every bucket until the
  // end of backward (ZeRO's overlap_comm off).
  GradientBuckets(const std::vector<at::Tensor>& params, const std::vector<size_t>& hooked,
                  std::mutex& mutex, Callbacks callbacks, bool launch_early = true);
  ~GradientBuckets();
  GradientBuckets(const GradientBuckets&) = delete;
  GradientBuckets& operator=(const GradientBuckets&) = delete;

  // The buckets whose readiness is tracked from the next synchronised backward on: `bucket_of`
  // per parameter index, `buckets` of them (call with the mutex held, or before any backward;
  // from `finish` too, to rebuild the buckets).
  void set_layout(const std::vector<size_t>& bucket_of, size_t buckets);
  // Off: backward passes accumulate without launching anything (no_sync); on_gradient still runs.
  void set_sync(bool sync);
  bool sync() const;
  // The parameters in the order their gradients arrived in the last synchronised backward (those
  // that got none are not in it).
  const std::vector<size_t>& arrival() const;
  // Removes the hooks (also done on destruction).
  void remove_hooks();

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace cohort::parallel::detail

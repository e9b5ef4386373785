#include "cohort/parallel/zero_optimizer.h"

#include <c10/util/accumulate.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <map>
#include <mutex>
#include <stdexcept>
#include <utility>

#include "cohort/error.h"
#include "cohort/parallel/fully_shard.h"
#include "gradient_buckets.h"
#include "replicas.h"

namespace cohort::parallel {
namespace {

using Clock = std::chrono::steady_clock;

// Stage 3 frees a unit's whole parameters by emptying their storage, not by dropping the tensor:
// the parameters and the views autograd saved in forward share that storage, and see the
// gathered values again once it is refilled. The memory is kept for the next gather rather
// than given back (a fresh 67 MB buffer costs a page fault per 4 KiB), as a CUDA caching
// allocator keeps it: no more buffers than units were ever gathered at once, pooled and gathered
// together.
class StoragePool {
 public:
  // `keep`: into the pool, else back to the allocator.
  void release(const at::Tensor& t, bool keep) {
    auto* storage = t.storage().unsafeGetStorageImpl();
    const size_t bytes = storage->nbytes();
    auto data = storage->set_data_ptr(at::DataPtr(nullptr, t.device()));
    storage->set_nbytes(0);
    if (keep && data.get() != nullptr) free_.emplace_back(std::move(data), bytes);
  }
  size_t pooled() const { return free_.size(); }
  void refill(const at::Tensor& t) {
    auto* storage = t.storage().unsafeGetStorageImpl();
    const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
    const auto reusable = std::find_if(free_.begin(), free_.end(), [&](const auto& pooled) {
      return pooled.first.device() == t.device() && pooled.second == bytes;
    });
    if (reusable != free_.end()) {
      storage->set_data_ptr_noswap(std::move(reusable->first));
      free_.erase(reusable);
    } else {
      storage->set_data_ptr_noswap(storage->allocator()->allocate(bytes));
    }
    storage->set_nbytes(bytes);
  }

 private:
  std::vector<std::pair<at::DataPtr, size_t>> free_;  // and their bytes
};

}  // namespace

struct ZeroOptimizer::Engine : ShardedUnitHooks {
  // The layout's bucket (its offset: in the flat buffer, at stage 3 as if there were one; its
  // elements padded to a multiple of the world size), and what ZeRO keeps of it.
  struct Bucket : detail::GradientBucket {
    at::Tensor full;        // the bucket's parameters, whole (a stage-3 unit's: when gathered)
    at::Tensor shard;       // this rank's piece of the parameters (the optimizer's param)
    at::Tensor shard_grad;  // its reduced gradient (the optimizer's gradient buffer)
    at::Tensor staging;     // the bucket's gradients while they are reduce-scattered
    comm::Work work;
  };

  std::shared_ptr<torch::nn::Module> module;
  comm::ProcessGroup group;  // the sharding group
  // With sharding groups (HSDP): the whole data-parallel group, and this rank's peers of the same
  // shard in the other groups (empty without).
  comm::ProcessGroup data_parallel, replicas;
  ZeroOptions options;
  std::string algorithm;
  std::unique_ptr<torch::optim::OptimizerOptions> optimizer_options;
  std::vector<std::string> names;
  std::vector<at::Tensor> params;  // trainable, aliases into flat_params
  std::vector<at::Tensor> buffers;
  std::vector<int64_t> offsets;   // per parameter, in the flat buffer
  std::vector<size_t> bucket_of;  // per parameter
  at::Tensor flat_params;         // stages 1 and 2: every bucket's `full` is a piece of it
  at::Tensor flat_grads;          // stage 1: every parameter's .grad is an alias into it
  std::vector<at::Tensor> grad_aliases;
  std::vector<Bucket> buckets;
  std::unique_ptr<detail::GradientBuckets> gradients;  // the hooks that launch the buckets
  std::weak_ptr<Engine> self;
  optim::FlatOptimizer* optimizer = nullptr;  // the ZeroOptimizer this engine serves

  mutable std::mutex mutex;
  bool reduced = false;  // a synchronised backward ended since the last step
  // The shard was stepped and the all-gather after it is running (see stepped_before_failure).
  bool gathering_stepped = false;
  std::deque<size_t> in_flight;  // stage 2: buckets being reduce-scattered, oldest first
  static constexpr size_t kBucketsInFlight = 2;
  std::vector<at::Tensor> staging_pool;  // stages 2-3: at most kBucketsInFlight (staging_buffer)
  ZeroStats stats;

  // Stage 3: the model's FullyShard units that are sharded, and their state.
  struct Unit {
    std::string name;
    std::shared_ptr<FullyShardImpl> module;
    size_t bucket = 0;
    bool gathered = false;
    comm::Work gather;         // an all-gather in flight
    size_t grads_pending = 0;  // parameters whose gradient this backward has yet to produce
    // Gathered ahead, for a use (forward or backward) that has not come yet: in a
    // StepOrderScope it outlives the backward passes that end before that use.
    bool ahead = false;
  };
  std::vector<Unit> units;
  std::vector<int> unit_of;            // per parameter: its unit, or -1 (whole on every rank)
  std::vector<char> alone;             // per parameter: a bucket of its own (or empty: none)
  std::vector<size_t> forward_order;   // units as this step's forward ran them
  std::vector<size_t> previous_order;  // and the step before's
  bool following_order = true;         // this step's forward has kept to previous_order so far
  bool backward_active = false;        // a backward through a unit is running
  bool order_scoped = false;           // a StepOrderScope is open: the order ends with it
  bool order_pending = false;          // a backward ended in the scope: its end checks the order
  int pinned = 0;                      // GatheredParameters scopes alive
  int64_t live_bytes = 0;              // of gathered units
  int64_t gather_bytes_sent = 0;       // by the units' all-gathers since the last step
  // In a StepOrderScope: the units' uses (2u for a forward of unit u, 2u + 1 for a backward) in
  // this step and the step before, and whether this step's have kept to the last's so far.
  std::vector<size_t> uses, previous_uses;
  bool following_uses = true;
  StoragePool unit_storage;
  size_t live_units = 0, peak_live_units = 0;

  int world() const { return group.world_size(); }
  int rank() const { return group.rank(); }

  Engine(std::shared_ptr<torch::nn::Module> m, const torch::optim::Optimizer& optimizer,
         comm::ProcessGroup g, ZeroOptions o, const std::vector<at::Tensor>& own_buckets)
      : module(std::move(m)), group(std::move(g)), options(o) {
    options.validate();
    if (options.stage < 1) {
      throw UsageError(
          "ZeroOptimizer: stage 0 is plain data parallelism: use DistributedDataParallel "
          "(train::prepare_model without ZeRO)");
    }
    algorithm = optim::algorithm_of(optimizer, "ZeroOptimizer", "ZeRO shards only those");
    if (optimizer.param_groups().size() != 1) {
      throw UsageError("ZeroOptimizer: the optimizer has " +
                       std::to_string(optimizer.param_groups().size()) +
                       " param groups; ZeRO supports one, holding the module's parameters");
    }
    optimizer_options = optimizer.param_groups()[0].options().clone();
    auto trainable = detail::trainable_parameters(*module, optimizer.param_groups()[0].params(),
                                                  "ZeroOptimizer");
    names = std::move(trainable.names);
    params = std::move(trainable.params);
    for (const auto& b : module->buffers()) buffers.push_back(b);
    // Deferred units' parameters have no values yet: at stage 3 each unit is materialised in
    // lay_out() and rank 0's copy broadcast there, one unit at a time (find_units() materialises
    // the FullyShards too small to be units); other stages materialise the model here.
    if (options.stage == 3) {
      find_units();
    } else {
      materialize(*module);
    }
    find_own_buckets(own_buckets);
    // Where data parallelism starts (detail::start_replicas), for the parameters that have
    // values.
    if (group.world_size() > 1) {
      detail::verify_same_layout(group, names, params, "ZeroOptimizer");
      std::vector<at::Tensor> values;
      for (const auto& p : params)
        if (!is_deferred(p)) values.push_back(p.detach());
      values.insert(values.end(), buffers.begin(), buffers.end());
      detail::broadcast_from_rank0(group, values);
    }
    data_parallel = group;
    split_into_sharding_groups();
    lay_out();
  }

  // HSDP: groups of shard_group_size consecutive ranks shard the state; the ranks at the same
  // place in each group are replicas of one shard.
  void split_into_sharding_groups() {
    const int size = options.shard_group_size;
    const int n = data_parallel.world_size();
    if (size == 0 || size == n) return;
    if (size > n || n % size != 0) {
      throw UsageError("ZeRO shard_group_size (--shard-group-size) " + std::to_string(size) +
                       " does not divide the " + std::to_string(n) +
                       " data-parallel ranks: use a divisor of " + std::to_string(n) +
                       " (0: shard over all of them)");
    }
    std::vector<std::vector<int>> shards(static_cast<size_t>(n / size)),
        replicated(static_cast<size_t>(size));
    for (int r = 0; r < n; ++r) {
      shards[static_cast<size_t>(r / size)].push_back(r);
      replicated[static_cast<size_t>(r % size)].push_back(r);
    }
    group = data_parallel.split(shards, "zero-shard");
    replicas = data_parallel.split(replicated, "zero-replica");
  }

  int replica() const { return replicas.valid() ? replicas.rank() : 0; }

  // The index of `t` among the trainable parameters, or params.size() where it is not one.
  size_t index_of(const at::Tensor& t) const {
    size_t i = 0;
    while (i < params.size() && !params[i].is_same(t)) ++i;
    return i;
  }

  // The parameters that make a bucket of their own: trainable ones of the module, outside every
  // stage-3 unit (a unit is gathered and reduced whole).
  void find_own_buckets(const std::vector<at::Tensor>& own_buckets) {
    if (own_buckets.empty()) return;
    alone.assign(params.size(), 0);
    for (const auto& t : own_buckets) {
      const size_t i = index_of(t);
      if (i == params.size()) {
        throw UsageError(
            "ZeroOptimizer: a parameter given a bucket of its own is not one of the module's "
            "trainable parameters (" +
            std::to_string(params.size()) + " of them): give the module's own tensors");
      }
      if (!unit_of.empty() && unit_of[i] >= 0) {
        throw UsageError("ZeroOptimizer: parameter '" + names[i] + "' is in FullyShard unit '" +
                         units[static_cast<size_t>(unit_of[i])].name +
                         "', which stage 3 gathers and reduces whole: hold it outside the unit "
                         "to give it a bucket of its own");
      }
      alone[i] = 1;
    }
  }

  // The FullyShard modules of the model that hold at least param_persistence_threshold trainable
  // elements, each the unit of its parameters.
  void find_units() {
    std::map<const c10::TensorImpl*, size_t> index;
    for (size_t i = 0; i < params.size(); ++i) index[params[i].unsafeGetTensorImpl()] = i;
    unit_of.assign(params.size(), -1);
    bool any = false;
    std::vector<std::string> unit_names;  // of every FullyShard, for the nesting check
    for (const auto& item : module->named_modules()) {
      auto wrapper = std::dynamic_pointer_cast<FullyShardImpl>(item.value());
      if (!wrapper) continue;
      any = true;
      for (const auto& outer : unit_names) {
        if (item.key().rfind(outer + ".", 0) == 0 || outer.empty()) {
          throw UsageError("ZeroOptimizer: FullyShard unit '" + item.key() + "' is inside unit '" +
                           (outer.empty() ? "(the model)" : outer) +
                           "': units do not nest; wrap the inner modules only, or the outer");
        }
      }
      unit_names.push_back(item.key());
      std::vector<size_t> members;
      int64_t numel = 0;
      for (const auto& p : wrapper->parameters()) {
        auto found = index.find(p.unsafeGetTensorImpl());
        if (found == index.end()) continue;  // frozen
        members.push_back(found->second);
        numel += p.numel();
      }
      if (members.empty() || numel < options.param_persistence_threshold) {
        wrapper->materialize();  // whole on every rank
        continue;
      }
      for (size_t i : members) unit_of[i] = static_cast<int>(units.size());
      units.push_back(Unit{.name = item.key(), .module = wrapper});
    }
    if (!any) {
      throw UsageError(
          "ZeroOptimizer: stage 3 gathers the parameters of the model's FullyShard units around "
          "their forward, and " +
          module->name() +
          " has none: hold its blocks through parallel::FullyShard (see "
          "cohort/parallel/fully_shard.h), or use stage 2");
    }
    stats.units = static_cast<int64_t>(units.size());
  }

  // Parameter i's values into its slot of its bucket's full buffer, and the parameter re-pointed
  // there.
  void move_into_bucket(size_t i) {
    const auto& b = buckets[bucket_of[i]];
    auto slot = detail::alias_into(b.full, offsets[i] - b.offset, params[i].sizes());
    slot.copy_(params[i]);
    params[i].set_data(slot);
  }

  // Buckets in reverse registration order, each padded to a multiple of the world size; the
  // parameters re-pointed into the flat buffer, and the shards cut out of it.
  void lay_out() {
    torch::NoGradGuard no_grad;
    const int64_t n = world();
    std::vector<size_t> order(params.size());
    for (size_t k = 0; k < params.size(); ++k) order[k] = params.size() - 1 - k;
    const double cap = static_cast<double>(options.reduce_bucket_size) *
                       static_cast<double>(params[0].element_size());
    // Stage 3: a unit's parameters are a bucket of their own (they are consecutive: units do
    // not nest).
    auto layout = detail::lay_out_buckets(params, order,
                                          {.first_bucket_bytes = cap,
                                           .bucket_bytes = cap,
                                           .pad_to = n,
                                           .unit_of = unit_of,
                                           .alone = alone});
    offsets = std::move(layout.offsets);
    bucket_of = std::move(layout.bucket_of);
    for (auto& laid_out : layout.buckets) {
      buckets.emplace_back();
      static_cast<detail::GradientBucket&>(buckets.back()) = std::move(laid_out);
    }
    const int64_t offset = layout.numel;
    if (options.stage < 3) {
      flat_params = at::zeros({offset}, params[0].options());
      for (auto& b : buckets) b.full = flat_params.narrow(0, b.offset, b.numel);
      for (size_t i = 0; i < params.size(); ++i) move_into_bucket(i);
    }
    if (options.stage == 1) {
      flat_grads = at::zeros({offset}, params[0].options());
      for (size_t i = 0; i < params.size(); ++i) {
        grad_aliases.push_back(detail::alias_into(flat_grads, offsets[i], params[i].sizes()));
        params[i].mutable_grad() = grad_aliases.back();
      }
    }
    for (auto& b : buckets) {
      const int64_t piece = b.numel / n;
      if (options.stage == 3) {
        // One bucket at a time: the peak is the model (or, deferred, nothing of the units) and
        // one bucket, not the model twice.
        b.full = at::zeros({b.numel}, params[0].options());
        bool deferred = false;
        if (b.unit >= 0) {
          auto& unit = units[static_cast<size_t>(b.unit)].module;
          deferred = unit->deferred();
          unit->materialize();
        }
        for (size_t i : b.params) move_into_bucket(i);
        // A deferred unit's values are rank 0's, as start_replicas makes the others'.
        if (deferred && data_parallel.world_size() > 1) {
          std::vector<at::Tensor> full{b.full};
          data_parallel.broadcast(full, 0);
        }
      }
      if (b.unit >= 0) {
        // Stage 3: the shard is all this rank keeps of the unit.
        b.shard = b.full.narrow(0, rank() * piece, piece).clone();
        unit_storage.release(b.full, /*keep=*/false);
        units[static_cast<size_t>(b.unit)].bucket = static_cast<size_t>(&b - buckets.data());
      } else {
        b.shard = detail::alias_into(b.full, rank() * piece, {piece});
      }
      // Stage 1 reduces each bucket in place: the shard's gradient is its piece of the full
      // gradient buffer (the flat optimizer adopts it).
      if (options.stage == 1)
        b.shard.mutable_grad() = detail::alias_into(flat_grads, b.offset + rank() * piece, {piece});
      stats.shard_numel += piece;
    }
    stats.buckets = static_cast<int64_t>(buckets.size());
    stats.padded_numel = offset;
  }

  // One param group per bucket: its shard, with the optimizer's options.
  std::vector<torch::optim::OptimizerParamGroup> shard_groups() const {
    std::vector<torch::optim::OptimizerParamGroup> groups;
    for (const auto& b : buckets)
      groups.emplace_back(std::vector<at::Tensor>{b.shard}, optimizer_options->clone());
    return groups;
  }

  // After the FlatOptimizer over the shards exists: its gradient buffers are where the
  // reduce-scatters land, and the shards' .grad.
  void attach(optim::FlatOptimizer& flat) {
    optimizer = &flat;
    auto grads = flat.flat_gradients();
    for (size_t b = 0; b < buckets.size(); ++b) {
      buckets[b].shard_grad = grads[b];
      buckets[b].shard.mutable_grad() = grads[b];
    }
    install_hooks();
    for (size_t u = 0; u < units.size(); ++u) units[u].module->set_sharding(self, u);
    update_memory_stats();
  }

  void update_memory_stats() {
    // Whole parameters (stage 3: those outside the units, and the units' shards); the gathered
    // units are counted apart, in gathered_bytes_peak.
    stats.parameter_bytes = 0;
    for (const auto& b : buckets) {
      const auto& held = b.unit >= 0 ? b.shard : b.full;
      stats.parameter_bytes += held.numel() * held.element_size();
    }
    int64_t shard_grad_bytes = 0;
    for (const auto& b : buckets)
      shard_grad_bytes += b.shard_grad.numel() * b.shard_grad.element_size();
    // Stage 1: the full gradient buffer, of which the shard's gradients are pieces; stage 2: the
    // shard's gradients (and the buckets in flight, counted apart).
    stats.gradient_bytes =
        flat_grads.defined() ? flat_grads.numel() * flat_grads.element_size() : shard_grad_bytes;
    int64_t staging_bytes = 0;
    for (const auto& t : staging_pool) staging_bytes += t.numel() * t.element_size();
    stats.bucket_bytes_peak = staging_bytes;
    // The flat optimizer's bytes are its gradient buffers (counted above), its state, and float32
    // masters for 16-bit parameters.
    stats.optimizer_state_bytes = optimizer->state_bytes() - shard_grad_bytes;
  }

  void install_hooks() {
    std::vector<size_t> all(params.size());
    for (size_t i = 0; i < all.size(); ++i) all[i] = i;
    gradients = std::make_unique<detail::GradientBuckets>(
        params, all, mutex,
        detail::GradientBuckets::Callbacks{.on_gradient = [this](size_t i) { on_gradient(i); },
                                           .launch = [this](size_t b, bool) { launch(buckets[b]); },
                                           .finish = [this] { finish(); },
                                           .aborted = [this] { return group.aborted(); }},
        options.overlap_comm);
    gradients->set_layout(bucket_of, buckets.size());
  }

  // Stage 3: a unit whose gradients are all there has finished its backward (under no_sync too):
  // its whole parameters go.
  void on_gradient(size_t i) {
    if (!unit_of.empty() && unit_of[i] >= 0 && backward_active) {
      auto& unit = units[static_cast<size_t>(unit_of[i])];
      if (unit.grads_pending > 0 && --unit.grads_pending == 0) reshard(unit);
    }
  }

  // A buffer of at least `numel` elements that no bucket in flight stages in (stage 2 and 3). The
  // buffers are kept from step to step (a fresh 100 MB buffer costs a page fault per 4 KiB), at
  // most one per bucket in flight: the smallest free one that is large enough, else a free one
  // made that large, else a new one. As every step launches the buckets in the same order, each
  // buffer settles at the size of the buckets it stages: one where the gradient is one bucket,
  // and a small one beside a large where a small bucket (a pipeline's tied embedding) follows.
  at::Tensor& staging_buffer(int64_t numel) {
    const auto in_use = [&](const at::Tensor& buffer) {
      return std::any_of(in_flight.begin(), in_flight.end(), [&](size_t b) {
        return buckets[b].staging.defined() && buckets[b].staging.data_ptr() == buffer.data_ptr();
      });
    };
    at::Tensor* best = nullptr;
    at::Tensor* free = nullptr;
    for (auto& buffer : staging_pool) {
      if (in_use(buffer)) continue;
      free = &buffer;
      if (buffer.numel() >= numel && (best == nullptr || buffer.numel() < best->numel()))
        best = &buffer;
    }
    if (best != nullptr) return *best;
    if (free != nullptr) return *free = at::empty({numel}, params[0].options());
    staging_pool.push_back(at::empty({numel}, params[0].options()));
    return staging_pool.back();
  }

  // The bucket's gradients (zeros for a parameter without one) into one tensor, reduce-scattered
  // into this rank's shard gradient. Stage 2 frees the parameters' gradients on the way.
  void launch(Bucket& bucket) {
    torch::NoGradGuard no_grad;
    if (options.stage == 1) {
      bucket.staging = flat_grads.narrow(0, bucket.offset, bucket.numel);
      for (size_t i : bucket.params)
        detail::stage_gradient(params[i], grad_aliases[i], /*point_grad_at_slot=*/true);
    } else {
      // Stage 2 holds at most kBucketsInFlight buckets: the oldest is waited for (and freed)
      // before another is staged.
      while (in_flight.size() >= kBucketsInFlight) {
        auto& oldest = buckets[in_flight.front()];
        const auto wait_start = Clock::now();
        oldest.work.wait();
        stats.wait_seconds += std::chrono::duration<double>(Clock::now() - wait_start).count();
        oldest.work = comm::Work();
        oldest.staging = at::Tensor();
        in_flight.pop_front();
      }
      bucket.staging = staging_buffer(bucket.numel).narrow(0, 0, bucket.numel);
      int64_t filled = 0;  // elements of the bucket written so far, in order
      for (size_t i : bucket.params) {
        auto& p = params[i];
        auto slot = detail::alias_into(bucket.staging, offsets[i] - bucket.offset, p.sizes());
        detail::stage_gradient(p, slot, /*point_grad_at_slot=*/false);
        p.mutable_grad() = at::Tensor();
        filled += p.numel();
      }
      bucket.staging.narrow(0, filled, bucket.numel - filled).zero_();  // the padding
    }
    bucket.work = group.reduce_scatter_tensor_async(bucket.shard_grad, bucket.staging);
    if (options.stage >= 2) in_flight.push_back(static_cast<size_t>(&bucket - buckets.data()));
  }

  // The end of a synchronised backward, every bucket launched: the reduced shards' gradients in
  // place.
  void finish() {
    torch::NoGradGuard no_grad;
    const auto wait_start = Clock::now();
    for (auto& b : buckets)
      if (b.work.valid()) b.work.wait();
    in_flight.clear();
    // HSDP: each shard is the sum over its sharding group; the sum over every rank is the sum of
    // those across the groups.
    if (replicas.valid()) {
      // One all-reduce of every bucket's shard, side by side.
      std::vector<at::Tensor> shards;
      for (auto& b : buckets) shards.push_back(b.shard_grad.reshape({-1}));
      std::vector<at::Tensor> all{at::cat(shards)};
      replicas.set_activity("ZeRO all-reduce of the gradient shards across the sharding groups");
      replicas.allreduce(all);
      replicas.set_activity("");
      int64_t offset = 0;
      for (auto& b : buckets) {
        const int64_t n = b.shard_grad.numel();
        b.shard_grad.copy_(all[0].narrow(0, offset, n).view_as(b.shard_grad));
        offset += n;
      }
    }
    stats.wait_seconds += std::chrono::duration<double>(Clock::now() - wait_start).count();
    const double scale = 1.0 / data_parallel.world_size();
    for (auto& b : buckets) {
      b.work = comm::Work();
      if (options.stage >= 2) b.staging = at::Tensor();
      b.shard_grad.mul_(scale);
      // zero_grad() (libtorch 2.x: set to none) may have dropped it since the last step.
      b.shard.mutable_grad() = b.shard_grad;
    }
    // From the data-parallel group's first rank: to the first rank of every sharding group, then
    // inside each.
    if (options.broadcast_buffers && !buffers.empty() && replicas.valid())
      detail::broadcast_from_rank0(replicas, buffers);
    if (options.broadcast_buffers && !buffers.empty() && world() > 1)
      detail::broadcast_from_rank0(group, buffers);
    reduced = true;
    ++stats.synchronized_steps;
  }

  // Every rank's stepped shards into every rank's parameters.
  void allgather_parameters() {
    torch::NoGradGuard no_grad;
    std::vector<comm::Work> works;
    std::vector<at::Tensor> inputs;
    int64_t in_flight = 0;
    for (auto& b : buckets) {
      if (b.unit >= 0) continue;  // stage 3: gathered where its forward needs it
      if (in_flight + b.numel > options.allgather_bucket_size && !works.empty()) {
        for (auto& w : works) w.wait();
        works.clear();
        inputs.clear();
        in_flight = 0;
      }
      // In place: this rank's piece of the output is the input (the transport copies it first
      // where it needs to).
      inputs.push_back(b.shard);
      works.push_back(group.allgather_into_async(b.full, inputs.back()));
      stats.bytes_sent_last_step += b.numel / world() * (world() - 1) * b.full.element_size();
      in_flight += b.numel;
    }
    for (auto& w : works) w.wait();
  }

  // The gradients are used up: the next backward starts from zero.
  void consume_gradients() {
    torch::NoGradGuard no_grad;
    if (options.stage == 1) {
      flat_grads.zero_();
      for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = grad_aliases[i];
    }
    reduced = false;
  }

  void remove_hooks() {
    gradients->remove_hooks();
    for (auto& unit : units) unit.module->set_sharding({}, 0);
  }

  // --- Stage 3 ---

  // Starts the all-gather of a unit's parameters into its storage, refilled (nothing when it is
  // gathered or being gathered).
  void gather(Unit& unit, const char* why) {
    if (unit.gathered) return;
    auto& b = buckets[unit.bucket];
    unit_storage.refill(b.full);
    group.set_activity("ZeRO-3 all-gather of unit '" + unit.name + "' (" + why + ")");
    unit.gather = group.allgather_into_async(b.full, b.shard);
    group.set_activity("");
    unit.gathered = true;
    peak_live_units = std::max(peak_live_units, ++live_units);
    live_bytes += b.full.numel() * b.full.element_size();
    stats.gathered_bytes_peak = std::max(stats.gathered_bytes_peak, live_bytes);
    gather_bytes_sent += b.shard.numel() * (world() - 1) * b.shard.element_size();
    ++stats.gathers;
  }

  void wait_gathered(Unit& unit) {
    if (!unit.gather.valid()) return;
    const auto wait_start = Clock::now();
    unit.gather.wait();
    stats.wait_seconds += std::chrono::duration<double>(Clock::now() - wait_start).count();
    unit.gather = comm::Work();
  }

  void reshard(Unit& unit) {
    if (!unit.gathered || pinned > 0) return;
    wait_gathered(unit);
    auto& b = buckets[unit.bucket];
    live_bytes -= b.full.numel() * b.full.element_size();
    --live_units;
    unit_storage.release(b.full, unit_storage.pooled() + live_units < peak_live_units);
    unit.gathered = false;
    unit.ahead = false;
  }

  // The units `order` lists after position `from` (or before it, going backward), all-gathered
  // ahead while they fit prefetch_bucket_size (counting those gathered ahead already, not those
  // in use now) and max_live_parameters. The next unit is gathered ahead even where it alone is
  // larger than the bucket (as DeepSpeed's prefetch takes at least one parameter), so that a
  // model of units larger than the bucket still overlaps each gather with the unit before.
  // `unit_at(k)`: the unit at position k of the order, of `size`.
  template <class UnitAt>
  void prefetch_along(size_t size, const UnitAt& unit_at, size_t from, bool backward,
                      const char* why) {
    if (options.prefetch_bucket_size <= 0) return;
    int64_t ahead = 0;
    for (size_t k = from;;) {
      if (backward ? k == 0 : k + 1 >= size) return;
      k = backward ? k - 1 : k + 1;
      auto& unit = units[unit_at(k)];
      if (unit.gathered && !unit.ahead) continue;  // in use now, not ahead
      const int64_t numel = buckets[unit.bucket].numel;
      if (ahead > 0 && ahead + numel > options.prefetch_bucket_size) return;
      ahead += numel;
      if (unit.gathered) continue;
      const int64_t element = buckets[unit.bucket].shard.element_size();
      if (live_bytes / element + numel > options.max_live_parameters) return;
      gather(unit, why);
      unit.ahead = true;
      ++stats.prefetches;
    }
  }

  void prefetch(const std::vector<size_t>& order, size_t from, bool backward) {
    prefetch_along(
        order.size(), [&](size_t k) { return order[k]; }, from, backward,
        backward ? "prefetch for backward" : "prefetch for forward");
  }

  // In a StepOrderScope: the use (forward or backward of unit u) recorded, and the last step's
  // uses followed ahead while this step keeps to them. One sequence of forwards and backwards,
  // as the schedule ran them: a backward's next unit may be another micro-batch's forward.
  void follow_uses(size_t u, bool backward) {
    const size_t use = 2 * u + (backward ? 1 : 0);
    const size_t position = uses.size();
    uses.push_back(use);
    if (!following_uses) return;
    if (position < previous_uses.size() && previous_uses[position] == use) {
      prefetch_along(
          previous_uses.size(), [&](size_t k) { return previous_uses[k] / 2; }, position,
          /*backward=*/false, "prefetch along the last step's order");
    } else {
      following_uses = false;
      if (!previous_uses.empty()) ++stats.order_changes;
    }
  }

  torch::Tensor forward_unit(size_t u, const std::function<torch::Tensor()>& forward) override {
    auto& unit = units[u];
    const bool training = torch::GradMode::is_enabled();
    {
      std::lock_guard lock(mutex);
      gather(unit, "forward");
      wait_gathered(unit);
      unit.ahead = false;
      // Training: the order is recorded for the backward and the next step, and the previous
      // step's is followed ahead while this one keeps to it.
      if (training) {
        const size_t position = forward_order.size();
        forward_order.push_back(u);
        if (order_scoped) {
          follow_uses(u, /*backward=*/false);
        } else if (following_order && position < previous_order.size() &&
                   previous_order[position] == u) {
          prefetch(previous_order, position, /*backward=*/false);
        } else if (following_order) {
          following_order = false;
          if (!previous_order.empty()) ++stats.order_changes;
        }
      }
    }
    auto output = forward();
    std::lock_guard lock(mutex);
    const bool grad = training && output.requires_grad();
    if (grad) {
      std::weak_ptr<Engine> weak = self;
      output.register_hook([weak, u](const at::Tensor&) {
        if (auto engine = weak.lock()) engine->before_backward(u);
      });
    }
    if (options.reshard_after_forward || !grad) reshard(unit);
    return output;
  }

  // Runs as the gradient of a unit's output arrives, before the unit's backward.
  void before_backward(size_t u) {
    std::lock_guard lock(mutex);
    if (!backward_active) {
      backward_active = true;
      for (auto& unit : units) unit.grads_pending = 0;
      for (size_t i = 0; i < params.size(); ++i)
        if (unit_of[i] >= 0) ++units[static_cast<size_t>(unit_of[i])].grads_pending;
      std::weak_ptr<Engine> weak = self;
      torch::autograd::Engine::get_default_engine().queue_callback([weak] {
        if (auto engine = weak.lock()) engine->end_backward();
      });
    }
    auto& unit = units[u];
    gather(unit, "backward");
    wait_gathered(unit);
    unit.ahead = false;
    if (order_scoped) {
      follow_uses(u, /*backward=*/true);
      return;
    }
    const auto last =
        std::find(forward_order.rbegin(), forward_order.rend(), u);  // its last forward
    if (last != forward_order.rend()) {
      prefetch(forward_order, static_cast<size_t>(forward_order.rend() - last - 1),
               /*backward=*/true);
    }
  }

  // Every unit's parameters freed (those prefetched and not used too, but in a StepOrderScope
  // those gathered ahead for a use to come); this step's order is the next one's guide (in a
  // StepOrderScope: at the scope's end).
  void end_backward() {
    std::lock_guard lock(mutex);
    for (auto& unit : units)
      if (!(order_scoped && unit.ahead)) reshard(unit);
    backward_active = false;
    if (order_scoped) {
      order_pending = true;
      return;
    }
    end_order();
  }

  void open_order_scope() {
    std::lock_guard lock(mutex);
    if (order_scoped) {
      throw UsageError(
          "ZeroOptimizer::StepOrderScope: one is open already; open one per step, after the "
          "last one closed");
    }
    order_scoped = true;
    order_pending = false;
  }

  // `check`: the scope closed (the ranks compare their orders, a collective); else an error
  // ended it and what it recorded is dropped. Either way no unit stays gathered ahead for a use
  // that will not come in this step: the optimizer's step changes the shards.
  void close_order_scope(bool check) {
    std::lock_guard lock(mutex);
    order_scoped = false;
    for (auto& unit : units)
      if (unit.ahead) reshard(unit);
    const bool pending = std::exchange(order_pending, false);
    if (check && pending) {
      end_order();
      previous_uses.swap(uses);
    } else if (!check) {
      forward_order.clear();
      following_order = true;
    }
    uses.clear();
    following_uses = true;
  }

  // The order since the last end checked on every rank and kept as the guide ahead.
  void end_order() {
    check_same_order();
    // Swapped, not moved: both keep their buffers, and the next forward allocates none among
    // its activations, where a block kept past the step would split the heap's holes.
    previous_order.swap(forward_order);
    forward_order.clear();
    following_order = true;
  }

  // Ranks that ran the same number of units in another order paired all-gathers of different
  // units without an error (when their sizes match): every rank's order is compared after each
  // backward (or StepOrderScope), before a step could use what they gathered.
  void check_same_order() {
    uint64_t hash = 1469598103934665603ull;  // FNV-1a over the units' indices
    for (size_t u : forward_order) hash = (hash ^ (u + 1)) * 1099511628211ull;
    group.set_activity("ZeRO-3 check that every rank ran the same units");
    const auto all = group.allgather(torch::tensor({static_cast<int64_t>(hash)}, torch::kLong));
    group.set_activity("");
    const int64_t first = all[0].item<int64_t>();
    std::vector<int> differ;
    for (size_t r = 1; r < all.size(); ++r)
      if (all[r].item<int64_t>() != first) differ.push_back(static_cast<int>(r));
    if (differ.empty()) return;
    std::string order;
    for (size_t u : forward_order) order += (order.empty() ? "" : ", ") + units[u].name;
    std::string ranks;
    for (int r : differ) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    throw UsageError("ZeRO stage 3: ranks [" + ranks +
                     "] ran other FullyShard units, or in another order, than rank 0 in this "
                     "step's forward (rank " +
                     std::to_string(rank()) + " ran: " + (order.empty() ? "none" : order) +
                     "); every rank must run the same units in the same order, or their "
                     "all-gathers mix up parameters");
  }

  // Every unit (`only` < 0), or one.
  std::vector<Unit*> units_of(int64_t only) {
    if (only >= 0) return {&units[static_cast<size_t>(only)]};
    std::vector<Unit*> all;
    for (auto& unit : units) all.push_back(&unit);
    return all;
  }

  // Their parameters whole until release_pinned.
  void gather_pinned(int64_t only) {
    std::lock_guard lock(mutex);
    ++pinned;
    const auto pinning = units_of(only);
    for (Unit* unit : pinning) gather(*unit, "GatheredParameters");
    for (Unit* unit : pinning) wait_gathered(*unit);
  }

  void release_pinned(int64_t only, bool write_back) {
    std::lock_guard lock(mutex);
    if (--pinned > 0) return;
    torch::NoGradGuard no_grad;
    const int64_t n = world();
    for (Unit* unit : units_of(only)) {
      auto& b = buckets[unit->bucket];
      if (write_back && unit->gathered) {
        const int64_t piece = b.numel / n;
        b.shard.copy_(b.full.narrow(0, rank() * piece, piece));
      }
      reshard(*unit);
    }
    // Stages 1 and 2, and stage 3's persistent parameters: the shards are views of the whole.
  }
};

ZeroOptimizer::ZeroOptimizer(std::shared_ptr<torch::nn::Module> module,
                             const torch::optim::Optimizer& optimizer, comm::ProcessGroup group,
                             ZeroOptions options, const std::vector<torch::Tensor>& own_buckets)
    : ZeroOptimizer([&] {
        if (!module) throw UsageError("ZeroOptimizer: the module is null");
        if (!group.valid()) throw UsageError("ZeroOptimizer: the process group is empty");
        auto engine = std::make_shared<Engine>(std::move(module), optimizer, std::move(group),
                                               options, own_buckets);
        engine->self = engine;
        return engine;
      }()) {}

ZeroOptimizer::ZeroOptimizer(std::shared_ptr<Engine> engine)
    : optim::FlatOptimizer(engine->shard_groups(), engine->optimizer_options->clone(),
                           engine->algorithm),
      engine_(std::move(engine)) {
  engine_->attach(*this);
}

ZeroOptimizer::~ZeroOptimizer() { engine_->remove_hooks(); }

torch::Tensor ZeroOptimizer::step(LossClosure closure) {
  torch::Tensor loss;
  if (closure) {
    torch::AutoGradMode enable_grad(true);
    loss = closure();
  }
  auto& e = *engine_;
  {
    std::lock_guard lock(e.mutex);
    if (!e.reduced) {
      throw UsageError(
          "ZeroOptimizer::step: no synchronised backward since the last step (under no_sync() "
          "the gradients stay local): run backward outside no_sync() first");
    }
    // A reduce-scatter sends the (N - 1) pieces of a bucket that other ranks own (Gloo's
    // all-to-all and NCCL's ring alike); the all-gather after the step as many again.
    e.stats.bytes_sent_last_step = 0;
    for (const auto& b : e.buckets)
      e.stats.bytes_sent_last_step += b.numel / e.world() * (e.world() - 1) * b.full.element_size();
    // HSDP: a ring all-reduce of the shards across the groups sends 2 (R - 1) / R of them.
    if (e.replicas.valid()) {
      const int64_t r = e.replicas.world_size();
      for (const auto& b : e.buckets)
        e.stats.bytes_sent_last_step +=
            2 * (b.numel / e.world()) * (r - 1) / r * b.full.element_size();
    }
    e.stats.bytes_sent_last_step += e.gather_bytes_sent;
    e.gather_bytes_sent = 0;
  }
  optim::FlatOptimizer::step();
  // A peer's failure in the all-gather leaves this rank's shard stepped (and its replicas'
  // with it): the step counts as taken, and gather_parameters_from_shards() completes it.
  e.gathering_stepped = true;
  e.allgather_parameters();
  e.gathering_stepped = false;
  e.consume_gradients();
  return loss;
}

bool ZeroOptimizer::stepped_before_failure() const { return engine_->gathering_stepped; }

void ZeroOptimizer::gather_parameters_from_shards() {
  // Stage 3 gathers its units from the shards at each use.
  if (engine_->options.stage < 3) engine_->allgather_parameters();
}

torch::Tensor ZeroOptimizer::clip_grad_norm(double max_norm) {
  if (!(max_norm > 0))
    throw UsageError("gradient clipping max_norm " + format_number(max_norm) + " must be > 0");
  torch::NoGradGuard no_grad;
  auto& e = *engine_;
  auto squares = at::zeros({1}, e.buckets.front().shard_grad.options().dtype(at::kFloat));
  for (const auto& b : e.buckets) squares.add_(b.shard_grad.pow(2).sum().to(at::kFloat));
  std::vector<at::Tensor> total{squares};
  e.group.allreduce(total);
  const auto norm = total[0].sqrt().reshape({});
  const auto coefficient = (max_norm / (norm + 1e-6)).clamp_max(1.0);
  for (auto& b : e.buckets) b.shard_grad.mul_(coefficient.to(b.shard_grad.scalar_type()));
  return norm;
}

void ZeroOptimizer::skip_step() {
  optim::FlatOptimizer::skip_step();
  engine_->consume_gradients();
}

std::vector<ZeroOptimizer::ShardPiece> ZeroOptimizer::shard_pieces() const {
  const auto& e = *engine_;
  std::vector<ShardPiece> pieces;
  for (size_t g = 0; g < e.buckets.size(); ++g) {
    const auto& b = e.buckets[g];
    const int64_t piece = b.numel / e.world();
    const int64_t first = b.offset + e.rank() * piece;  // in the flat buffer
    for (size_t i : b.params) {
      const int64_t start = std::max(first, e.offsets[i]);
      const int64_t end = std::min(first + piece, e.offsets[i] + e.params[i].numel());
      if (start >= end) continue;
      pieces.push_back({e.names[i], e.params[i].sizes().vec(), start - e.offsets[i], end - start, g,
                        start - first});
    }
  }
  return pieces;
}

void ZeroOptimizer::set_steps(int64_t steps) {
  for (size_t g = 0; g < param_groups().size(); ++g) set_steps_taken(g, steps);
}

optim::StateDict ZeroOptimizer::state_dict() const {
  optim::StateDict out;
  const auto names = state_names();
  const bool on_disk = state_offloaded();
  for (const auto& piece : shard_pieces()) {
    const auto buffers = shard_state(piece.group);
    const int64_t numel = c10::multiply_integers(piece.shape);
    for (size_t s = 0; s < names.size(); ++s) {
      std::function<void()> release;
      if (on_disk) {
        release = [this, group = piece.group, s, offset = piece.offset, length = piece.length] {
          release_state_pages(group, s, offset, length);
        };
      }
      const auto [it, added] = out.tensors.emplace(
          piece.parameter + "/" + names[s],
          optim::StateTensor{.values = buffers[s].narrow(0, piece.offset, piece.length),
                             .offset = piece.begin,
                             .numel = numel,
                             .release = release});
      if (!added) {
        throw std::logic_error("ZeroOptimizer::state_dict: parameter '" + piece.parameter +
                               "' lies in two pieces of rank " +
                               std::to_string(process_group().rank()) + "'s shard");
      }
    }
  }
  out.values = optim::optimizer_state_values(algorithm(), names, steps(),
                                             param_groups().front().options().get_lr());
  out.values["stage"] = stage();
  out.shard = process_group().rank();
  out.shards = process_group().world_size();
  return out;
}

void ZeroOptimizer::check_state(const Json& values) const {
  optim::check_optimizer_state(values, algorithm(), state_names());
}

void ZeroOptimizer::load_state_dict(const optim::StateDict& state) {
  torch::NoGradGuard no_grad;
  check_state(state.values);
  const auto names = state_names();
  for (const auto& piece : shard_pieces()) {
    auto buffers = shard_state(piece.group);
    for (size_t s = 0; s < names.size(); ++s) {
      const auto found = state.tensors.find(piece.parameter + "/" + names[s]);
      if (found == state.tensors.end()) {
        throw UsageError("the checkpoint holds no " + names[s] + " of parameter '" +
                         piece.parameter + "': it was written for another model");
      }
      auto target = buffers[s].narrow(0, piece.offset, piece.length);
      if (found->second.values.data_ptr() != target.data_ptr()) target.copy_(found->second.values);
    }
  }
  set_steps(state.values.value("steps", int64_t{0}));
  const double lr = state.values.value("lr", param_groups().front().options().get_lr());
  for (auto& group : param_groups()) group.options().set_lr(lr);
}

int ZeroOptimizer::stage() const { return engine_->options.stage; }

const comm::ProcessGroup& ZeroOptimizer::process_group() const { return engine_->group; }

int ZeroOptimizer::replica() const { return engine_->replica(); }

int ZeroOptimizer::checkpoint_rank() const { return engine_->group.rank(); }

bool ZeroOptimizer::writes_state() const { return replica() == 0; }

bool ZeroOptimizer::every_rank_saves() const {
  return replica() == 0 && engine_->group.world_size() > 1;
}

std::vector<std::string> ZeroOptimizer::sharded_units() const { return unit_names(); }

std::map<std::string, optim::StateTensor> ZeroOptimizer::parameter_shards() const {
  const auto& e = *engine_;
  std::map<std::string, optim::StateTensor> out;
  // Every unit parameter, with no elements where this rank's shard holds none of it.
  for (size_t k = 0; k < e.params.size(); ++k) {
    if (e.unit_of.empty() || e.unit_of[k] < 0) continue;
    out[e.names[k]] = {.values = e.buckets[e.bucket_of[k]].shard.narrow(0, 0, 0),
                       .offset = 0,
                       .numel = e.params[k].numel()};
  }
  for (const auto& piece : shard_pieces()) {
    const auto found = out.find(piece.parameter);
    if (found == out.end()) continue;  // whole on every rank
    found->second.values = e.buckets[piece.group].shard.narrow(0, piece.offset, piece.length);
    found->second.offset = piece.begin;
  }
  return out;
}

std::unique_ptr<optim::ParameterGather> ZeroOptimizer::gather_parameters(int64_t unit,
                                                                         bool write_back) const {
  if (unit < 0) return std::make_unique<GatheredParameters>(*this, write_back);
  return std::make_unique<GatheredParameters>(*this, static_cast<size_t>(unit), write_back);
}

ZeroStats ZeroOptimizer::stats() const {
  std::lock_guard lock(engine_->mutex);
  engine_->update_memory_stats();
  return engine_->stats;
}

ZeroOptimizer::GatheredParameters::GatheredParameters(const ZeroOptimizer& zero, bool write_back)
    : engine_(zero.engine_), write_back_(write_back) {
  engine_->gather_pinned(unit_);
}

ZeroOptimizer::GatheredParameters::GatheredParameters(const ZeroOptimizer& zero, size_t unit,
                                                      bool write_back)
    : engine_(zero.engine_), write_back_(write_back), unit_(static_cast<int64_t>(unit)) {
  if (unit >= engine_->units.size()) {
    throw UsageError("ZeroOptimizer::GatheredParameters: unit " + std::to_string(unit) +
                     " does not exist: the model has " + std::to_string(engine_->units.size()) +
                     " sharded units (unit_names())");
  }
  engine_->gather_pinned(unit_);
}

ZeroOptimizer::GatheredParameters::~GatheredParameters() {
  engine_->release_pinned(unit_, write_back_);
}

torch::Tensor ZeroOptimizer::shard_gradient(const torch::Tensor& parameter) const {
  const auto& e = *engine_;
  const size_t i = e.index_of(parameter);
  if (i == e.params.size()) {
    throw UsageError(
        "ZeroOptimizer::shard_gradient: not a trainable parameter of the module this engine "
        "shards");
  }
  if (e.alone.empty() || e.alone[i] == 0) {
    throw UsageError("ZeroOptimizer::shard_gradient: parameter '" + e.names[i] +
                     "' shares its bucket with others: give it to the constructor's "
                     "own_buckets");
  }
  return e.buckets[e.bucket_of[i]].shard_grad;
}

std::vector<std::string> ZeroOptimizer::unit_names() const {
  std::vector<std::string> names;
  for (const auto& unit : engine_->units) names.push_back(unit.name);
  return names;
}

ZeroOptimizer::NoSyncGuard::NoSyncGuard(ZeroOptimizer& zero)
    : zero_(zero), previous_(zero.engine_->gradients->sync()) {
  zero_.engine_->gradients->set_sync(false);
}

ZeroOptimizer::NoSyncGuard::~NoSyncGuard() { zero_.engine_->gradients->set_sync(previous_); }

ZeroOptimizer::StepOrderScope::StepOrderScope(ZeroOptimizer& zero) : engine_(zero.engine_) {
  engine_->open_order_scope();
}

ZeroOptimizer::StepOrderScope::~StepOrderScope() {
  if (!engine_) return;
  // An error is stopping the step (close() was not reached): that error is the one to report,
  // not a wait for a gather of a group that the error may have broken.
  try {
    engine_->close_order_scope(/*check=*/false);
  } catch (...) {
  }
}

void ZeroOptimizer::StepOrderScope::close() {
  auto engine = std::move(engine_);
  if (engine) engine->close_order_scope(/*check=*/true);
}

}  // namespace cohort::parallel

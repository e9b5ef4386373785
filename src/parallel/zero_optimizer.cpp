#include "cohort/parallel/zero_optimizer.h"

#include <c10/util/strides.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/torch.h>

#include <chrono>
#include <deque>
#include <mutex>
#include <utility>

#include "cohort/error.h"
#include "replicas.h"

namespace cohort::parallel {
namespace {

using Clock = std::chrono::steady_clock;

// A tensor of `sizes` over flat's storage from element `offset` on, made with set_() (not an
// autograd view), as the parameters and their gradients must be.
at::Tensor alias_into(const at::Tensor& flat, int64_t offset, at::IntArrayRef sizes) {
  auto t = at::empty({0}, flat.options());
  t.set_(flat.storage(), flat.storage_offset() + offset, sizes, c10::contiguous_strides(sizes));
  return t;
}

}  // namespace

void ZeroOptions::validate() const {
  if (stage == 3) {
    throw UsageError(
        "ZeRO stage 3 (sharded parameters) is not built yet: use stage 2, which shards the "
        "gradients and the optimizer state");
  }
  if (stage < 0 || stage > 3) {
    throw UsageError("ZeRO stage " + std::to_string(stage) +
                     " is not one of 0 (DDP), 1 (optimizer state sharded), 2 (gradients too)");
  }
  if (reduce_bucket_size <= 0) {
    throw UsageError("ZeRO reduce_bucket_size " + std::to_string(reduce_bucket_size) +
                     " must be > 0 elements");
  }
  if (allgather_bucket_size <= 0) {
    throw UsageError("ZeRO allgather_bucket_size " + std::to_string(allgather_bucket_size) +
                     " must be > 0 elements");
  }
}

struct ZeroOptimizer::Engine {
  struct Bucket {
    std::vector<size_t> params;  // indices into `params`, in the flat buffer's order
    int64_t offset = 0;          // in the flat buffer
    int64_t numel = 0;           // padded to a multiple of the world size
    at::Tensor shard;            // this rank's piece of the parameters (the optimizer's param)
    at::Tensor shard_grad;       // its reduced gradient (the optimizer's gradient buffer)
    at::Tensor staging;          // the bucket's gradients while they are reduce-scattered
    size_t pending = 0;
    comm::Work work;
  };

  std::shared_ptr<torch::nn::Module> module;
  comm::ProcessGroup group;
  ZeroOptions options;
  std::string algorithm;
  std::unique_ptr<torch::optim::OptimizerOptions> optimizer_options;
  std::vector<std::string> names;
  std::vector<at::Tensor> params;  // trainable, aliases into flat_params
  std::vector<at::Tensor> buffers;
  std::vector<int64_t> offsets;   // per parameter, in the flat buffer
  std::vector<size_t> bucket_of;  // per parameter
  at::Tensor flat_params;
  at::Tensor flat_grads;  // stage 1: every parameter's .grad is an alias into it
  std::vector<at::Tensor> grad_aliases;
  std::vector<Bucket> buckets;
  // A parameter's gradient accumulator: a shared_ptr in libtorch 1.13, an intrusive_ptr in 2.x.
  using Accumulator =
      decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));
  std::vector<std::pair<Accumulator, uintptr_t>> hooks;
  std::weak_ptr<Engine> self;
  optim::FlatOptimizer* optimizer = nullptr;  // the ZeroOptimizer this engine serves

  mutable std::mutex mutex;
  bool sync_enabled = true;
  bool step_active = false;
  bool reduced = false;  // a synchronised backward ended since the last step
  size_t next_bucket = 0;
  std::deque<size_t> in_flight;  // stage 2: buckets being reduce-scattered, oldest first
  static constexpr size_t kBucketsInFlight = 2;
  std::vector<at::Tensor> staging_pool;  // stage 2: kBucketsInFlight buffers, reused in turn
  size_t next_staging = 0;
  int64_t max_bucket_numel = 0;
  std::vector<char> ready;
  ZeroStats stats;

  int world() const { return group.world_size(); }
  int rank() const { return group.rank(); }

  Engine(std::shared_ptr<torch::nn::Module> m, const torch::optim::Optimizer& optimizer,
         comm::ProcessGroup g, ZeroOptions o)
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
    detail::start_replicas(group, names, params, buffers, "ZeroOptimizer");
    lay_out();
  }

  // Buckets in reverse registration order, each padded to a multiple of the world size; the
  // parameters re-pointed into the flat buffer, and the shards cut out of it.
  void lay_out() {
    torch::NoGradGuard no_grad;
    const int64_t n = world();
    Bucket current;
    int64_t offset = 0;
    auto close = [&] {
      current.numel = (current.numel + n - 1) / n * n;
      offset = current.offset + current.numel;
      buckets.push_back(std::move(current));
      current = Bucket{};
      current.offset = offset;
    };
    offsets.assign(params.size(), 0);
    bucket_of.assign(params.size(), 0);
    for (size_t k = params.size(); k-- > 0;) {
      const int64_t numel = params[k].numel();
      if (!current.params.empty() && current.numel + numel > options.reduce_bucket_size) close();
      offsets[k] = current.offset + current.numel;
      bucket_of[k] = buckets.size();
      current.params.push_back(k);
      current.numel += numel;
    }
    close();
    flat_params = at::zeros({offset}, params[0].options());
    for (size_t i = 0; i < params.size(); ++i) {
      auto slot = alias_into(flat_params, offsets[i], params[i].sizes());
      slot.copy_(params[i]);
      params[i].set_data(slot);
    }
    if (options.stage == 1) {
      flat_grads = at::zeros({offset}, params[0].options());
      for (size_t i = 0; i < params.size(); ++i) {
        grad_aliases.push_back(alias_into(flat_grads, offsets[i], params[i].sizes()));
        params[i].mutable_grad() = grad_aliases.back();
      }
    }
    for (auto& b : buckets) {
      const int64_t piece = b.numel / n;
      b.shard = alias_into(flat_params, b.offset + rank() * piece, {piece});
      // Stage 1 reduces each bucket in place: the shard's gradient is its piece of the full
      // gradient buffer (the flat optimizer adopts it).
      if (options.stage == 1)
        b.shard.mutable_grad() = alias_into(flat_grads, b.offset + rank() * piece, {piece});
      stats.shard_numel += piece;
      max_bucket_numel = std::max(max_bucket_numel, b.numel);
    }
    ready.assign(params.size(), 0);
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
    update_memory_stats();
  }

  void update_memory_stats() {
    stats.parameter_bytes = flat_params.numel() * flat_params.element_size();
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
    std::weak_ptr<Engine> weak = self;
    for (size_t i = 0; i < params.size(); ++i) {
      auto accumulator = torch::autograd::impl::grad_accumulator(params[i]);
      auto key =
          accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
              [weak, i](const torch::autograd::variable_list& outputs,
                        const torch::autograd::variable_list&) {
                if (auto engine = weak.lock()) engine->on_gradient_ready(i);
                return outputs;
              }));
      hooks.emplace_back(std::move(accumulator), key);
    }
  }

  void begin_step() {
    step_active = true;
    next_bucket = 0;
    std::fill(ready.begin(), ready.end(), 0);
    for (auto& b : buckets) b.pending = b.params.size();
    std::weak_ptr<Engine> weak = self;
    torch::autograd::Engine::get_default_engine().queue_callback([weak] {
      if (auto engine = weak.lock()) engine->finalize();
    });
  }

  void on_gradient_ready(size_t i) {
    std::lock_guard lock(mutex);
    if (!sync_enabled) return;
    if (!step_active) begin_step();
    if (ready[i]) return;
    ready[i] = 1;
    auto& bucket = buckets[bucket_of[i]];
    if (--bucket.pending == 0 && options.overlap_comm) launch_ready_buckets();
  }

  // Buckets are launched in order on every rank, so that the collectives match.
  void launch_ready_buckets() {
    while (next_bucket < buckets.size() && buckets[next_bucket].pending == 0)
      launch(buckets[next_bucket++]);
  }

  // The bucket's gradients (zeros for a parameter without one) into one tensor, reduce-scattered
  // into this rank's shard gradient. Stage 2 frees the parameters' gradients on the way.
  void launch(Bucket& bucket) {
    torch::NoGradGuard no_grad;
    if (options.stage == 1) {
      bucket.staging = flat_grads.narrow(0, bucket.offset, bucket.numel);
      for (size_t i : bucket.params) {
        auto& p = params[i];
        const auto& grad = p.grad();
        auto& slot = grad_aliases[i];
        if (grad.defined() && grad.data_ptr() == slot.data_ptr()) continue;
        if (grad.defined()) {
          slot.copy_(grad);
        } else {
          slot.zero_();
        }
        p.mutable_grad() = slot;
      }
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
      // The staging buffers are kept from step to step: a fresh 100 MB buffer costs a page fault
      // per 4 KiB.
      if (staging_pool.size() < kBucketsInFlight)
        staging_pool.push_back(at::empty({max_bucket_numel}, flat_params.options()));
      auto& buffer = staging_pool[next_staging++ % staging_pool.size()];
      bucket.staging = buffer.narrow(0, 0, bucket.numel);
      int64_t filled = 0;  // elements of the bucket written so far, in order
      for (size_t i : bucket.params) {
        auto& p = params[i];
        auto slot = alias_into(bucket.staging, offsets[i] - bucket.offset, p.sizes());
        if (p.grad().defined()) {
          slot.copy_(p.grad());
          p.mutable_grad() = at::Tensor();
        } else {
          slot.zero_();
        }
        filled += p.numel();
      }
      bucket.staging.narrow(0, filled, bucket.numel - filled).zero_();  // the padding
    }
    bucket.work = group.reduce_scatter_tensor_async(bucket.shard_grad, bucket.staging);
    if (options.stage == 2) in_flight.push_back(static_cast<size_t>(&bucket - buckets.data()));
  }

  void finalize() {
    std::lock_guard lock(mutex);
    torch::NoGradGuard no_grad;
    step_active = false;
    for (auto& b : buckets) b.pending = 0;
    launch_ready_buckets();
    const auto wait_start = Clock::now();
    for (auto& b : buckets)
      if (b.work.valid()) b.work.wait();
    stats.wait_seconds += std::chrono::duration<double>(Clock::now() - wait_start).count();
    in_flight.clear();
    const double scale = 1.0 / world();
    for (auto& b : buckets) {
      b.work = comm::Work();
      if (options.stage == 2) b.staging = at::Tensor();
      b.shard_grad.mul_(scale);
      // zero_grad() (libtorch 2.x: set to none) may have dropped it since the last step.
      b.shard.mutable_grad() = b.shard_grad;
    }
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
      if (in_flight + b.numel > options.allgather_bucket_size && !works.empty()) {
        for (auto& w : works) w.wait();
        works.clear();
        inputs.clear();
        in_flight = 0;
      }
      // In place: this rank's piece of the output is the input (the transport copies it first
      // where it needs to).
      inputs.push_back(b.shard);
      auto output = flat_params.narrow(0, b.offset, b.numel);
      works.push_back(group.allgather_into_async(output, inputs.back()));
      stats.bytes_sent_last_step += b.numel / world() * (world() - 1) * flat_params.element_size();
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
    for (auto& [node, key] : hooks) node->del_post_hook(key);
    hooks.clear();
  }
};

ZeroOptimizer::ZeroOptimizer(std::shared_ptr<torch::nn::Module> module,
                             const torch::optim::Optimizer& optimizer, comm::ProcessGroup group,
                             ZeroOptions options)
    : ZeroOptimizer([&] {
        if (!module) throw UsageError("ZeroOptimizer: the module is null");
        if (!group.valid()) throw UsageError("ZeroOptimizer: the process group is empty");
        auto engine =
            std::make_shared<Engine>(std::move(module), optimizer, std::move(group), options);
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
      e.stats.bytes_sent_last_step +=
          b.numel / e.world() * (e.world() - 1) * e.flat_params.element_size();
  }
  optim::FlatOptimizer::step();
  e.allgather_parameters();
  e.consume_gradients();
  return loss;
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

int ZeroOptimizer::stage() const { return engine_->options.stage; }

const comm::ProcessGroup& ZeroOptimizer::process_group() const { return engine_->group; }

ZeroStats ZeroOptimizer::stats() const {
  std::lock_guard lock(engine_->mutex);
  engine_->update_memory_stats();
  return engine_->stats;
}

ZeroOptimizer::NoSyncGuard::NoSyncGuard(ZeroOptimizer& zero)
    : zero_(zero), previous_(zero.engine_->sync_enabled) {
  zero_.engine_->sync_enabled = false;
}

ZeroOptimizer::NoSyncGuard::~NoSyncGuard() { zero_.engine_->sync_enabled = previous_; }

}  // namespace cohort::parallel

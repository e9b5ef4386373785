#include "comm/transport.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/maximum.h>
#include <ATen/ops/minimum.h>
#include <c10/core/TensorOptions.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#ifdef COHORT_WITH_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <signal.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>

#include "cohort/error.h"

namespace cohort::comm {

struct ScratchPool {
  std::mutex mutex;
  std::vector<at::Tensor> free;
  int64_t bytes = 0;  // of every buffer made, free or in use
};

Transport::Transport(Kind kind, c10::intrusive_ptr<NativeGroup> native, int rank, int world_size,
                     std::chrono::milliseconds timeout)
    : kind_(kind),
      native_(std::move(native)),
      rank_(rank),
      world_size_(world_size),
      timeout_(timeout),
      scratch_pool_(std::make_shared<ScratchPool>()) {}

std::shared_ptr<at::Tensor> Transport::scratch(int64_t numel, const at::Tensor& like) {
  at::Tensor buffer;
  {
    // The smallest free buffer that fits: a small request that took the largest would leave the
    // next large one to allocate another, and the pool would grow by a large buffer a step.
    std::lock_guard lock(scratch_pool_->mutex);
    auto& free = scratch_pool_->free;
    auto best = free.end();
    for (auto it = free.begin(); it != free.end(); ++it) {
      if (it->numel() >= numel && it->scalar_type() == like.scalar_type() &&
          it->device() == like.device() && (best == free.end() || it->numel() < best->numel())) {
        best = it;
      }
    }
    if (best != free.end()) {
      buffer = *best;
      free.erase(best);
    }
  }
  if (!buffer.defined()) {
    buffer = at::empty({numel}, like.options());
    std::lock_guard lock(scratch_pool_->mutex);
    scratch_pool_->bytes += numel * buffer.element_size();
  }
  std::weak_ptr<ScratchPool> pool = scratch_pool_;
  return std::shared_ptr<at::Tensor>(new at::Tensor(buffer.narrow(0, 0, numel)),
                                     [pool, buffer](at::Tensor* t) {
                                       delete t;
                                       if (auto p = pool.lock()) {
                                         std::lock_guard lock(p->mutex);
                                         p->free.push_back(buffer);
                                       }
                                     });
}

int64_t Transport::scratch_bytes() const {
  std::lock_guard lock(scratch_pool_->mutex);
  return scratch_pool_->bytes;
}

bool Transport::gloo_all_to_all_fits(const at::Tensor& t) const {
  return kind_ == Kind::kGloo && t.is_cpu() &&
         (t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble);
}

c10d::ReduceOp Transport::native_op(ReduceOp op) const {
  switch (op) {
    case ReduceOp::kMax:
      return c10d::ReduceOp::MAX;
    case ReduceOp::kMin:
      return c10d::ReduceOp::MIN;
    case ReduceOp::kAvg:
      // NCCL averages on the device; Gloo sums and average() divides.
      return kind_ == Kind::kNccl ? c10d::ReduceOp::AVG : c10d::ReduceOp::SUM;
    case ReduceOp::kSum:
      break;
  }
  return c10d::ReduceOp::SUM;
}

std::function<void()> Transport::average(std::vector<at::Tensor> tensors) const {
  return [tensors = std::move(tensors), n = static_cast<double>(world_size_)]() mutable {
    for (auto& t : tensors) t.div_(n);
  };
}

Started Transport::allreduce(std::vector<at::Tensor>& tensors, ReduceOp op) {
  const auto dtype = tensors.front().scalar_type();
  if (kind_ == Kind::kGloo && (dtype == at::kHalf || dtype == at::kBFloat16)) {
    return allreduce_by_allgather(tensors, op);
  }
  c10d::AllreduceOptions opts;
  opts.reduceOp = native_op(op);
  opts.timeout = timeout_;
  Started started{native_->allreduce(tensors, opts), nullptr};
  if (op == ReduceOp::kAvg && kind_ == Kind::kGloo) started.finish = average(tensors);
  return started;
}

Started Transport::allreduce_by_allgather(std::vector<at::Tensor>& tensors, ReduceOp op) {
  std::vector<at::Tensor> flats;
  for (const auto& t : tensors) flats.push_back(t.reshape({-1}));
  // As bytes: int8 is a dtype every Gloo build moves (int16 is not).
  const auto bits = at::cat(flats).view(at::kChar);
  std::vector<at::Tensor> gathered;
  for (int r = 0; r < world_size_; ++r) gathered.push_back(at::empty_like(bits));
  Started started = allgather(gathered, bits);
  started.finish = [tensors, gathered, op, world = world_size_]() mutable {
    const auto dtype = tensors.front().scalar_type();
    auto result = gathered[0].view(dtype).to(at::kFloat);
    for (size_t r = 1; r < gathered.size(); ++r) {
      const auto other = gathered[r].view(dtype).to(at::kFloat);
      if (op == ReduceOp::kMax) {
        result = at::maximum(result, other);
      } else if (op == ReduceOp::kMin) {
        result = at::minimum(result, other);
      } else {
        result.add_(other);
      }
    }
    if (op == ReduceOp::kAvg) result.div_(static_cast<double>(world));
    int64_t offset = 0;
    for (auto& t : tensors) {
      t.copy_(result.narrow(0, offset, t.numel()).view_as(t));
      offset += t.numel();
    }
  };
  return started;
}

Started Transport::broadcast(std::vector<at::Tensor>& tensors, int root) {
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  opts.timeout = timeout_;
  return {native_->broadcast(tensors, opts), nullptr};
}

Started Transport::allgather(std::vector<at::Tensor>& outputs, const at::Tensor& input) {
  std::vector<std::vector<at::Tensor>> nested{outputs};
  std::vector<at::Tensor> inputs{input};
  c10d::AllgatherOptions opts;
  opts.timeout = timeout_;
  return {native_->allgather(nested, inputs, opts), nullptr};
}

Started Transport::allgather_into(at::Tensor& output, const at::Tensor& input) {
  c10d::AllgatherOptions opts;
  opts.timeout = timeout_;
  at::Tensor in = input;
  if (kind_ == Kind::kNccl) return {native_->_allgather_base(output, in, opts), nullptr};
  if (gloo_all_to_all_fits(input) && output.is_contiguous()) {
    // Gloo in 1.13 has no all-gather into one tensor, and its list form copies through a fresh
    // buffer: an all-to-all of N copies of the input lands in `output` directly.
    const int64_t n = input.numel();
    auto copies = scratch(n * world_size_, input);
    for (int r = 0; r < world_size_; ++r) copies->narrow(0, r * n, n).copy_(input.reshape({-1}));
    auto flat = output.view({-1});
    Started started = all_to_all(flat, *copies, {}, {});
    started.finish = [copies] {};  // holds the copies until the all-to-all completed
    return started;
  }
  // Otherwise the list form, writing into views of the output.
  std::vector<at::Tensor> views;
  const int64_t n = input.numel();
  for (int r = 0; r < world_size_; ++r)
    views.push_back(output.view({-1}).narrow(0, r * n, n).view_as(input));
  return allgather(views, input);
}

Started Transport::reduce_scatter_by_allreduce(at::Tensor& output, at::Tensor flat, ReduceOp op) {
  std::vector<at::Tensor> tensors{flat};
  Started started = allreduce(tensors, op == ReduceOp::kAvg ? ReduceOp::kSum : op);
  const int64_t n = output.numel();
  started.finish = [output, flat, n, rank = rank_, op, world = world_size_]() mutable {
    auto mine = flat.narrow(0, rank * n, n).view_as(output);
    if (op == ReduceOp::kAvg) mine = mine.div(static_cast<double>(world));
    output.copy_(mine);
  };
  return started;
}

Started Transport::reduce_scatter(at::Tensor& output, std::vector<at::Tensor>& inputs,
                                  ReduceOp op) {
  if (kind_ == Kind::kNccl) {
    std::vector<at::Tensor> outputs{output};
    std::vector<std::vector<at::Tensor>> nested{inputs};
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = native_op(op);
    opts.timeout = timeout_;
    return {native_->reduce_scatter(outputs, nested, opts), nullptr};
  }
  std::vector<at::Tensor> flats;
  for (const auto& t : inputs) flats.push_back(t.reshape({-1}));
  return reduce_scatter_gloo(output, at::cat(flats), op);
}

Started Transport::reduce_scatter_by_all_to_all(at::Tensor& output, at::Tensor flat, ReduceOp op) {
  // Each rank sends rank j its j-th piece and reduces the pieces it receives: (N - 1) / N of the
  // input on the wire, half of what an all-reduce moves. The reduction reads only the received
  // pieces, so `output` may be this rank's piece of the input (in place).
  auto received = scratch(flat.numel(), flat);
  Started started = all_to_all(*received, flat, {}, {});
  started.finish = [output, received, op, world = world_size_]() mutable {
    auto pieces = received->view({world, -1});
    auto target = output.view({-1});
    const bool direct = target.is_contiguous();
    at::Tensor result = direct ? target : at::empty_like(target);
    result.copy_(pieces[0]);
    for (int r = 1; r < world; ++r) {
      if (op == ReduceOp::kMax) {
        at::maximum_out(result, result, pieces[r]);
      } else if (op == ReduceOp::kMin) {
        at::minimum_out(result, result, pieces[r]);
      } else {
        result.add_(pieces[r]);
      }
    }
    if (op == ReduceOp::kAvg) result.div_(static_cast<double>(world));
    if (!direct) target.copy_(result);
  };
  return started;
}

Started Transport::reduce_scatter_gloo(at::Tensor& output, at::Tensor flat, ReduceOp op) {
  // Gloo has no reduce-scatter in libtorch 1.13: an all-to-all where Gloo has one (CPU tensors of
  // the common float types), an all-reduce otherwise.
  if (gloo_all_to_all_fits(flat)) return reduce_scatter_by_all_to_all(output, std::move(flat), op);
  return reduce_scatter_by_allreduce(output, std::move(flat), op);
}

Started Transport::reduce_scatter_tensor(at::Tensor& output, const at::Tensor& input, ReduceOp op) {
  if (kind_ == Kind::kNccl) {
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = native_op(op);
    opts.timeout = timeout_;
    at::Tensor in = input;
    return {native_->_reduce_scatter_base(output, in, opts), nullptr};
  }
  // A copy where the reduction runs in place, so that the caller's input stays as it was.
  const auto flat = input.reshape({-1});
  return reduce_scatter_gloo(output, gloo_all_to_all_fits(flat) ? flat.contiguous() : flat.clone(),
                             op);
}

Started Transport::all_to_all(at::Tensor& output, const at::Tensor& input,
                              std::vector<int64_t> output_splits,
                              std::vector<int64_t> input_splits) {
  c10d::AllToAllOptions opts;
  opts.timeout = timeout_;
  at::Tensor in = input;
  return {native_->alltoall_base(output, in, output_splits, input_splits, opts), nullptr};
}

Started Transport::send(const at::Tensor& tensor, int peer, int tag) {
  // Gloo sends from host memory: a CUDA tensor goes through a host copy.
  std::vector<at::Tensor> tensors{kind_ == Kind::kGloo && !tensor.is_cpu() ? tensor.cpu() : tensor};
  return {native_->send(tensors, peer, tag), nullptr};
}

Started Transport::recv(at::Tensor& tensor, int peer, int tag) {
  if (kind_ == Kind::kGloo && !tensor.is_cpu()) {
    std::vector<at::Tensor> host{at::empty(tensor.sizes(), tensor.options().device(c10::kCPU))};
    Started started{native_->recv(host, peer, tag), nullptr};
    started.finish = [tensor, staged = host[0]]() mutable { tensor.copy_(staged); };
    return started;
  }
  std::vector<at::Tensor> tensors{tensor};
  return {native_->recv(tensors, peer, tag), nullptr};
}

Started Transport::barrier() {
  c10d::BarrierOptions opts;
  opts.timeout = timeout_;
  return {native_->barrier(opts), nullptr};
}

namespace {

// Gloo writes to its peers' sockets without MSG_NOSIGNAL: a peer that died would kill this
// process with SIGPIPE instead of failing the collective with a PeerFailureError. A program that
// chose its own SIGPIPE handling keeps it; the default (terminate) becomes "ignore", as in Python.
void ignore_sigpipe_unless_handled() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction current {};
    if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
      struct sigaction ignore {};
      ignore.sa_handler = SIG_IGN;
      sigemptyset(&ignore.sa_mask);
      ::sigaction(SIGPIPE, &ignore, nullptr);
    }
  });
}

}  // namespace

std::unique_ptr<Transport> make_gloo_transport(const c10::intrusive_ptr<c10d::Store>& store,
                                               int rank, int world_size,
                                               const ProcessGroupOptions& options) {
  ignore_sigpipe_unless_handled();
  auto gloo_options = c10d::ProcessGroupGloo::Options::create(options.timeout);
  try {
    gloo_options->devices.push_back(
        c10d::ProcessGroupGloo::createDeviceForHostname(options.interface_address));
  } catch (const std::exception& e) {
    throw UsageError("process group: cannot use interface address '" + options.interface_address +
                     "': " + e.what() + " (give an address of this host)");
  }
  gloo_options->threads = std::max(1, options.threads);
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("gloo", store);
  auto native =
      c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, rank, world_size, gloo_options);
  return std::make_unique<Transport>(Transport::Kind::kGloo, std::move(native), rank, world_size,
                                     options.timeout);
}

bool nccl_available() {
#ifdef COHORT_WITH_NCCL
  return true;
#else
  return false;
#endif
}

std::unique_ptr<Transport> make_nccl_transport(const c10::intrusive_ptr<c10d::Store>& store,
                                               int rank, int world_size,
                                               const ProcessGroupOptions& options) {
#ifdef COHORT_WITH_NCCL
  // A NCCL collective that a dead peer leaves waiting is aborted by c10d's watchdog at the
  // group's timeout, and the process exits, so the driver or launcher sees the failure and
  // restarts the group: it never waits past the timeout.
  ::setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1", /*overwrite=*/0);
  auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
  nccl_options->timeout = options.timeout;
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("nccl", store);
  auto native =
      c10::make_intrusive<c10d::ProcessGroupNCCL>(prefixed, rank, world_size, nccl_options);
  return std::make_unique<Transport>(Transport::Kind::kNccl, std::move(native), rank, world_size,
                                     options.timeout);
#else
  (void)store;
  (void)rank;
  (void)world_size;
  (void)options;
  require_nccl();
  return nullptr;
#endif
}

void require_nccl() {
  if (nccl_available()) return;
  throw UsageError(
      "process group: this libtorch has no NCCL (a CPU build, or a CUDA build without c10d's "
      "NCCL group): use Backend::kGloo (--backend gloo), or build cohort against a CUDA libtorch");
}

}  // namespace cohort::comm

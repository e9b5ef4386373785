#include "cohort/comm/process_group.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "cohort/error.h"
#include "comm/store_state.h"

#include <atomic>

namespace cohort::comm {

struct ProcessGroup::State {
  c10::intrusive_ptr<c10d::ProcessGroupGloo> backend;
  int rank = 0;
  int world_size = 1;
  std::chrono::milliseconds timeout{};
  // Read by the heartbeat thread while the training thread launches collectives.
  std::atomic<int64_t> entered{0};
  std::atomic<const char*> last{"none"};

  void enter(const char* what) {
    last.store(what);
    entered.fetch_add(1);
  }
};

struct Work::State {
  c10::intrusive_ptr<c10d::Work> work;
  std::string what;
  std::chrono::milliseconds timeout{};
  // Applied after completion: Gloo has no native average.
  std::function<void()> finish;
};

void Work::wait() {
  if (!state_) return;
  try {
    state_->work->wait(state_->timeout);
  } catch (const std::exception& e) {
    const std::string what = e.what();
    if (what.find("imed out") != std::string::npos) {
      throw TimeoutError(state_->what + " did not complete within " +
                         std::to_string(state_->timeout.count()) +
                         " ms: a peer hangs or skipped the call (" + what + ")");
    }
    for (const char* sign : {"closed", "reset by peer", "Broken pipe", "Connection refused"}) {
      if (what.find(sign) != std::string::npos) {
        throw PeerFailureError(state_->what + " failed: a peer died or closed its connection (" +
                               what + ")");
      }
    }
    throw RuntimeError(state_->what + " failed: " + what);
  }
  if (state_->finish) {
    state_->finish();
    state_->finish = nullptr;
  }
}

Work& Work::then(std::function<void()> fn) {
  if (!state_) throw RuntimeError("Work::then on an empty Work");
  if (state_->finish) {
    state_->finish = [first = std::move(state_->finish), second = std::move(fn)] {
      first();
      second();
    };
  } else {
    state_->finish = std::move(fn);
  }
  return *this;
}

bool Work::completed() const { return !state_ || state_->work->isCompleted(); }

ProcessGroup::ProcessGroup(std::shared_ptr<State> state) : state_(std::move(state)) {}

ProcessGroup ProcessGroup::create(Store store, int rank, int world_size,
                                  const ProcessGroupOptions& options) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    throw UsageError("process group: rank " + std::to_string(rank) + " is not in [0, " +
                     std::to_string(world_size) + "): check RANK and WORLD_SIZE");
  }
  // Our own arrival barrier makes a missing rank nameable; Gloo's own error would not say who.
  const std::string address = store.host() + ":" + std::to_string(store.port());
  try {
    store.arrive_and_wait(options.prefix + "/arrived/", rank, world_size, "1",
                          "join the rendezvous at " + address, options.setup_timeout);
  } catch (const TimeoutError& e) {
    throw TimeoutError(std::string("process group setup: ") + e.what() +
                       ": check that they started and can reach that address");
  }

  auto gloo_options = c10d::ProcessGroupGloo::Options::create(options.timeout);
  try {
    gloo_options->devices.push_back(
        c10d::ProcessGroupGloo::createDeviceForHostname(options.interface_address));
  } catch (const std::exception& e) {
    throw UsageError("process group: cannot use interface address '" +
                     options.interface_address + "': " + e.what() +
                     " (give an address of this host)");
  }
  gloo_options->threads = std::max(1, options.threads);
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>(options.prefix, store.state_->store);
  auto state = std::make_shared<State>();
  try {
    state->backend =
        c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, rank, world_size, gloo_options);
  } catch (const std::exception& e) {
    throw RuntimeError("process group setup failed on rank " + std::to_string(rank) + ": " +
                       e.what());
  }
  state->rank = rank;
  state->world_size = world_size;
  state->timeout = options.timeout;
  return ProcessGroup(std::move(state));
}

int64_t ProcessGroup::collectives_entered() const { return state_ ? state_->entered.load() : 0; }
std::string ProcessGroup::last_collective() const { return state_ ? state_->last.load() : "none"; }

int ProcessGroup::rank() const { return state_->rank; }
int ProcessGroup::world_size() const { return state_->world_size; }
std::chrono::milliseconds ProcessGroup::timeout() const { return state_->timeout; }

namespace {

Work track(c10::intrusive_ptr<c10d::Work> native, std::string what,
           std::chrono::milliseconds timeout, std::function<void()> finish = nullptr) {
  auto state = std::make_shared<Work::State>();
  state->work = std::move(native);
  state->what = std::move(what);
  state->timeout = timeout;
  state->finish = std::move(finish);
  return Work(std::move(state));
}

c10d::ReduceOp to_native(ReduceOp op) {
  switch (op) {
    case ReduceOp::kMax:
      return c10d::ReduceOp::MAX;
    case ReduceOp::kMin:
      return c10d::ReduceOp::MIN;
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      break;
  }
  return c10d::ReduceOp::SUM;
}

}  // namespace

Work ProcessGroup::allreduce_async(std::vector<at::Tensor>& tensors, ReduceOp op) {
  c10d::AllreduceOptions opts;
  opts.reduceOp = to_native(op);
  opts.timeout = state_->timeout;
  state_->enter("allreduce");
  std::function<void()> finish;
  if (op == ReduceOp::kAvg) {
    finish = [tensors, n = static_cast<double>(state_->world_size)]() mutable {
      for (auto& t : tensors) t.div_(n);
    };
  }
  return track(state_->backend->allreduce(tensors, opts),
               "allreduce of " + std::to_string(tensors.size()) + " tensor(s) on rank " +
                   std::to_string(state_->rank),
               state_->timeout, std::move(finish));
}

void ProcessGroup::allreduce(std::vector<at::Tensor>& tensors, ReduceOp op) {
  allreduce_async(tensors, op).wait();
}

Work ProcessGroup::broadcast_async(std::vector<at::Tensor>& tensors, int root) {
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  opts.timeout = state_->timeout;
  state_->enter("broadcast");
  return track(state_->backend->broadcast(tensors, opts),
               "broadcast from rank " + std::to_string(root), state_->timeout);
}

void ProcessGroup::broadcast(std::vector<at::Tensor>& tensors, int root) {
  broadcast_async(tensors, root).wait();
}

std::vector<at::Tensor> ProcessGroup::allgather(const at::Tensor& tensor) {
  std::vector<at::Tensor> input{tensor.contiguous()};
  std::vector<std::vector<at::Tensor>> output(1);
  for (int r = 0; r < state_->world_size; ++r) output[0].push_back(at::empty_like(input[0]));
  c10d::AllgatherOptions opts;
  opts.timeout = state_->timeout;
  state_->enter("allgather");
  track(state_->backend->allgather(output, input, opts),
        "allgather on rank " + std::to_string(state_->rank), state_->timeout)
      .wait();
  return output[0];
}

void ProcessGroup::barrier() {
  c10d::BarrierOptions opts;
  opts.timeout = state_->timeout;
  state_->enter("barrier");
  track(state_->backend->barrier(opts), "barrier on rank " + std::to_string(state_->rank),
        state_->timeout)
      .wait();
}

}  // namespace cohort::comm

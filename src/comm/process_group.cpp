#include "cohort/comm/process_group.h"

#include <ATen/ops/empty_like.h>
#include <c10/core/Device.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#if __has_include(<gloo/common/error.h>)
#include <gloo/common/error.h>
#define COHORT_HAS_GLOO_ERRORS 1
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <exception>
#include <mutex>
#include <optional>

#include "cohort/error.h"
#include "cohort/trace.h"
#include "comm/store_state.h"
#include "comm/transport.h"

namespace cohort::comm {

const char* to_string(Backend backend) {
  switch (backend) {
    case Backend::kGloo:
      return "gloo";
    case Backend::kNccl:
      return "nccl";
    case Backend::kAuto:
      break;
  }
  return "auto";
}

Backend backend_from_string(const std::string& name) {
  for (Backend b : {Backend::kAuto, Backend::kGloo, Backend::kNccl}) {
    if (name == to_string(b)) return b;
  }
  throw UsageError("unknown communication backend '" + name +
                   "': use auto (Gloo for CPU tensors, NCCL for CUDA ones), gloo or nccl");
}

// ---------------------------------------------------------------------------------------------
// Work

struct Work::State {
  c10::intrusive_ptr<c10d::Work> work;
  std::string what;
  std::chrono::milliseconds timeout{};
  std::chrono::steady_clock::time_point started;
  std::function<void()> finish;
  std::optional<c10::Device> cuda_device;  // set for collectives on CUDA tensors
  std::function<bool()> aborted;           // ProcessGroupOptions::aborted
  // Its record in the group's flight recorder, ended by wait() as it ends.
  std::shared_ptr<FlightRecorder> recorder;
  int64_t record = 0;
  void end_record(FlightState how) const {
    if (recorder) recorder->end(record, how);
  }
};

namespace {

enum class FailureKind { kConnection, kOther };

// What kind of failure a completed collective reported, by the exception's type: a broken
// connection means a peer died or closed its end.
FailureKind classify(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
#ifdef COHORT_HAS_GLOO_ERRORS
  } catch (const ::gloo::IoException&) {
    return FailureKind::kConnection;
#endif
#if TORCH_VERSION_MAJOR >= 2
  } catch (const c10::DistNetworkError&) {
    return FailureKind::kConnection;
#endif
  } catch (...) {
  }
  return FailureKind::kOther;
}

std::string message_of(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
  }
  return "unknown error";
}

// Waits for `state`'s collective in slices of 100 ms up to its deadline, and throws
// PeerFailureError as soon as its group is aborted (ProcessGroupOptions::aborted).
void wait_unless_aborted(const Work::State& state) {
  constexpr std::chrono::milliseconds kSlice{100};
  const auto deadline = state.started + state.timeout;
  while (true) {
    if (state.work->isCompleted()) {
      state.work->wait(state.timeout);  // rethrows its error, if any
      return;
    }
    if (state.aborted()) {
      throw PeerFailureError(state.what + " aborted: a peer of the group was lost");
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      state.work->wait(std::chrono::milliseconds(1));  // throws: past the deadline
      return;
    }
    try {
      state.work->wait(std::min(left, kSlice));
      return;
    } catch (...) {
      // The slice ended (c10d throws "Operation timed out!"), or the collective failed. One that
      // completed between the two gives its own outcome: it returns, or throws its error.
      if (state.work->isCompleted()) {
        state.work->wait(state.timeout);
        return;
      }
    }
  }
}

}  // namespace

void Work::wait() {
  if (!state_) return;
  trace::Span span(trace::Phase::kCommWait);
  try {
    if (state_->cuda_device) {
      // No deadline here: c10d's NCCL work blocks the host when given one. The transport's own
      // timeout (NCCL's watchdog, Gloo's per-operation deadline) ends a collective that hangs.
      state_->work->wait();
    } else if (state_->aborted) {
      wait_unless_aborted(*state_);
    } else {
      state_->work->wait(state_->timeout);
    }
  } catch (const PeerFailureError&) {
    state_->end_record(FlightState::kAborted);
    throw;
  } catch (...) {
    const auto error = std::current_exception();
    const auto elapsed = std::chrono::steady_clock::now() - state_->started;
    // Not done at the deadline (our wait gave up), or the transport itself gave up at it.
    if (!state_->work->isCompleted() || elapsed >= state_->timeout) {
      state_->end_record(FlightState::kTimedOut);
      throw TimeoutError(state_->what + " did not complete within " +
                         std::to_string(state_->timeout.count()) +
                         " ms: a peer hangs or skipped the call (" + message_of(error) + ")");
    }
    state_->end_record(FlightState::kFailed);
    if (classify(error) == FailureKind::kConnection) {
      throw PeerFailureError(state_->what + " failed: a peer died or closed its connection (" +
                             message_of(error) + ")");
    }
    throw RuntimeError(state_->what + " failed: " + message_of(error));
  }
  state_->end_record(FlightState::kCompleted);
  if (state_->finish) {
    auto finish = std::move(state_->finish);
    state_->finish = nullptr;
    finish();
  }
}

void Work::synchronize() {
  wait();
  if (state_ && state_->cuda_device) {
    c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA)
        .getStream(*state_->cuda_device)
        .synchronize();
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

// ---------------------------------------------------------------------------------------------
// ProcessGroup

struct ProcessGroup::State {
  Store store;
  c10::intrusive_ptr<c10d::Store> keys;  // the store under this group's prefix
  ProcessGroupOptions options;
  int rank = 0;
  int world_size = 1;
  std::vector<int> global_ranks;
  std::unique_ptr<Transport> gloo;  // none for Backend::kNccl
  std::once_flag nccl_once;
  std::unique_ptr<Transport> nccl;  // made on the first collective on CUDA tensors
  int64_t subgroups_made = 0;
  // ProcessGroupOptions::flight_recorder: shared with the sub-groups made from this group.
  std::shared_ptr<FlightRecorder> recorder;
  // Read by the heartbeat thread while the training thread launches collectives.
  std::atomic<int64_t> entered{0};
  std::atomic<const char*> last{"none"};
  // bytes_sent(): one counter for a group and its sub-groups.
  std::shared_ptr<std::atomic<int64_t>> bytes_sent = std::make_shared<std::atomic<int64_t>>(0);
  // Adds `fraction` x `bytes` to bytes_sent().
  void count_sent(double fraction, int64_t bytes) {
    bytes_sent->fetch_add(
        static_cast<int64_t>(std::llround(fraction * static_cast<double>(bytes))));
  }
  double others() const { return static_cast<double>(world_size - 1); }
  double share_of_others() const { return others() / world_size; }

  bool subgroup = false;  // made by new_group or split

  // set_activity(): written by the training thread, read by the heartbeat thread.
  mutable std::mutex activity_mutex;
  std::string activity;
  std::string current_activity() const {
    std::lock_guard lock(activity_mutex);
    return activity;
  }

  std::string describe(const std::string& what) const {
    std::string out = what + " on rank " + std::to_string(rank);
    if (subgroup) {
      out += " of group '" + options.prefix + "' (global rank " +
             std::to_string(global_ranks[static_cast<size_t>(rank)]) + ")";
    }
    if (const std::string doing = current_activity(); !doing.empty()) out += " in " + doing;
    return out;
  }

  Transport& transport_for(const at::Tensor& tensor, const char* what) {
    if (tensor.is_cpu()) {
      if (!gloo) {
        throw UsageError(describe(what) +
                         ": a CPU tensor given to a NCCL group, which takes CUDA tensors only: "
                         "move it to the device (tensor.to(get_context().get_device())) or "
                         "create the group with Backend::kAuto");
      }
      return *gloo;
    }
    if (!tensor.is_cuda()) {
      throw UsageError(describe(what) + ": tensors on " + tensor.device().str() +
                       " are not supported: give CPU or CUDA tensors");
    }
    if (options.backend == Backend::kGloo ||
        (options.backend == Backend::kAuto && !nccl_available())) {
      return *gloo;
    }
    return nccl_transport();
  }

  Transport& nccl_transport() {
    std::call_once(nccl_once, [&] { nccl = make_nccl_transport(keys, rank, world_size, options); });
    return *nccl;
  }

  // Runs a collective: counts it for the stall inspector, records it in the flight recorder,
  // starts it on the tensor's transport and wraps the native work. An error while starting is
  // named with the collective. `tensors`: how many were given; `peer`: a send's or recv's.
  template <typename Start>
  Work run(const char* what, const at::Tensor& first, Start&& start, size_t tensors = 1,
           int peer = -1) {
    FlightEntry entry{.dtype = c10::toString(first.scalar_type()),
                      .numel = first.numel(),
                      .tensors = static_cast<int>(tensors),
                      .peer = peer};
    return run_on(transport_for(first, what), what,
                  first.is_cuda() ? std::optional<c10::Device>(first.device()) : std::nullopt,
                  std::forward<Start>(start), std::move(entry));
  }

  template <typename Start>
  Work run_on(Transport& transport, const char* what, std::optional<c10::Device> cuda_device,
              Start&& start, FlightEntry entry = {}) {
    last.store(what);
    const int64_t seq = entered.fetch_add(1) + 1;
    auto state = std::make_shared<Work::State>();
    state->what = describe(std::string(what) + " (" + transport.name() + ")");
    state->timeout = options.timeout;
    state->aborted = options.aborted;
    state->started = std::chrono::steady_clock::now();
    state->cuda_device = cuda_device;
    if (recorder) {
      entry.group = options.prefix;
      entry.seq = seq;
      entry.op = what;
      const std::string doing = current_activity();
      entry.detail = transport.name() + (doing.empty() ? "" : ", " + doing);
      state->recorder = recorder;
      state->record = recorder->begin(entry);
    }
    Started started;
    try {
      started = start(transport);
    } catch (const c10::Error& e) {
      state->end_record(FlightState::kFailed);
      throw RuntimeError(state->what + " could not start: " + e.what_without_backtrace());
    }
    state->work = std::move(started.work);
    state->finish = std::move(started.finish);
    return Work(std::move(state));
  }

  // A list call's tensors: one per rank, of one dtype and device with `other`.
  void check_one_per_rank(const std::vector<at::Tensor>& list, const at::Tensor& other,
                          const char* what, const char* name) const;

  void check_peer(int peer, const char* what) const {
    if (peer < 0 || peer >= world_size || peer == rank) {
      throw UsageError(describe(what) + ": peer " + std::to_string(peer) +
                       " is not another rank of this group (ranks 0-" +
                       std::to_string(world_size - 1) + ")");
    }
  }
};

namespace {

void check_same_kind(const std::vector<at::Tensor>& tensors, const char* what) {
  if (tensors.empty()) throw UsageError(std::string(what) + ": no tensors given");
  for (const auto& t : tensors) {
    if (!t.defined()) throw UsageError(std::string(what) + ": an undefined tensor was given");
    if (t.scalar_type() != tensors[0].scalar_type() || t.device() != tensors[0].device()) {
      throw UsageError(std::string(what) +
                       ": tensors of one call must share dtype and device (got " +
                       std::string(c10::toString(tensors[0].scalar_type())) + " on " +
                       tensors[0].device().str() + " and " + c10::toString(t.scalar_type()) +
                       " on " + t.device().str() + ")");
    }
  }
}

void check_numel(const at::Tensor& big, const at::Tensor& part, int64_t world, const char* what,
                 const char* big_name, const char* part_name) {
  if (big.numel() != part.numel() * world) {
    throw UsageError(std::string(what) + ": " + big_name + " has " + std::to_string(big.numel()) +
                     " elements, but needs world_size x " + part_name + " = " +
                     std::to_string(world) + " x " + std::to_string(part.numel()));
  }
  if (!big.is_contiguous())
    throw UsageError(std::string(what) + ": " + big_name + " must be contiguous");
  check_same_kind({big, part}, what);
}

}  // namespace

void ProcessGroup::State::check_one_per_rank(const std::vector<at::Tensor>& list,
                                             const at::Tensor& other, const char* what,
                                             const char* name) const {
  if (list.size() != static_cast<size_t>(world_size)) {
    throw UsageError(describe(what) + ": " + std::to_string(list.size()) + " " + name +
                     " given, one per rank needed (" + std::to_string(world_size) + ")");
  }
  std::vector<at::Tensor> all = list;
  all.push_back(other);
  check_same_kind(all, what);
}

ProcessGroup::ProcessGroup(std::shared_ptr<State> state) : state_(std::move(state)) {}

namespace {

// The groups of this process, for group_activity(): observed, never used to run collectives.
struct GroupRegistry {
  std::mutex mutex;
  std::vector<std::weak_ptr<ProcessGroup::State>> groups;
};
GroupRegistry& group_registry() {
  static GroupRegistry registry;
  return registry;
}

std::shared_ptr<ProcessGroup::State> make_group(Store store, int rank, int world_size,
                                                const ProcessGroupOptions& options,
                                                std::vector<int> global_ranks, bool subgroup) {
  if (options.backend == Backend::kNccl) require_nccl();
  // Our own barriers make a missing rank nameable; Gloo's own error would not say who.
  const std::string address = store.host() + ":" + std::to_string(store.port());
  const auto setup_barrier = [&](const std::string& step, const std::string& what) {
    try {
      store.arrive_and_wait(options.prefix + "/" + step + "/", rank, world_size, "1", what,
                            options.setup_timeout);
    } catch (const TimeoutError& e) {
      std::string members;
      if (subgroup) {
        members = " (group '" + options.prefix + "' of global ranks";
        for (int g : global_ranks) members += " " + std::to_string(g);
        members += ")";
      }
      throw TimeoutError(std::string("process group setup: ") + e.what() + members +
                         ": check that they started and can reach that address");
    }
  };
  setup_barrier("arrived", "join the rendezvous at " + address);
  auto state = std::make_shared<ProcessGroup::State>();
  state->keys = c10::make_intrusive<c10d::PrefixStore>(options.prefix, StoreAccess::native(store));
  state->subgroup = subgroup;
  state->store = store;
  state->options = options;
  state->rank = rank;
  state->world_size = world_size;
  state->global_ranks = global_ranks;
  state->recorder = options.flight_recorder;
  if (!state->recorder && options.flight_recorder_entries > 0)
    state->recorder = std::make_shared<FlightRecorder>(options.flight_recorder_entries);
  state->options.flight_recorder = state->recorder;
  if (state->recorder) state->recorder->add_group(options.prefix, global_ranks);
  {
    auto& registry = group_registry();
    std::lock_guard lock(registry.mutex);
    std::erase_if(registry.groups, [](const auto& g) { return g.expired(); });
    registry.groups.push_back(state);
  }
  if (options.backend != Backend::kNccl) {
    try {
      state->gloo = make_gloo_transport(state->keys, rank, world_size, options);
    } catch (const UsageError&) {
      throw;
    } catch (const std::exception& e) {
      throw RuntimeError("process group setup failed on rank " + std::to_string(rank) + ": " +
                         e.what());
    }
    // A rank is connected once its own pairs are, possibly before its peers have read their
    // side: one that returned now and closed its group at once (a short job, an early error)
    // would fail them with "connection closed by peer". No rank returns until all are connected.
    setup_barrier("connected", "connect to every peer of the group at " + address);
  }
  return state;
}

}  // namespace

ProcessGroup ProcessGroup::create(Store store, int rank, int world_size,
                                  const ProcessGroupOptions& options) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    throw UsageError("process group: rank " + std::to_string(rank) + " is not in [0, " +
                     std::to_string(world_size) + "): check RANK and WORLD_SIZE");
  }
  std::vector<int> global(static_cast<size_t>(world_size));
  for (int r = 0; r < world_size; ++r) global[static_cast<size_t>(r)] = r;
  return ProcessGroup(
      make_group(std::move(store), rank, world_size, options, std::move(global), false));
}

namespace {

void check_member_list(const std::vector<int>& ranks, int world_size, const std::string& what) {
  if (ranks.empty())
    throw UsageError(what + ": no ranks given: name at least one rank of the group");
  std::vector<bool> seen(static_cast<size_t>(world_size), false);
  for (int r : ranks) {
    if (r < 0 || r >= world_size) {
      throw UsageError(what + ": rank " + std::to_string(r) + " does not exist in a group of " +
                       std::to_string(world_size) + " (ranks 0-" + std::to_string(world_size - 1) +
                       ")");
    }
    if (seen[static_cast<size_t>(r)]) {
      throw UsageError(what + ": rank " + std::to_string(r) +
                       " is listed twice: name each rank once");
    }
    seen[static_cast<size_t>(r)] = true;
  }
}

}  // namespace

ProcessGroup ProcessGroup::new_group(const std::vector<int>& ranks) {
  return new_group(ranks, state_->options);
}

ProcessGroup ProcessGroup::new_group(const std::vector<int>& ranks,
                                     const ProcessGroupOptions& options) {
  check_member_list(ranks, state_->world_size, "new_group");
  // Every rank counts its calls alike, so the same call gets the same key prefix everywhere.
  const std::string prefix =
      state_->options.prefix + "/" + std::to_string(++state_->subgroups_made);
  const auto mine = std::find(ranks.begin(), ranks.end(), state_->rank);
  if (mine == ranks.end()) return ProcessGroup();
  ProcessGroupOptions sub = options;
  sub.prefix = prefix;
  if (!sub.flight_recorder) sub.flight_recorder = state_->recorder;
  std::vector<int> global;
  for (int r : ranks) global.push_back(state_->global_ranks[static_cast<size_t>(r)]);
  auto group = make_group(state_->store, static_cast<int>(mine - ranks.begin()),
                          static_cast<int>(ranks.size()), sub, std::move(global), true);
  group->bytes_sent = state_->bytes_sent;
  return ProcessGroup(std::move(group));
}

ProcessGroup ProcessGroup::split(const std::vector<std::vector<int>>& partition,
                                 const std::string& name) {
  std::vector<int> all;
  for (const auto& part : partition) all.insert(all.end(), part.begin(), part.end());
  check_member_list(all, state_->world_size, "split");
  if (all.size() != static_cast<size_t>(state_->world_size)) {
    throw UsageError("split: the parts name " + std::to_string(all.size()) + " of the group's " +
                     std::to_string(state_->world_size) + " ranks: every rank must be in one part");
  }
  const int64_t call = ++state_->subgroups_made;
  for (size_t i = 0; i < partition.size(); ++i) {
    const auto& part = partition[i];
    const auto mine = std::find(part.begin(), part.end(), state_->rank);
    if (mine == part.end()) continue;
    ProcessGroupOptions sub = state_->options;
    sub.prefix = state_->options.prefix + "/" + std::to_string(call) + "." +
                 (name.empty() ? "" : name + ".") + std::to_string(i);
    std::vector<int> global;
    for (int r : part) global.push_back(state_->global_ranks[static_cast<size_t>(r)]);
    auto group = make_group(state_->store, static_cast<int>(mine - part.begin()),
                            static_cast<int>(part.size()), sub, std::move(global), true);
    group->bytes_sent = state_->bytes_sent;
    return ProcessGroup(std::move(group));
  }
  throw RuntimeError("split: rank " + std::to_string(state_->rank) + " is in no part");
}

const std::vector<int>& ProcessGroup::global_ranks() const { return state_->global_ranks; }

int ProcessGroup::global_rank(int group_rank) const {
  if (group_rank < 0 || group_rank >= state_->world_size) {
    throw UsageError("global_rank: " + std::to_string(group_rank) +
                     " is not a rank of this group (0-" + std::to_string(state_->world_size - 1) +
                     ")");
  }
  return state_->global_ranks[static_cast<size_t>(group_rank)];
}

int ProcessGroup::group_rank(int global_rank) const {
  const auto& g = state_->global_ranks;
  const auto it = std::find(g.begin(), g.end(), global_rank);
  return it == g.end() ? -1 : static_cast<int>(it - g.begin());
}

std::vector<GroupActivity> group_activity() {
  auto& registry = group_registry();
  std::lock_guard lock(registry.mutex);
  std::vector<GroupActivity> activity;
  for (const auto& weak : registry.groups) {
    if (auto state = weak.lock()) {
      activity.push_back({.name = state->options.prefix,
                          .global_ranks = state->global_ranks,
                          .entered = state->entered.load(),
                          .last = state->last.load(),
                          .activity = state->current_activity()});
    }
  }
  return activity;
}

void ProcessGroup::set_activity(std::string activity) {
  std::lock_guard lock(state_->activity_mutex);
  state_->activity = std::move(activity);
}

int64_t ProcessGroup::collectives_entered() const { return state_ ? state_->entered.load() : 0; }
std::string ProcessGroup::last_collective() const { return state_ ? state_->last.load() : "none"; }
int64_t ProcessGroup::bytes_sent() const { return state_ ? state_->bytes_sent->load() : 0; }

int ProcessGroup::rank() const { return state_->rank; }
int ProcessGroup::world_size() const { return state_->world_size; }
std::chrono::milliseconds ProcessGroup::timeout() const { return state_->options.timeout; }
bool ProcessGroup::aborted() const { return state_->options.aborted && state_->options.aborted(); }
Backend ProcessGroup::backend() const { return state_->options.backend; }
const std::string& ProcessGroup::interface_address() const {
  return state_->options.interface_address;
}
const JobSecret& ProcessGroup::secret() const { return state_->store.secret(); }
const std::shared_ptr<FlightRecorder>& ProcessGroup::flight_recorder() const {
  return state_->recorder;
}
void ProcessGroup::add_bytes_sent(int64_t bytes) { state_->count_sent(1.0, bytes); }

int64_t ProcessGroup::scratch_bytes() const {
  return state_ && state_->gloo ? state_->gloo->scratch_bytes() : 0;
}

Work ProcessGroup::allreduce_async(std::vector<at::Tensor>& tensors, ReduceOp op) {
  check_same_kind(tensors, "allreduce");
  for (const auto& t : tensors) state_->count_sent(2 * state_->share_of_others(), t.nbytes());
  return state_->run(
      "allreduce", tensors[0], [&](Transport& t) { return t.allreduce(tensors, op); },
      tensors.size());
}

void ProcessGroup::allreduce(std::vector<at::Tensor>& tensors, ReduceOp op) {
  allreduce_async(tensors, op).wait();
}

Work ProcessGroup::broadcast_async(std::vector<at::Tensor>& tensors, int root) {
  check_same_kind(tensors, "broadcast");
  if (root < 0 || root >= state_->world_size) {
    throw UsageError(state_->describe("broadcast") + ": root " + std::to_string(root) +
                     " is not a rank of this group (0-" + std::to_string(state_->world_size - 1) +
                     ")");
  }
  return state_->run(
      "broadcast", tensors[0],
      [&](Transport& t) {
        for (const auto& x : tensors) state_->count_sent(state_->share_of_others(), x.nbytes());
        return t.broadcast(tensors, root);
      },
      tensors.size());
}

void ProcessGroup::broadcast(std::vector<at::Tensor>& tensors, int root) {
  broadcast_async(tensors, root).wait();
}

Work ProcessGroup::allgather_async(std::vector<at::Tensor>& outputs, const at::Tensor& input) {
  state_->check_one_per_rank(outputs, input, "allgather", "outputs");
  return state_->run("allgather", input, [&](Transport& t) {
    state_->count_sent(state_->others(), input.nbytes());
    return t.allgather(outputs, input.contiguous());
  });
}

std::vector<at::Tensor> ProcessGroup::allgather(const at::Tensor& tensor) {
  std::vector<at::Tensor> outputs;
  for (int r = 0; r < state_->world_size; ++r)
    outputs.push_back(at::empty_like(tensor, at::MemoryFormat::Contiguous));
  allgather_async(outputs, tensor).wait();
  return outputs;
}

Work ProcessGroup::allgather_into_async(at::Tensor& output, const at::Tensor& input) {
  check_numel(output, input, state_->world_size, "allgather_into", "output", "input");
  return state_->run("allgather_into", input, [&](Transport& t) {
    state_->count_sent(state_->others(), input.nbytes());
    return t.allgather_into(output, input.contiguous());
  });
}

void ProcessGroup::allgather_into(at::Tensor& output, const at::Tensor& input) {
  allgather_into_async(output, input).wait();
}

Work ProcessGroup::reduce_scatter_async(at::Tensor& output, std::vector<at::Tensor>& inputs,
                                        ReduceOp op) {
  state_->check_one_per_rank(inputs, output, "reduce_scatter", "inputs");
  for (const auto& in : inputs) {
    if (in.sizes() != output.sizes()) {
      throw UsageError(state_->describe("reduce_scatter") +
                       ": every input must have the output's shape " + c10::str(output.sizes()) +
                       ", got " + c10::str(in.sizes()));
    }
  }
  return state_->run("reduce_scatter", output, [&](Transport& t) {
    state_->count_sent(state_->others(), output.nbytes());
    return t.reduce_scatter(output, inputs, op);
  });
}

void ProcessGroup::reduce_scatter(at::Tensor& output, std::vector<at::Tensor>& inputs,
                                  ReduceOp op) {
  reduce_scatter_async(output, inputs, op).wait();
}

Work ProcessGroup::reduce_scatter_tensor_async(at::Tensor& output, const at::Tensor& input,
                                               ReduceOp op) {
  check_numel(input, output, state_->world_size, "reduce_scatter_tensor", "input", "output");
  return state_->run("reduce_scatter_tensor", output, [&](Transport& t) {
    state_->count_sent(state_->others(), output.nbytes());
    return t.reduce_scatter_tensor(output, input, op);
  });
}

void ProcessGroup::reduce_scatter_tensor(at::Tensor& output, const at::Tensor& input, ReduceOp op) {
  reduce_scatter_tensor_async(output, input, op).wait();
}

Work ProcessGroup::all_to_all_async(at::Tensor& output, const at::Tensor& input,
                                    const std::vector<int64_t>& output_split_sizes,
                                    const std::vector<int64_t>& input_split_sizes) {
  const int64_t world = state_->world_size;
  check_same_kind({output, input}, "all_to_all");
  auto check_splits = [&](const std::vector<int64_t>& splits, const at::Tensor& t,
                          const char* name) {
    if (splits.empty()) {
      if (t.dim() == 0 || t.size(0) % world != 0) {
        throw UsageError(state_->describe("all_to_all") + ": " + name + "'s first dimension (" +
                         (t.dim() ? std::to_string(t.size(0)) : std::string("none")) +
                         ") must divide by the world size " + std::to_string(world) +
                         ", or give split sizes");
      }
      return;
    }
    int64_t sum = 0;
    for (int64_t s : splits) sum += s;
    if (static_cast<int64_t>(splits.size()) != world || t.dim() == 0 || sum != t.size(0)) {
      throw UsageError(state_->describe("all_to_all") + ": " + name + " split sizes must be " +
                       std::to_string(world) + " sizes adding up to its first dimension");
    }
  };
  check_splits(output_split_sizes, output, "output");
  check_splits(input_split_sizes, input, "input");
  return state_->run("all_to_all", input, [&](Transport& t) {
    const int64_t mine = input_split_sizes.empty()
                             ? input.size(0) / world
                             : input_split_sizes[static_cast<size_t>(state_->rank)];
    state_->count_sent(
        1.0, input.nbytes() - (input.size(0) ? input.nbytes() / input.size(0) * mine : 0));
    return t.all_to_all(output, input.contiguous(), output_split_sizes, input_split_sizes);
  });
}

void ProcessGroup::all_to_all(at::Tensor& output, const at::Tensor& input,
                              const std::vector<int64_t>& output_split_sizes,
                              const std::vector<int64_t>& input_split_sizes) {
  all_to_all_async(output, input, output_split_sizes, input_split_sizes).wait();
}

Work ProcessGroup::send_async(const at::Tensor& tensor, int peer, int tag) {
  state_->check_peer(peer, "send");
  return state_->run(
      "send", tensor,
      [&](Transport& t) {
        state_->count_sent(1.0, tensor.nbytes());
        return t.send(tensor.contiguous(), peer, tag);
      },
      1, peer);
}

void ProcessGroup::send(const at::Tensor& tensor, int peer, int tag) {
  send_async(tensor, peer, tag).wait();
}

Work ProcessGroup::recv_async(at::Tensor& tensor, int peer, int tag) {
  state_->check_peer(peer, "recv");
  if (!tensor.is_contiguous())
    throw UsageError(state_->describe("recv") + ": the tensor must be contiguous");
  return state_->run(
      "recv", tensor, [&](Transport& t) { return t.recv(tensor, peer, tag); }, 1, peer);
}

void ProcessGroup::recv(at::Tensor& tensor, int peer, int tag) {
  recv_async(tensor, peer, tag).wait();
}

void ProcessGroup::barrier() {
  Transport& transport = state_->gloo ? *state_->gloo : state_->nccl_transport();
  state_->run_on(transport, "barrier", std::nullopt, [](Transport& t) { return t.barrier(); })
      .wait();
}

}  // namespace cohort::comm

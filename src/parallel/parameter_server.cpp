#include "cohort/parallel/parameter_server.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <iostream>
#include <mutex>
#include <thread>
#include <utility>

#include <torch/torch.h>

#include "cohort/error.h"
#include "cohort/optim/flat_optimizer.h"
#include "cohort/timeouts.h"
#include "comm/handshake.h"
#include "comm/socket.h"
#include "parallel/parameter_server_messages.h"
#include "replicas.h"

namespace cohort::parallel {
namespace {

using Clock = std::chrono::steady_clock;

using ps::kBye;
using ps::Kind;
using ps::kPull;
using ps::kPush;
using ps::Reply;
using ps::Request;

std::string server_name(int index) { return "parameter server " + std::to_string(index); }

// The servers' addresses travel through the group as fixed-size strings.
constexpr int64_t kAddressBytes = 128;

// The flat optimizer of one shard, with the state accessors a checkpoint needs.
class ShardOptimizer : public optim::FlatOptimizer {
 public:
  ShardOptimizer(const at::Tensor& shard, const std::string& algorithm,
                 const torch::optim::OptimizerOptions& options)
      : FlatOptimizer({torch::optim::OptimizerParamGroup({shard}, options.clone())},
                      options.clone(), algorithm) {}
  using FlatOptimizer::set_steps_taken;
  using FlatOptimizer::state_buffer_names;
  using FlatOptimizer::state_buffers;
  using FlatOptimizer::steps_taken;
};

// A server's state at the last sync(): what a checkpoint writes.
struct ServerSnapshot {
  std::vector<at::Tensor> state;  // the optimizer's buffers, in state_buffer_names() order
  int64_t optimizer_steps = 0;    // the optimizer's step count (Adam's bias)
  int64_t version = 0;            // updates applied
  std::vector<int64_t> pushes;    // taken from each worker, by rank
};

}  // namespace

// One shard's server: a thread that answers every worker's pushes and pulls over TCP.
struct ParameterServerOptimizer::Server {
  int index = 0;
  int workers = 0;
  int64_t max_staleness = 0;
  std::chrono::milliseconds timeout{0};
  comm::ProcessGroup group;
  int64_t begin = 0;
  int64_t end = 0;
  at::Tensor shard;  // the optimizer's parameter: float32, end - begin elements
  std::unique_ptr<ShardOptimizer> optimizer;
  int listener = -1;
  std::string address;

  struct Connection {
    int fd = -1;
    comm::ServerHandshake proof;  // nothing it sends is parsed before it proved the secret
    int worker = -1;
    bool waiting = false;  // a push answered once the staleness bound allows
    int64_t staleness = 0;
  };
  std::vector<Connection> connections;

  std::mutex mutex;  // the state below, and the shard against restore()
  std::condition_variable finished_cv;
  bool finished = false;
  std::string error;  // why the thread failed, for this rank's next step
  int64_t version = 0;
  std::vector<int64_t> pushes;  // by worker
  std::vector<char> done;       // said goodbye, or closed its connection
  ServerSnapshot snapshot;
  std::atomic<bool> stop{false};
  std::thread thread;

  Server(int index_, int workers_, int64_t max_staleness_, comm::ProcessGroup group_,
         int64_t begin_, int64_t end_, const at::Tensor& initial, const std::string& algorithm,
         const torch::optim::OptimizerOptions& options)
      : index(index_),
        workers(workers_),
        max_staleness(max_staleness_),
        timeout(group_.timeout()),
        group(std::move(group_)),
        begin(begin_),
        end(end_),
        pushes(static_cast<size_t>(workers_), 0),
        done(static_cast<size_t>(workers_), 0) {
    shard = initial.to(at::kFloat).contiguous().clone();
    optimizer = std::make_unique<ShardOptimizer>(shard, algorithm, options);
    shard.mutable_grad() = at::zeros_like(shard);
    listener = comm::socket::listen_on(group.interface_address() + ":0", address,
                                       "the workers of " + server_name(index));
    take_snapshot();
  }

  ~Server() {
    stop = true;
    if (thread.joinable()) thread.join();
    for (auto& c : connections) ::close(c.fd);
    if (listener >= 0) ::close(listener);
  }

  void start() {
    thread = std::thread([this] { run(); });
  }

  void take_snapshot() {
    snapshot.state.clear();
    for (const auto& buffer : optimizer->state_buffers(0))
      snapshot.state.push_back(buffer.detach().clone());
    snapshot.optimizer_steps = optimizer->steps_taken(0);
    snapshot.version = version;
    snapshot.pushes = pushes;
  }

  // Waits until every worker said goodbye, up to the group's timeout; then stops the thread.
  void finish(bool wait_for_workers) {
    if (wait_for_workers) {
      std::unique_lock lock(mutex);
      finished_cv.wait_for(lock, timeout, [&] { return finished; });
    }
    stop = true;
    if (thread.joinable()) thread.join();
  }

  void run() {
    try {
      serve();
    } catch (const std::exception& e) {
      std::lock_guard lock(mutex);
      error = e.what();
      // The workers waiting on this server learn at once that it is gone.
      for (auto& c : connections) ::shutdown(c.fd, SHUT_RDWR);
    }
    std::lock_guard lock(mutex);
    finished = true;
    finished_cv.notify_all();
  }

  bool everyone_done() {
    std::lock_guard lock(mutex);
    return std::all_of(done.begin(), done.end(), [](char d) { return d != 0; });
  }

  void serve() {
    while (!stop && !everyone_done()) {
      std::vector<pollfd> fds{{listener, POLLIN, 0}};
      for (const auto& c : connections) fds.push_back({c.fd, POLLIN, 0});
      const int rc = ::poll(fds.data(), fds.size(), 100);
      if (rc < 0 && errno != EINTR)
        throw RuntimeError(server_name(index) + ": poll failed: " + std::strerror(errno));
      if (rc <= 0) continue;
      if (fds[0].revents & POLLIN) {
        const int fd = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
        if (fd >= 0)
          connections.push_back({.fd = fd, .proof = comm::ServerHandshake(fd, group.secret())});
      }
      const auto now = std::chrono::steady_clock::now();
      for (size_t i = 1; i < fds.size(); ++i) {
        Connection& c = connections[i - 1];
        if (!c.proof.proven()) {
          if (c.proof.poll_step(fds[i].revents != 0, now) ==
              comm::ServerHandshake::State::kRefused) {
            std::cerr << "cohort: " << server_name(index) << " closed " << c.proof.why()
                      << std::endl;
            ::close(c.fd);
            c.fd = -1;
          }
          continue;
        }
        if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) handle(c);
      }
      connections.erase(std::remove_if(connections.begin(), connections.end(),
                                       [](const Connection& c) { return c.fd < 0; }),
                        connections.end());
      release_waiting();
    }
  }

  void close_connection(Connection& c) {
    ::close(c.fd);
    c.fd = -1;
    if (c.worker >= 0) {
      std::lock_guard lock(mutex);
      done[static_cast<size_t>(c.worker)] = 1;
    }
  }

  // A connection that sent something no worker of this run sends: logged once, closed; the
  // server goes on serving the others.
  void drop(Connection& c, const std::string& peer, const std::string& why) {
    std::cerr << "cohort: " << server_name(index) << " closed its connection from " << peer << ": "
              << why << std::endl;
    close_connection(c);
  }

  void handle(Connection& c) {
    char first = 0;
    const ssize_t peeked = ::recv(c.fd, &first, 1, MSG_PEEK);
    if (peeked <= 0) {  // the worker closed its connection (or its process is gone)
      close_connection(c);
      return;
    }
    const std::string peer =
        c.worker >= 0 ? "worker " + std::to_string(c.worker) : "an unknown peer";
    Request request;
    try {
      comm::socket::read_all(c.fd, &request, sizeof request, kServerClientTimeout, peer);
    } catch (const std::exception& e) {
      return drop(c, peer, std::string("half a request (") + e.what() + ")");
    }
    if (const auto why = ps::request_refusal(request, workers, c.worker); !why.empty())
      return drop(c, peer, why);
    c.worker = static_cast<int>(request.worker);
    if (request.kind == kBye) {
      close_connection(c);
      return;
    }
    if (request.kind == kPull) {
      std::lock_guard lock(mutex);
      reply(c, kPull, 0);
      return;
    }
    if (request.numel != end - begin) {
      throw RuntimeError(server_name(index) + ": worker " + std::to_string(c.worker) + " pushed " +
                         std::to_string(request.numel) + " elements, the shard has " +
                         std::to_string(end - begin) + ": the workers run different models");
    }
    // Into the shard's .grad: after the first step that is the optimizer's own flat gradient
    // buffer, which its next step reads without a copy.
    const auto grad = shard.grad();
    try {
      comm::socket::read_all(c.fd, grad.data_ptr(),
                             static_cast<size_t>(grad.numel()) * sizeof(float), timeout, peer);
    } catch (const std::exception& e) {
      return drop(c, "worker " + std::to_string(c.worker),
                  std::string("half a push (") + e.what() + ")");
    }
    std::lock_guard lock(mutex);
    auto& options = optimizer->param_groups()[0].options();
    options.set_lr(request.lr);
    optimizer->step();
    c.staleness = version - request.base_version;
    ++version;
    ++pushes[static_cast<size_t>(c.worker)];
    c.waiting = true;
  }

  // Answers the pushes whose workers are no more than max_staleness pushes ahead of the slowest
  // worker still running.
  void release_waiting() {
    std::lock_guard lock(mutex);
    int64_t slowest = -1;
    for (size_t w = 0; w < pushes.size(); ++w) {
      if (done[w] == 0) slowest = slowest < 0 ? pushes[w] : std::min(slowest, pushes[w]);
    }
    for (auto& c : connections) {
      if (!c.waiting || c.fd < 0) continue;
      if (slowest >= 0 && pushes[static_cast<size_t>(c.worker)] - slowest > max_staleness) continue;
      c.waiting = false;
      reply(c, kPush, c.staleness);
    }
  }

  // Under the mutex.
  void reply(Connection& c, Kind kind, int64_t staleness) {
    Reply r{.kind = kind, .version = version, .staleness = staleness, .numel = end - begin};
    const std::string peer = "worker " + std::to_string(c.worker);
    try {
      comm::socket::write_all(c.fd, &r, sizeof r, peer, timeout);
      comm::socket::write_all(c.fd, shard.data_ptr(),
                              static_cast<size_t>(shard.numel()) * sizeof(float), peer, timeout);
    } catch (const RuntimeError& e) {
      // Gone, or it stopped reading for the group's timeout (the server holds its mutex
      // meanwhile: one worker's stall is bounded, then that worker is dropped).
      if (dynamic_cast<const comm::socket::PeerGone*>(&e) == nullptr)
        std::cerr << "cohort: parameter server drops " << peer << ": " << e.what() << std::endl;
      ::close(c.fd);
      c.fd = -1;
      done[static_cast<size_t>(c.worker)] = 1;
      return;
    }
    group.add_bytes_sent(static_cast<int64_t>(sizeof r) + shard.numel() * 4);
  }
};

// A worker's side: one connection per server, the flat gradients and parameters.
struct ParameterServerOptimizer::Client {
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  std::vector<int64_t> offsets;
  std::vector<at::Tensor> float_buffers;
  std::vector<std::pair<int64_t, int64_t>> ranges;  // per server
  std::vector<int> fds;                             // per server
  std::vector<int64_t> versions;                    // per server: of the parameters last pulled
  at::Tensor grads;                                 // flat float32 on the CPU
  at::Tensor pulled;                                // flat float32 on the CPU
  int64_t numel = 0;
  int rank = 0;
  std::chrono::milliseconds timeout{0};
  int64_t max_staleness = 0;  // for messages

  ~Client() {
    for (int fd : fds)
      if (fd >= 0) ::close(fd);
  }

  at::Tensor view(const at::Tensor& flat, size_t i) const {
    return flat.narrow(0, offsets[i], params[i].numel()).view(params[i].sizes());
  }

  // For each parameter with elements in the flat range [begin, end): fn(i, from, to), its
  // elements [from, to) of that range, as offsets of the flat parameters.
  template <typename Fn>
  void for_each_in_range(int64_t begin, int64_t end, Fn&& fn) const {
    for (size_t i = 0; i < params.size(); ++i) {
      const int64_t from = std::max(offsets[i], begin);
      const int64_t to = std::min(offsets[i] + params[i].numel(), end);
      if (from < to) fn(i, from, to);
    }
  }

  // Tells server s that this worker is done; nothing comes back.
  void say_goodbye(size_t s) {
    const Request request{.kind = kBye, .worker = rank};
    comm::socket::write_all(fds[s], &request, sizeof request, server_name(static_cast<int>(s)),
                            timeout);
  }

  // One round trip with server s (a push or a pull): the request (and a push's gradient), then
  // the reply and the shard.
  Reply exchange(size_t s, Kind kind, double lr, ParameterServerStats& stats) {
    const auto [begin, end] = ranges[s];
    const std::string peer = server_name(static_cast<int>(s));
    Request request{.kind = kind,
                    .worker = rank,
                    .base_version = versions[s],
                    .lr = lr,
                    .numel = kind == kPush ? end - begin : 0};
    comm::socket::write_all(fds[s], &request, sizeof request, peer, timeout);
    int64_t sent = sizeof request;
    if (kind == kPush) {
      comm::socket::write_all(fds[s], grads.data_ptr<float>() + begin,
                              static_cast<size_t>(end - begin) * sizeof(float), peer, timeout);
      sent += (end - begin) * 4;
    }
    stats.bytes_sent += sent;
    Reply reply;
    try {
      comm::socket::read_all(fds[s], &reply, sizeof reply, timeout, peer);
    } catch (const TimeoutError&) {
      throw TimeoutError(peer + " did not answer rank " + std::to_string(rank) + "'s " +
                         (kind == kPush ? "push" : "pull") + " within " +
                         std::to_string(timeout.count()) + " ms: a worker more than " +
                         std::to_string(max_staleness) +
                         " steps behind holds it back, or the server's process hangs");
    } catch (const RuntimeError& e) {
      throw comm::socket::PeerGone(peer + " (rank " + std::to_string(s) +
                                   ") went away: " + e.what());
    }
    if (!ps::reply_accepted(reply, end - begin)) {
      throw RuntimeError(peer + " answered rank " + std::to_string(rank) +
                         " with a malformed reply (another program on its port?)");
    }
    comm::socket::read_all(fds[s], pulled.data_ptr<float>() + begin,
                           static_cast<size_t>(end - begin) * sizeof(float), timeout, peer);
    versions[s] = reply.version;
    return reply;
  }

  void copy_pulled_into_params() {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) params[i].copy_(view(pulled, i));
  }
};

ParameterServerOptimizer::ParameterServerOptimizer(
    std::shared_ptr<torch::nn::Module> module, std::unique_ptr<torch::optim::Optimizer> optimizer,
    comm::ProcessGroup group, const AsyncParameterServer& mode)
    : torch::optim::Optimizer(detail::param_groups_of(optimizer.get(), "ParameterServerOptimizer"),
                              detail::defaults_of(optimizer.get(), "ParameterServerOptimizer")),
      module_(std::move(module)),
      optimizer_(std::move(optimizer)),
      group_(std::move(group)),
      mode_(mode),
      client_(std::make_unique<Client>()) {
  validate(SyncMode(mode_));
  const std::string who = "ParameterServerOptimizer";
  if (!module_) throw UsageError(who + ": the module is null");
  const int world = group_.world_size();
  if (mode_.servers < 1 || mode_.servers > world) {
    throw UsageError(who + ": " + std::to_string(mode_.servers) + " parameter servers for " +
                     std::to_string(world) +
                     " workers: the servers run in the worker processes, so choose 1 to " +
                     std::to_string(world));
  }
  algorithm_ = optim::algorithm_of(*optimizer_, who, "the parameter servers step only those");
  if (optimizer_->param_groups().size() != 1) {
    throw UsageError(who + ": the optimizer has " +
                     std::to_string(optimizer_->param_groups().size()) +
                     " param groups; the parameter servers support one, holding the module's "
                     "parameters");
  }
  state_names_ = optim::state_names_of(algorithm_, optimizer_->param_groups()[0].options());
  auto& c = *client_;
  c.rank = group_.rank();
  c.timeout = group_.timeout();
  c.max_staleness = mode_.max_staleness;
  auto trainable =
      detail::trainable_parameters(*module_, optimizer_->param_groups()[0].params(), who);
  c.names = std::move(trainable.names);
  c.params = std::move(trainable.params);
  if (c.params.front().scalar_type() != at::kFloat) {
    throw UsageError(who + ": the parameters are " +
                     std::string(c10::toString(c.params.front().scalar_type())) +
                     "; the parameter servers hold float32 parameters (train in fp32, or with "
                     "autocast's bf16/fp16 compute over fp32 parameters)");
  }
  std::vector<at::Tensor> buffers;
  for (const auto& b : module_->buffers()) {
    buffers.push_back(b);
    if (b.is_floating_point()) c.float_buffers.push_back(b);
  }
  detail::start_replicas(group_, c.names, c.params, buffers, who);
  for (const auto& p : c.params) {
    c.offsets.push_back(c.numel);
    c.numel += p.numel();
  }
  const auto cpu_float = at::TensorOptions().dtype(at::kFloat).device(at::kCPU);
  c.grads = at::zeros({c.numel}, cpu_float);
  c.pulled = at::empty({c.numel}, cpu_float);
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < c.params.size(); ++i) c.view(c.pulled, i).copy_(c.params[i]);
  }
  for (int s = 0; s < mode_.servers; ++s)
    c.ranges.emplace_back(c.numel * s / mode_.servers, c.numel * (s + 1) / mode_.servers);
  c.versions.assign(static_cast<size_t>(mode_.servers), 0);

  const int rank = group_.rank();
  std::string address;
  if (rank < mode_.servers) {
    const auto [begin, end] = c.ranges[static_cast<size_t>(rank)];
    server_ = std::make_unique<Server>(rank, world, mode_.max_staleness, group_, begin, end,
                                       c.pulled.narrow(0, begin, end - begin), algorithm_,
                                       optimizer_->param_groups()[0].options());
    server_->start();
    address = server_->address;
  }
  // Every rank learns the servers' addresses, then connects to each.
  auto mine = at::zeros({kAddressBytes}, at::TensorOptions().dtype(at::kByte));
  std::memcpy(mine.data_ptr(), address.data(),
              std::min<size_t>(address.size(), static_cast<size_t>(kAddressBytes - 1)));
  const auto all = group_.allgather(mine);
  for (int s = 0; s < mode_.servers; ++s) {
    const std::string at(static_cast<const char*>(all[static_cast<size_t>(s)].data_ptr()));
    const std::string name = server_name(s) + " (rank " + std::to_string(s) + ")";
    c.fds.push_back(comm::socket::connect_to(
        at, group_.timeout(), name,
        ": does its rank run, and is its address reachable from this host?"));
    comm::prove_secret(c.fds.back(), group_.secret(),
                       std::chrono::steady_clock::now() + group_.timeout(), name + " at " + at);
  }
}

std::string ParameterServerOptimizer::server_address() const {
  return server_ ? server_->address : std::string();
}

ParameterServerOptimizer::~ParameterServerOptimizer() {
  const bool failing = std::uncaught_exceptions() > 0;
  for (size_t s = 0; s < client_->fds.size(); ++s) {
    try {
      client_->say_goodbye(s);
    } catch (const std::exception&) {
      // The server is gone already: nothing to say goodbye to.
    }
  }
  for (int& fd : client_->fds) {
    ::close(fd);
    fd = -1;
  }
  if (server_) server_->finish(!failing);
}

bool ParameterServerOptimizer::serves() const { return server_ != nullptr; }

int64_t ParameterServerOptimizer::numel() const { return client_->numel; }

std::vector<std::pair<int64_t, int64_t>> ParameterServerOptimizer::shard_ranges() const {
  return client_->ranges;
}

torch::Tensor ParameterServerOptimizer::step(LossClosure closure) {
  torch::Tensor loss;
  if (closure) {
    torch::AutoGradMode enable(true);
    loss = closure();
  }
  if (server_) {
    std::lock_guard lock(server_->mutex);
    if (!server_->error.empty()) {
      throw RuntimeError("the parameter server on rank " + std::to_string(group_.rank()) +
                         " failed: " + server_->error);
    }
  }
  auto& c = *client_;
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < c.params.size(); ++i) {
      const auto& g = c.params[i].grad();
      if (g.defined()) {
        c.view(c.grads, i).copy_(g);
      } else {
        c.view(c.grads, i).zero_();
      }
    }
  }
  const double lr = param_groups_[0].options().get_lr();
  const auto start = Clock::now();
  const int64_t sent_before = stats_.bytes_sent;
  int64_t staleness = 0;
  for (size_t s = 0; s < c.fds.size(); ++s) {
    const auto reply = c.exchange(s, kPush, lr, stats_);
    staleness = std::max(staleness, reply.staleness);
  }
  c.copy_pulled_into_params();
  group_.add_bytes_sent(stats_.bytes_sent - sent_before);
  ++stats_.pushes;
  stats_.staleness_sum += staleness;
  stats_.staleness_max = std::max(stats_.staleness_max, staleness);
  stats_.wait_seconds += std::chrono::duration<double>(Clock::now() - start).count();
  return loss;
}

void ParameterServerOptimizer::sync() {
  // Every push of every worker is answered (so applied) once all have reached the barrier.
  group_.barrier();
  auto& c = *client_;
  for (size_t s = 0; s < c.fds.size(); ++s) c.exchange(s, kPull, 0, stats_);
  c.copy_pulled_into_params();
  if (group_.world_size() > 1 && !c.float_buffers.empty())
    detail::average_across_ranks(group_, c.float_buffers);
  if (server_) {
    std::lock_guard lock(server_->mutex);
    server_->take_snapshot();
  }
  // Nobody pushes again before every rank pulled and every server took its snapshot.
  group_.barrier();
}

void ParameterServerOptimizer::save(torch::serialize::OutputArchive& archive) const {
  optimizer_->save(archive);
}

void ParameterServerOptimizer::load(torch::serialize::InputArchive& archive) {
  // The loaded options (a scheduled lr among them) are this optimizer's from now on.
  detail::load_wrapped(*this, *optimizer_, archive);
}

optim::StateDict ParameterServerOptimizer::state_dict() const {
  optim::StateDict out;
  out.shards = mode_.servers;
  const auto& c = *client_;
  if (server_) {
    auto& s = *server_;
    std::lock_guard lock(s.mutex);
    out.shard = s.index;
    // Each parameter's elements in [begin, end), as ZeRO cuts its shards.
    c.for_each_in_range(s.begin, s.end, [&](size_t i, int64_t from, int64_t to) {
      for (size_t k = 0; k < state_names_.size() && k < s.snapshot.state.size(); ++k) {
        out.tensors[c.names[i] + "/" + state_names_[k]] =
            optim::StateTensor{.values = s.snapshot.state[k].narrow(0, from - s.begin, to - from),
                               .offset = from - c.offsets[i],
                               .numel = c.params[i].numel()};
      }
    });
    out.values = optim::optimizer_state_values(algorithm_, state_names_, s.snapshot.optimizer_steps,
                                               param_groups()[0].options().get_lr());
    out.values["version"] = s.snapshot.version;
    out.values["pushes_by_worker"] = s.snapshot.pushes;
    return out;
  }
  out.values = optim::optimizer_state_values(algorithm_, state_names_, 0,
                                             param_groups()[0].options().get_lr());
  return out;
}

void ParameterServerOptimizer::check_state(const Json& values) const {
  optim::check_optimizer_state(values, algorithm_, state_names_);
}

void ParameterServerOptimizer::load_state_dict(const optim::StateDict& state) {
  check_state(state.values);
  group_.barrier();
  const double lr = state.values.value("lr", param_groups()[0].options().get_lr());
  param_groups()[0].options().set_lr(lr);
  optimizer_->param_groups()[0].options().set_lr(lr);
  if (server_) {
    auto& s = *server_;
    auto& c = *client_;
    std::lock_guard lock(s.mutex);
    torch::NoGradGuard no_grad;
    // The shard starts from the module's (loaded) parameters.
    for (size_t i = 0; i < c.params.size(); ++i) c.view(c.pulled, i).copy_(c.params[i]);
    s.shard.copy_(c.pulled.narrow(0, s.begin, s.end - s.begin));
    const auto buffers = s.optimizer->state_buffers(0);
    c.for_each_in_range(s.begin, s.end, [&](size_t i, int64_t from, int64_t to) {
      const int64_t first = c.offsets[i];
      for (size_t k = 0; k < state_names_.size() && k < buffers.size(); ++k) {
        const auto name = c.names[i] + "/" + state_names_[k];
        const auto found = state.tensors.find(name);
        if (found == state.tensors.end() || found->second.values.numel() != to - from) {
          throw UsageError("ParameterServerOptimizer: the state to load holds no " +
                           state_names_[k] + " of elements [" + std::to_string(from - first) +
                           ", " + std::to_string(to - first) + ") of parameter '" + c.names[i] +
                           "': it was written for another model");
        }
        buffers[k].narrow(0, from - s.begin, to - from).copy_(found->second.values);
      }
    });
    s.optimizer->set_steps_taken(0, state.values.value("steps", int64_t{0}));
    s.version = state.values.value("version", int64_t{0});
    const auto pushes = state.values.value("pushes_by_worker", std::vector<int64_t>{});
    if (pushes.size() == s.pushes.size()) {
      s.pushes = pushes;
    } else {
      // Another number of workers: every worker starts level with the slowest of before.
      const int64_t least = pushes.empty() ? 0 : *std::min_element(pushes.begin(), pushes.end());
      std::fill(s.pushes.begin(), s.pushes.end(), least);
    }
  }
  sync();
}

int ParameterServerOptimizer::checkpoint_rank() const { return group_.rank(); }

bool ParameterServerOptimizer::writes_state() const { return server_ != nullptr; }

void ParameterServerOptimizer::prepare_checkpoint() const {
  // The servers' state does not change: every rank is only brought to it.
  const_cast<ParameterServerOptimizer*>(this)->sync();
}

}  // namespace cohort::parallel

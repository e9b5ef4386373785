#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <condition_variable>
#include <csignal>
#include <cstring>
#include <iostream>
#include <mutex>
#include <set>
#include <thread>

#include "cohort/data/data_iterator.h"
#include "cohort/error.h"
#include "cohort/json.h"
#include "cohort/runtime/environment.h"
#include "cohort/runtime/process.h"
#include "cohort/runtime/worker_info.h"
#include "cohort/timeouts.h"
#include "comm/handshake.h"
#include "data/task_runner.h"
#include "data/wire.h"
#include "data/wire_messages.h"

namespace cohort::data {

namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kMessageTimeout = kDefaultDataMessageTimeout;

// The secret the pool's workers prove they hold: the pipeline's, else the job's (a Trainer's
// worker has it in its environment), else a fresh one that only the pool's own workers get.
comm::JobSecret pool_secret(const ExecutionOptions& options) {
  if (!options.secret.empty()) return options.secret;
  return runtime::job_secret_from_env().value_or(comm::JobSecret::generate());
}

class InlineRunner : public TaskRunner {
 public:
  explicit InlineRunner(const Dataset::Plan& plan) : plan_(plan) {}
  void start_epoch(int64_t epoch, std::vector<std::vector<int64_t>> tasks) override {
    epoch_ = epoch;
    tasks_ = std::move(tasks);
    next_ = 0;
  }
  std::optional<TaskResult> next() override {
    if (next_ >= tasks_.size()) return std::nullopt;
    auto result = run_task(plan_, static_cast<int64_t>(next_), tasks_[next_], epoch_);
    ++next_;
    if (!result.error.empty()) throw RuntimeError(result.error);
    return result;
  }
  void cancel() override {}

 private:
  const Dataset::Plan& plan_;
  int64_t epoch_ = 0;
  std::vector<std::vector<int64_t>> tasks_;
  size_t next_ = 0;
};

std::string describe_status(int status) {
  if (WIFSIGNALED(status))
    return std::string("killed by signal ") + std::to_string(WTERMSIG(status)) + " (" +
           strsignal(WTERMSIG(status)) + ")";
  if (WIFEXITED(status)) return "exited with code " + std::to_string(WEXITSTATUS(status));
  return "ended";
}

class WorkerPool : public TaskRunner {
 public:
  WorkerPool(const Dataset::Plan& plan, std::string fingerprint, int local_workers,
             std::map<std::string, std::string> env)
      : plan_(plan),
        fingerprint_(std::move(fingerprint)),
        local_workers_(local_workers),
        env_(std::move(env)),
        secret_(pool_secret(plan.execution)) {
    const auto& ex = plan.execution;
    window_ = ex.max_tasks_in_flight > 0 ? ex.max_tasks_in_flight
                                         : 2 * (local_workers + ex.remote_workers) + 1;
    static int counter = 0;
    std::string bound;
    unix_listener_ = wire::listen_on(
        "unix:cohort-data-" + std::to_string(::getpid()) + "-" + std::to_string(++counter), bound);
    unix_address_ = bound;
    if (!ex.listen_address.empty())
      tcp_listener_ = wire::listen_on(ex.listen_address, tcp_address_);
    if (::pipe2(wake_, O_CLOEXEC | O_NONBLOCK) != 0)
      throw RuntimeError("pipe: " + std::string(std::strerror(errno)));
    start_deadline_ = Clock::now() + ex.worker_start_timeout;
    for (int i = 0; i < local_workers; ++i) spawn();
    io_ = std::thread([this] { loop(); });
  }

  ~WorkerPool() override {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake();
    if (io_.joinable()) io_.join();
    shutting_down_ = true;
    // A worker still starting finds no consumer and ends; one that is connected is told to stop.
    for (int* fd : {&unix_listener_, &tcp_listener_}) {
      if (*fd >= 0) ::close(*fd);
      *fd = -1;
    }
    for (auto& c : conns_) {
      try {
        wire::send(c.fd, Json{{"type", "stop"}});
      } catch (const std::exception&) {
      }
      ::close(c.fd);
    }
    const auto deadline = Clock::now() + std::chrono::seconds(3);
    while (!children_.empty() && Clock::now() < deadline) {
      reap();
      if (!children_.empty()) ::poll(nullptr, 0, 10);
    }
    for (int pid : children_) {
      ::kill(-pid, SIGKILL);
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
    for (int fd : {wake_[0], wake_[1]}) {
      if (fd >= 0) ::close(fd);
    }
  }

  void start_epoch(int64_t epoch, std::vector<std::vector<int64_t>> tasks) override {
    {
      std::lock_guard lock(mutex_);
      if (ahead_.epoch == epoch && ahead_.tasks == tasks) {
        // The epoch the pool guessed and started early: its results so far are kept.
        current_ = std::move(ahead_);
      } else {
        current_ = EpochTasks{.epoch = epoch, .tasks = std::move(tasks)};
        for (int64_t i = 0; i < static_cast<int64_t>(current_.tasks.size()); ++i)
          current_.pending.insert(i);
      }
      ahead_ = EpochTasks{};
      next_ = 0;
      cancelled_ = false;
    }
    wake();
  }

  std::optional<TaskResult> next() override {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] {
      return cancelled_ || !error_.empty() || current_.done.count(next_) != 0 ||
             next_ >= static_cast<int64_t>(current_.tasks.size());
    });
    if (cancelled_) throw Cancelled{};
    if (!error_.empty()) throw RuntimeError(error_);
    if (next_ >= static_cast<int64_t>(current_.tasks.size())) return std::nullopt;
    auto result = std::move(current_.done[next_]);
    current_.done.erase(next_);
    ++next_;
    lock.unlock();
    wake();
    if (!result.error.empty()) throw RuntimeError(result.error);
    return result;
  }

  void cancel() override {
    {
      std::lock_guard lock(mutex_);
      cancelled_ = true;
    }
    changed_.notify_all();
  }

  int64_t tasks_redone() const override {
    std::lock_guard lock(mutex_);
    return redone_;
  }
  std::string listen_address() const override { return tcp_address_; }

 private:
  struct Conn {
    int fd = -1;
    comm::ServerHandshake proof;  // nothing it sends is parsed before it proved the secret
    int pid = -1;
    bool local = false;
    bool greeted = false;
    int64_t task = -1;  // index in flight, -1 idle
    int64_t task_epoch = -1;
    Clock::time_point task_deadline;  // of the task in flight
    std::string name;
  };

  // A worker whose task runs past ExecutionOptions::task_timeout hangs: it is dropped (a local one
  // is killed and replaced, as one that died) and its task goes to another.
  void drop_hung() {
    const auto now = Clock::now();
    for (auto& c : conns_) {
      if (c.fd < 0 || c.task < 0 || now < c.task_deadline) continue;
      drop(c, "after it hung: task " + std::to_string(c.task) + " ran past its deadline of " +
                  std::to_string(plan_.execution.task_timeout.count()) +
                  " ms (ExecutionOptions::task_timeout)");
    }
  }

  void wake() {
    char b = 0;
    [[maybe_unused]] auto n = ::write(wake_[1], &b, 1);
  }

  void spawn() {
    auto env = env_;
    env[runtime::kDataAddressVar] = unix_address_;
    env[runtime::kDataPipelineVar] = fingerprint_;
    runtime::add_job_secret_env(env, secret_);
    children_.insert(runtime::spawn_self(kDataRole, env));
  }

  void fail(const std::string& message) {
    {
      std::lock_guard lock(mutex_);
      if (error_.empty()) error_ = message;
    }
    changed_.notify_all();
  }

  void reap() {
    for (auto it = children_.begin(); it != children_.end();) {
      int status = 0;
      if (::waitpid(*it, &status, WNOHANG) == *it) {
        exit_status_[*it] = describe_status(status);
        bool connected = false;
        for (auto& c : conns_) connected |= c.pid == *it;
        if (!connected) lost_local(*it, "before it connected", -1);
        it = children_.erase(it);
      } else {
        ++it;
      }
    }
  }

  // A local worker is gone: start another while restarts are left.
  void lost_local(int pid, const std::string& when, int64_t task) {
    if (shutting_down_) return;
    const auto status =
        exit_status_.count(pid) ? exit_status_[pid] : std::string("closed its connection");
    std::cerr << "cohort: preprocessing worker " << pid << " " << status << " " << when
              << (task >= 0 ? "; task " + std::to_string(task) + " goes to another worker" : "")
              << (restarts_ < plan_.execution.max_worker_restarts ? "; starting a replacement" : "")
              << std::endl;
    if (restarts_ < plan_.execution.max_worker_restarts) {
      ++restarts_;
      try {
        spawn();
      } catch (const std::exception& e) {
        fail(e.what());
      }
    } else {
      fail("preprocessing worker " + std::to_string(pid) + " " + status + " " + when + ", and " +
           std::to_string(restarts_) +
           " replacements were started already (ExecutionOptions::max_worker_restarts)");
    }
  }

  void drop(Conn& c, const std::string& why) {
    ::close(c.fd);
    c.fd = -1;
    if (c.task >= 0) {
      std::lock_guard lock(mutex_);
      for (auto* e : {&current_, &ahead_}) {
        if (c.task_epoch == e->epoch) {
          e->pending.insert(c.task);
          ++redone_;
          break;
        }
      }
    }
    if (c.local) {
      // It died (its end of the socket closed with it), or lives on without it, of no use: either
      // way it is reaped here, its status read, before a replacement starts.
      if (children_.erase(c.pid) != 0) {  // else reap() already read its status
        int status = 0;
        const auto deadline = Clock::now() + std::chrono::milliseconds(500);
        pid_t r = 0;
        while ((r = ::waitpid(c.pid, &status, WNOHANG)) == 0 && Clock::now() < deadline)
          ::poll(nullptr, 0, 5);
        if (r == 0) {
          ::kill(c.pid, SIGKILL);
          ::waitpid(c.pid, &status, 0);
        }
        exit_status_[c.pid] = describe_status(status);
      }
      lost_local(c.pid, why, c.task);
    } else if (c.greeted) {
      std::cerr << "cohort: remote preprocessing worker " << c.name << " left " << why
                << (c.task >= 0 ? "; task " + std::to_string(c.task) + " goes to another worker"
                                : "")
                << std::endl;
    } else {
      std::cerr << "cohort: closed a connection to the preprocessing listener that never said "
                   "hello ("
                << why << ")" << std::endl;
    }
    c.task = -1;
  }

  void on_message(Conn& c) {
    Json header;
    int payload_fd = -1;
    bool ok = false;
    try {
      ok = wire::receive(c.fd, header, payload_fd, kMessageTimeout);
    } catch (const std::exception& e) {
      drop(c, std::string("sent a broken message (") + e.what() + ")");
      return;
    }
    if (!ok) {
      drop(c, c.task >= 0 ? "while on a task" : "while idle");
      return;
    }
    // Every field is read here, type-checked: a header of the wrong shape drops this worker
    // (its task goes to another) and never ends the consumer.
    wire::WorkerMessage h;
    try {
      h = wire::read_worker_message(header);
    } catch (const std::exception& e) {
      if (payload_fd >= 0) ::close(payload_fd);
      drop(c, std::string("sent a malformed header (") + e.what() + ")");
      return;
    }
    if (h.type == "hello") {
      c.pid = h.pid;
      c.name = h.host + ":" + std::to_string(c.pid);
      c.local = children_.count(c.pid) != 0 && h.local;
      if (h.pipeline != fingerprint_) {
        const std::string reason = "this consumer streams pipeline " + fingerprint_ + " (" +
                                   describe_short() + "), the worker built " + h.pipeline +
                                   ": start it with the same program and arguments";
        try {
          wire::send(c.fd, Json{{"type", "refuse"}, {"reason", reason}});
        } catch (const std::exception&) {
        }
        std::cerr << "cohort: refused preprocessing worker " << c.name << ": " << reason
                  << std::endl;
        ::close(c.fd);
        c.fd = -1;
        return;
      }
      c.greeted = true;
      return;
    }
    if (h.type != "result") {
      if (payload_fd >= 0) ::close(payload_fd);
      return;
    }
    TaskResult result;
    result.index = h.index;
    result.skipped_rows = h.skipped_rows;
    result.skipped_batches = h.skipped_batches;
    result.error = h.error;
    try {
      if (header.contains("columns")) {
        result.block = payload_fd >= 0
                           ? wire::map_block_memfd(payload_fd, header["columns"], h.payload_bytes)
                           : wire::read_block_inline(c.fd, header["columns"], h.payload_bytes,
                                                     kMessageTimeout);
      } else if (payload_fd >= 0) {
        ::close(payload_fd);
      }
    } catch (const std::exception& e) {
      drop(c, std::string("sent a broken batch (") + e.what() + ")");
      return;
    }
    {
      std::lock_guard lock(mutex_);
      const auto epoch = h.epoch;
      for (auto* e : {&current_, &ahead_}) {
        if (e->epoch >= 0 && epoch == e->epoch && c.task_epoch == epoch && c.task == result.index) {
          e->done[result.index] = std::move(result);
          break;
        }
      }
      c.task = -1;
    }
    changed_.notify_all();
  }

  // Whether tasks may go out: a worker is connected, and every remote one asked for. Past the
  // start deadline with tasks waiting, the run fails naming who is missing.
  bool ready_to_dispatch() {
    int connected = 0;
    int remote = 0;
    for (const auto& c : conns_) {
      if (c.fd < 0 || !c.greeted) continue;
      ++connected;
      remote += !c.local;
    }
    const int remote_wanted = plan_.execution.remote_workers;
    if (connected > 0 && remote >= remote_wanted) return true;
    bool waiting = false;
    {
      std::lock_guard lock(mutex_);
      waiting = !current_.pending.empty();
    }
    if (waiting && Clock::now() > start_deadline_) {
      fail("preprocessing workers did not connect within " +
           std::to_string(plan_.execution.worker_start_timeout.count() / 1000) +
           " s: " + std::to_string(connected) + " connected of " + std::to_string(local_workers_) +
           " local" +
           (remote_wanted > 0 ? " and " + std::to_string(remote_wanted) +
                                    " remote (they connect to " + tcp_address_ + ")"
                              : std::string()) +
           ". A worker is this program re-executed: it must build the same pipeline (" +
           describe_short() + ") before iterating it");
    }
    return false;
  }

  void dispatch() {
    if (!ready_to_dispatch()) return;
    int64_t busy = 0;
    for (const auto& c : conns_) busy += c.task >= 0;
    for (auto& c : conns_) {
      if (c.fd < 0 || !c.greeted || c.task >= 0) continue;
      int64_t index = -1;
      int64_t epoch = 0;
      std::vector<int64_t> rows;
      {
        std::lock_guard lock(mutex_);
        const auto held = static_cast<int64_t>(current_.done.size() + ahead_.done.size());
        if (busy + held >= window_) return;
        EpochTasks* from = &current_;
        if (current_.pending.empty()) {
          // Every task of this epoch is out: while the window has room, start the next epoch's
          // (the one a consumer reads after this, unless it sets another), so that its first
          // batches are ready when it begins.
          if (current_.epoch < 0 || cancelled_ || !plan_.execution.prefetch_next_epoch) return;
          if (ahead_.epoch != current_.epoch + 1) {
            ahead_ = EpochTasks{.epoch = current_.epoch + 1,
                                .tasks = epoch_tasks(plan_, current_.epoch + 1)};
            for (int64_t i = 0; i < static_cast<int64_t>(ahead_.tasks.size()); ++i)
              ahead_.pending.insert(i);
          }
          from = &ahead_;
          if (from->pending.empty()) return;
        }
        index = *from->pending.begin();
        from->pending.erase(from->pending.begin());
        epoch = from->epoch;
        rows = from->tasks[static_cast<size_t>(index)];
        c.task = index;
        c.task_epoch = epoch;
        c.task_deadline = Clock::now() + plan_.execution.task_timeout;
        ++busy;
      }
      try {
        wire::send(c.fd,
                   Json{{"type", "task"}, {"index", index}, {"epoch", epoch}, {"rows", rows}});
      } catch (const std::exception&) {
        drop(c, "could not be given a task");
      }
    }
  }

  void loop() {
    while (true) {
      {
        std::lock_guard lock(mutex_);
        if (stopping_) return;
      }
      std::vector<pollfd> fds{
          {wake_[0], POLLIN, 0}, {unix_listener_, POLLIN, 0}, {tcp_listener_, POLLIN, 0}};
      const size_t first_conn = fds.size();
      for (const auto& c : conns_) fds.push_back({c.fd, POLLIN, 0});
      ::poll(fds.data(), fds.size(), 100);
      if (fds[0].revents != 0) {
        char buffer[256];
        while (::read(wake_[0], buffer, sizeof buffer) > 0) {
        }
      }
      for (size_t l = 1; l <= 2; ++l) {
        if (fds[l].fd >= 0 && (fds[l].revents & POLLIN) != 0) {
          const int fd = ::accept4(fds[l].fd, nullptr, nullptr, SOCK_CLOEXEC);
          if (fd >= 0)
            conns_.push_back(Conn{.fd = fd, .proof = comm::ServerHandshake(fd, secret_)});
        }
      }
      const size_t known = fds.size() - first_conn;
      const auto now = Clock::now();
      for (size_t i = 0; i < known; ++i) {
        Conn& c = conns_[i];
        if (c.fd < 0) continue;
        if (!c.proof.proven()) {
          if (c.proof.poll_step(fds[first_conn + i].revents != 0, now) ==
              comm::ServerHandshake::State::kRefused) {
            std::cerr << "cohort: the data plane closed " << c.proof.why() << std::endl;
            ::close(c.fd);
            c.fd = -1;
          }
          continue;
        }
        if (fds[first_conn + i].revents != 0) on_message(c);
      }
      drop_hung();
      std::erase_if(conns_, [](const Conn& c) { return c.fd < 0; });
      reap();
      dispatch();
    }
  }

  std::string describe_short() const {
    std::string names;
    for (const auto& s : plan_.stages) names += (names.empty() ? "" : ", ") + s.name;
    return "stages [" + names + "]";
  }

  const Dataset::Plan& plan_;
  const std::string fingerprint_;
  const int local_workers_;
  const std::map<std::string, std::string> env_;
  const comm::JobSecret secret_;  // what every worker proves it holds
  int64_t window_ = 1;
  int unix_listener_ = -1;
  int tcp_listener_ = -1;
  std::string unix_address_;
  std::string tcp_address_;
  int wake_[2] = {-1, -1};
  Clock::time_point start_deadline_;
  std::thread io_;
  // Owned by the I/O thread.
  std::vector<Conn> conns_;
  std::set<int> children_;
  std::map<int, std::string> exit_status_;
  int restarts_ = 0;
  bool shutting_down_ = false;
  // Shared with the consumer.
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  bool stopping_ = false;
  bool cancelled_ = false;
  std::string error_;
  // The epoch being consumed, and the next one started early (epoch -1: none).
  struct EpochTasks {
    int64_t epoch = -1;
    std::vector<std::vector<int64_t>> tasks;
    std::set<int64_t> pending;  // not handed out yet
    std::map<int64_t, TaskResult> done;
  };
  EpochTasks current_;
  EpochTasks ahead_;
  int64_t next_ = 0;
  int64_t redone_ = 0;
};

}  // namespace

std::unique_ptr<TaskRunner> make_inline_runner(const Dataset::Plan& plan) {
  return std::make_unique<InlineRunner>(plan);
}

std::unique_ptr<TaskRunner> make_worker_pool(const Dataset::Plan& plan,
                                             const std::string& fingerprint, int local_workers,
                                             std::map<std::string, std::string> env) {
  return std::make_unique<WorkerPool>(plan, fingerprint, local_workers, std::move(env));
}

}  // namespace cohort::data

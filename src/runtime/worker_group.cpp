#include "cohort/runtime/worker_group.h"

#include <fcntl.h>
#include <poll.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>

#include "cohort/error.h"
#include "cohort/runtime/control_channel.h"
#include "cohort/runtime/process.h"
#include "cohort/runtime/worker_info.h"
#include "runtime/spawn.h"

namespace cohort::runtime {
namespace {

using Clock = std::chrono::steady_clock;

// Written from signal handlers; read by the event loop.
int g_wake_pipe[2] = {-1, -1};
volatile sig_atomic_t g_interrupt = 0;
volatile sig_atomic_t g_sigints = 0;  // SIGINTs since the outermost InterruptScope began

void on_signal(int sig) {
  if (sig == SIGINT && g_sigints < 100) g_sigints = g_sigints + 1;
  if (sig == SIGINT || sig == SIGTERM) g_interrupt = sig;
  const int saved = errno;
  if (g_wake_pipe[1] >= 0) {
    char byte = 0;
    [[maybe_unused]] auto n = ::write(g_wake_pipe[1], &byte, 1);
  }
  errno = saved;
}

// Pipe ends above the standard descriptors and close-on-exec, so that dup2 onto 1, 2 and 3 in
// the child can never be a no-op that leaves close-on-exec set.
std::array<int, 2> make_pipe() {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    throw RuntimeError(std::string("pipe: ") + std::strerror(errno));
  }
  std::array<int, 2> out{};
  for (int i = 0; i < 2; ++i) {
    out[i] = ::fcntl(fds[i], F_DUPFD_CLOEXEC, 10);
    ::close(fds[i]);
  }
  return out;
}

struct Stream {
  int fd = -1;
  std::string pending;
  bool is_stderr = false;
  bool is_control = false;
};

struct Worker {
  int rank = 0;
  pid_t pid = -1;
  bool running = false;
  WorkerExit exit;
  std::array<Stream, 3> streams;  // stdout, stderr, control
  std::ofstream log;
  std::map<std::string, std::string> extra_env;  // on top of its rank's (a replacement's)
};

int g_scope_depth = 0;
struct sigaction g_saved_actions[3]{};

int signal_slot(int sig) { return sig == SIGINT ? 0 : sig == SIGTERM ? 1 : 2; }

void drain_wake_pipe() {
  char buffer[64];
  while (g_wake_pipe[0] >= 0 && ::read(g_wake_pipe[0], buffer, sizeof buffer) > 0) {
  }
}

std::string read_file(const char* path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

}  // namespace

InterruptScope::InterruptScope() {
  if (g_scope_depth++ > 0) return;
  auto p = make_pipe();
  g_wake_pipe[0] = p[0];
  g_wake_pipe[1] = p[1];
  ::fcntl(p[0], F_SETFL, O_NONBLOCK);
  ::fcntl(p[1], F_SETFL, O_NONBLOCK);
  g_interrupt = 0;
  g_sigints = 0;
  struct sigaction action {};
  action.sa_handler = on_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  for (int sig : {SIGINT, SIGTERM, SIGCHLD})
    sigaction(sig, &action, &g_saved_actions[signal_slot(sig)]);
}

InterruptScope::~InterruptScope() {
  if (--g_scope_depth > 0) return;
  for (int sig : {SIGINT, SIGTERM, SIGCHLD})
    sigaction(sig, &g_saved_actions[signal_slot(sig)], nullptr);
  ::close(g_wake_pipe[0]);
  ::close(g_wake_pipe[1]);
  g_wake_pipe[0] = g_wake_pipe[1] = -1;
}

int InterruptScope::signal() { return g_interrupt; }

std::string WorkerExit::describe() const {
  std::string who =
      (name.empty() ? "rank " + std::to_string(rank) : name) + " (pid " + std::to_string(pid) + ")";
  if (signal != 0) {
    return who + (stopped_by_driver ? " was stopped by the driver with " : " was killed by ") +
           "signal " + std::to_string(signal) + " (" + strsignal(signal) + ")";
  }
  if (exit_code != 0) return who + " exited with code " + std::to_string(exit_code);
  return who + " finished";
}

bool process_group_alive(int pgid) {
  if (pgid <= 0 || (::kill(-pgid, 0) != 0 && errno != EPERM)) return false;
  // kill() also reaches zombies, which hold nothing but their pid: look for a live member.
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    const auto name = entry.path().filename().string();
    if (name.empty() || !std::isdigit(static_cast<unsigned char>(name[0]))) continue;
    std::ifstream in(entry.path() / "stat");
    std::string text((std::istreambuf_iterator<char>(in)), {});
    const auto close_paren = text.rfind(')');
    if (close_paren == std::string::npos) continue;
    std::istringstream fields(text.substr(close_paren + 2));
    char state = 0;
    long parent = 0, group = 0;
    if (fields >> state >> parent >> group && group == pgid && state != 'Z' && state != 'X')
      return true;
  }
  return false;
}

std::string self_executable() {
  std::error_code ec;
  auto path = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) throw RuntimeError("cannot find this program's executable: " + ec.message());
  return path.string();
}

std::vector<std::string> self_arguments() {
  std::string raw = read_file("/proc/self/cmdline");
  std::vector<std::string> args;
  size_t start = 0;
  while (start < raw.size()) {
    size_t end = raw.find('\0', start);
    if (end == std::string::npos) end = raw.size();
    args.push_back(raw.substr(start, end - start));
    start = end + 1;
  }
  return args;
}

struct WorkerGroup::Impl {
  WorkerGroupOptions options;
  std::vector<Worker> workers;
  bool started = false;
  std::string requested_stop;
  bool requested_for_failure = false;
  // A failure stops the group after the workers answered dump_signal: until then, and why.
  std::optional<std::pair<Clock::time_point, std::string>> dump_until;
  bool dumped = false;
  bool stopping = false;
  bool accepts_stop_requests = false;
  // The state of wait()/poll() between steps.
  GroupOutcome outcome;
  bool finished = false;
  std::optional<Clock::time_point> kill_at;        // stopping: SIGKILL after the grace period
  std::optional<Clock::time_point> skew_deadline;  // someone finished; the rest must follow
  // A worker failed: the others may end on their own until then (failure_grace).
  std::optional<std::pair<Clock::time_point, std::string>> stop_after_grace;
  std::optional<Clock::time_point> drain_until;  // all exited; read what is left in the pipes

  void begin_stop(std::string reason, bool failure = false) {
    if (kill_at || dump_until) return;
    stopping = true;
    if (outcome.stop_began == Clock::time_point{}) outcome.stop_began = Clock::now();
    if (failure && !dumped && options.dump_signal != 0 && options.dump_grace.count() > 0) {
      // The workers write what they know (their flight recorders) before they are stopped.
      dumped = true;
      for (auto& w : workers) {
        if (w.running) ::kill(w.pid, options.dump_signal);
      }
      dump_until.emplace(Clock::now() + options.dump_grace, std::move(reason));
      return;
    }
    if (outcome.failure_reason.empty()) outcome.failure_reason = std::move(reason);
    // Whoever already died did so on their own, not by our SIGTERM: record them as such.
    for (auto& w : workers) reap(w, false);
    signal_all(SIGTERM);
    // A stopped worker (SIGSTOP, a debugger) takes the TERM only once it runs again.
    signal_all(SIGCONT);
    kill_at = Clock::now() + options.stop_grace;
  }

  // One turn of the event loop; true once the group has ended.
  bool step(const WorkerGroupHandlers& handlers, std::chrono::milliseconds max_wait);
  GroupOutcome conclude();

  std::vector<std::string> environment(const Worker& worker) const {
    const int rank = worker.rank;
    auto vars = options.env;
    if (options.rank_env) {
      for (const auto& [k, v] : options.rank_env(rank)) vars[k] = v;
    }
    for (const auto& [k, v] : worker.extra_env) vars[k] = v;
    return child_environment(vars, options.rank_role ? options.rank_role(rank) : options.role,
                             !options.role.empty());
  }

  void spawn(Worker& worker) {
    auto out = make_pipe();
    auto err = make_pipe();
    auto ctl = make_pipe();
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, out[1], 1);
    posix_spawn_file_actions_adddup2(&actions, err[1], 2);
    posix_spawn_file_actions_adddup2(&actions, ctl[1], 3);
    // /proc/self/exe is this very image even if its file was replaced (a rebuild) meanwhile;
    // the path it names would then be the new binary, or nothing.
    const std::string exe = options.executable.empty() ? "/proc/self/exe" : options.executable;
    std::vector<std::string> args = options.argv.empty() ? self_arguments() : options.argv;
    if (args.empty()) args.push_back(exe);
    int pid = -1;
    const int rc = spawn_in_own_group(exe, std::move(args), environment(worker), &actions, pid);
    posix_spawn_file_actions_destroy(&actions);
    for (int fd : {out[1], err[1], ctl[1]}) ::close(fd);
    if (rc != 0) {
      for (int fd : {out[0], err[0], ctl[0]}) ::close(fd);
      throw RuntimeError("cannot start worker rank " + std::to_string(worker.rank) + " (" + exe +
                         "): " + std::strerror(rc));
    }
    worker.pid = pid;
    worker.running = true;
    worker.exit.rank = worker.rank;
    if (options.rank_name) worker.exit.name = options.rank_name(worker.rank);
    worker.exit.pid = pid;
    worker.streams[0] = Stream{out[0], {}, false, false};
    worker.streams[1] = Stream{err[0], {}, true, false};
    worker.streams[2] = Stream{ctl[0], {}, false, true};
    for (auto& s : worker.streams) ::fcntl(s.fd, F_SETFL, O_NONBLOCK);
  }

  void dispatch(Worker& worker, Stream& stream, const std::string& line,
                const WorkerGroupHandlers& handlers) {
    if (stream.is_control) {
      if (handlers.on_control) handlers.on_control(worker.rank, line);
      return;
    }
    if (worker.log.is_open()) worker.log << line << '\n';
    if (handlers.on_output) {
      handlers.on_output(worker.rank, worker.pid, stream.is_stderr, line);
    } else {
      auto& os = stream.is_stderr ? std::cerr : std::cout;
      os << "(rank=" << worker.rank << ", pid=" << worker.pid << ") " << line << '\n';
    }
  }

  // Reads what is available; returns false at end of stream.
  bool pump(Worker& worker, Stream& stream, const WorkerGroupHandlers& handlers) {
    char buffer[65536];
    while (true) {
      ssize_t n = ::read(stream.fd, buffer, sizeof buffer);
      if (n > 0) {
        stream.pending.append(buffer, static_cast<size_t>(n));
        size_t start = 0;
        for (size_t nl; (nl = stream.pending.find('\n', start)) != std::string::npos;
             start = nl + 1) {
          dispatch(worker, stream, stream.pending.substr(start, nl - start), handlers);
        }
        stream.pending.erase(0, start);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
      if (!stream.pending.empty()) dispatch(worker, stream, stream.pending, handlers);
      stream.pending.clear();
      ::close(stream.fd);
      stream.fd = -1;
      if (worker.log.is_open()) worker.log.flush();
      return false;
    }
  }

  bool reap(Worker& worker, bool block) {
    if (!worker.running) return false;
    int status = 0;
    pid_t r = ::waitpid(worker.pid, &status, block ? 0 : WNOHANG);
    if (r != worker.pid) return false;
    worker.running = false;
    if (WIFEXITED(status)) worker.exit.exit_code = WEXITSTATUS(status);
    if (WIFSIGNALED(status)) worker.exit.signal = WTERMSIG(status);
    return true;
  }

  void signal_all(int sig) {
    for (auto& w : workers) {
      // The whole process group: helpers a worker started go too, also when the worker itself
      // already died (its pid cannot be reused while its group has members).
      if (!w.running) {
        if (w.pid > 0 && process_group_alive(w.pid)) ::kill(-w.pid, sig);
        continue;
      }
      if (::kill(-w.pid, sig) != 0) ::kill(w.pid, sig);
      if (sig == SIGTERM || sig == SIGKILL) w.exit.stopped_by_driver = true;
    }
  }

  void close_streams() {
    for (auto& w : workers) {
      for (auto& s : w.streams) {
        if (s.fd >= 0) ::close(s.fd);
        s.fd = -1;
      }
    }
  }
};

WorkerGroup::WorkerGroup(WorkerGroupOptions options) : impl_(std::make_unique<Impl>()) {
  if (options.num_workers < 1) {
    throw UsageError("num_workers=" + std::to_string(options.num_workers) + " must be >= 1");
  }
  impl_->options = std::move(options);
}

WorkerGroup::~WorkerGroup() {
  try {
    stop();
  } catch (...) {
  }
  impl_->close_streams();
}

void WorkerGroup::start() {
  if (impl_->started) throw RuntimeError("worker group already started");
  impl_->started = true;
  auto& opts = impl_->options;
  if (!opts.log_dir.empty()) std::filesystem::create_directories(opts.log_dir);
  impl_->workers.resize(static_cast<size_t>(opts.num_workers));
  for (int rank = 0; rank < opts.num_workers; ++rank) {
    auto& w = impl_->workers[static_cast<size_t>(rank)];
    w.rank = rank;
    if (!opts.log_dir.empty()) {
      w.log.open(opts.log_dir / ("rank-" + std::to_string(rank) + ".log"), std::ios::app);
    }
    w.exit.rank = rank;
    if (opts.rank_name) w.exit.name = opts.rank_name(rank);
    if (opts.started_later && opts.started_later(rank)) continue;
    try {
      impl_->spawn(w);
    } catch (...) {
      stop();
      throw;
    }
  }
}

bool WorkerGroup::Impl::step(const WorkerGroupHandlers& handlers,
                             std::chrono::milliseconds max_wait) {
  std::vector<pollfd> fds{{g_wake_pipe[0], POLLIN, 0}};
  std::vector<std::pair<Worker*, Stream*>> owners{{nullptr, nullptr}};
  for (auto& w : workers) {
    for (auto& s : w.streams) {
      if (s.fd < 0) continue;
      fds.push_back({s.fd, POLLIN, 0});
      owners.emplace_back(&w, &s);
    }
  }
  bool any_running = false;
  for (auto& w : workers) any_running |= w.running;
  if (!any_running && fds.size() == 1) return true;

  // Without an InterruptScope the first entry is -1, which poll() skips.
  ::poll(fds.data(), fds.size(), static_cast<int>(max_wait.count()));
  if (fds[0].revents != 0) drain_wake_pipe();
  for (size_t i = 1; i < fds.size(); ++i) {
    if (fds[i].revents != 0) pump(*owners[i].first, *owners[i].second, handlers);
  }

  if (!requested_stop.empty() && !kill_at) begin_stop(requested_stop, requested_for_failure);
  if (g_interrupt != 0 && outcome.interrupted_by == 0) {
    if (accepts_stop_requests && g_interrupt == SIGINT && g_sigints == 1) {
      // Passed on once: the workers stop after their next checkpoint.
      if (!outcome.stop_requested) {
        outcome.stop_requested = true;
        // Each worker only, not its process group: its preprocessing helpers keep the default
        // action, which would end them.
        for (auto& w : workers)
          if (w.running) ::kill(w.pid, kStopRequestSignal);
        if (handlers.on_stop_request) handlers.on_stop_request();
      }
    } else {
      outcome.interrupted_by = g_interrupt;
      begin_stop(std::string("interrupted by ") + strsignal(g_interrupt));
    }
  }
  std::vector<Worker*> exited;
  for (auto& w : workers) {
    if (!reap(w, false)) continue;
    exited.push_back(&w);
    // What a worker wrote before it ended is handled before its end is: it may have written
    // after the poll() above.
    for (auto& s : w.streams) {
      if (s.fd >= 0) pump(w, s, handlers);
    }
  }
  // Of workers that ended together, one killed by a signal is the likelier cause: its peers
  // then fail in their collectives.
  std::stable_partition(exited.begin(), exited.end(),
                        [](Worker* w) { return w->exit.signal != 0; });
  for (Worker* w : exited) {
    if (handlers.on_exit) handlers.on_exit(w->exit);
    if (!requested_stop.empty() && !kill_at) begin_stop(requested_stop, requested_for_failure);
    if (!w->exit.ok() && !w->exit.tolerated && !outcome.first_failure && !kill_at) {
      outcome.first_failure = w->exit;
      if (options.failure_grace.count() > 0) {
        outcome.stop_began = Clock::now();
        stop_after_grace.emplace(Clock::now() + options.failure_grace, w->exit.describe());
      } else {
        begin_stop(w->exit.describe(), /*failure=*/true);
      }
    } else if (w->exit.ok() && !skew_deadline) {
      skew_deadline = Clock::now() + options.exit_skew_timeout;
    }
  }
  if (handlers.on_tick) handlers.on_tick();
  const auto now = Clock::now();
  if (skew_deadline && now > *skew_deadline && !kill_at) {
    std::string hung;
    for (auto& w : workers) {
      if (w.running) hung += (hung.empty() ? "" : ", ") + std::to_string(w.rank);
    }
    begin_stop("ranks [" + hung + "] still running " +
                   std::to_string(options.exit_skew_timeout.count() / 1000) +
                   " s after another rank finished: stopped as hung",
               /*failure=*/true);
  }
  if (stop_after_grace && now >= stop_after_grace->first && !kill_at) {
    begin_stop(stop_after_grace->second, /*failure=*/true);
  }
  if (dump_until) {
    std::vector<int> running;
    for (const auto& w : workers) {
      if (w.running) running.push_back(w.rank);
    }
    if (now >= dump_until->first || running.empty() ||
        (options.dumped && options.dumped(running))) {
      std::string reason = std::move(dump_until->second);
      dump_until.reset();
      begin_stop(std::move(reason));
    }
  }
  if (kill_at && now > *kill_at) signal_all(SIGKILL);
  // A grandchild holding a pipe open must not keep the driver waiting once workers are gone.
  any_running = false;
  for (auto& w : workers) any_running |= w.running;
  if (!any_running && !drain_until) drain_until = now + std::chrono::seconds(2);
  return drain_until && now > *drain_until;
}

GroupOutcome WorkerGroup::Impl::conclude() {
  finished = true;
  close_streams();
  for (auto& w : workers) outcome.exits.push_back(w.exit);
  outcome.success = outcome.failure_reason.empty();
  for (const auto& e : outcome.exits) outcome.success &= e.ok() || e.tolerated;
  if (!outcome.success && outcome.failure_reason.empty()) {
    for (const auto& e : outcome.exits) {
      if (!e.ok() && !e.tolerated) {
        outcome.failure_reason = e.describe();
        break;
      }
    }
  }
  return outcome;
}

std::optional<GroupOutcome> WorkerGroup::poll(const WorkerGroupHandlers& handlers,
                                              std::chrono::milliseconds max_wait) {
  if (!impl_->started) throw RuntimeError("WorkerGroup::poll before start()");
  if (impl_->finished) return std::nullopt;
  if (!impl_->step(handlers, max_wait)) return std::nullopt;
  return impl_->conclude();
}

GroupOutcome WorkerGroup::wait(const WorkerGroupHandlers& handlers) {
  if (impl_->finished) throw RuntimeError("WorkerGroup::wait after the group has ended");
  InterruptScope interrupts;
  while (!impl_->step(handlers, std::chrono::milliseconds(100))) {
  }
  return impl_->conclude();
}

void WorkerGroup::request_stop(std::string reason, bool failure) {
  if (!impl_->requested_stop.empty()) return;
  impl_->requested_stop = std::move(reason);
  impl_->requested_for_failure = failure;
}

void WorkerGroup::tolerate(int rank) {
  impl_->workers.at(static_cast<size_t>(rank)).exit.tolerated = true;
}

void WorkerGroup::restart(int rank, const std::map<std::string, std::string>& env) {
  auto& w = impl_->workers.at(static_cast<size_t>(rank));
  if (w.running) {
    throw RuntimeError("cannot restart worker rank " + std::to_string(rank) + ": it still runs");
  }
  // Its end was handled when it was reaped: what is left in its pipes is dropped.
  for (auto& stream : w.streams) {
    if (stream.fd >= 0) ::close(stream.fd);
    stream = Stream{};
  }
  w.exit = WorkerExit{};
  w.extra_env = env;
  impl_->spawn(w);
}

void WorkerGroup::signal(int rank, int signal) {
  const auto& w = impl_->workers.at(static_cast<size_t>(rank));
  if (w.running) ::kill(w.pid, signal);
}

void WorkerGroup::kill(int rank) {
  const auto& w = impl_->workers.at(static_cast<size_t>(rank));
  if (!w.running) return;
  if (::kill(-w.pid, SIGKILL) != 0) ::kill(w.pid, SIGKILL);
}

bool WorkerGroup::stopping() const { return impl_->stopping || !impl_->requested_stop.empty(); }

void WorkerGroup::accept_stop_requests() { impl_->accepts_stop_requests = true; }

void WorkerGroup::stop() {
  auto& workers = impl_->workers;
  auto anything_left = [&] {
    bool any = false;
    for (auto& w : workers) {
      impl_->reap(w, false);
      any |= w.running || process_group_alive(w.pid);
    }
    return any;
  };
  if (!anything_left()) return;
  impl_->signal_all(SIGTERM);
  const auto deadline = Clock::now() + impl_->options.stop_grace;
  while (Clock::now() < deadline) {
    if (!anything_left()) return;
    ::poll(nullptr, 0, 20);
  }
  impl_->signal_all(SIGKILL);
  for (auto& w : workers) impl_->reap(w, true);
}

std::vector<int> WorkerGroup::pids() const {
  std::vector<int> out;
  for (const auto& w : impl_->workers) out.push_back(w.pid);
  return out;
}

}  // namespace cohort::runtime

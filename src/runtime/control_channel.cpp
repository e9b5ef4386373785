#include "cohort/runtime/control_channel.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <mutex>
#include <string_view>
#include <thread>

#include "cohort/comm/address.h"
#include "cohort/error.h"
#include "cohort/runtime/worker_info.h"
#include "comm/handshake.h"
#include "comm/socket.h"

namespace cohort::runtime {
namespace {

// The driver's pipe (COHORT_CONTROL_FD), or the connection to rank 0's coordinator.
std::atomic<int>& control_fd_slot() {
  static std::atomic<int> fd = env_int(kControlFdVar, -1, 0);
  return fd;
}
int control_fd() { return control_fd_slot().load(); }

std::mutex& control_mutex() {
  static std::mutex mutex;
  return mutex;
}

std::function<void(const std::string&)>& control_sink() {
  static std::function<void(const std::string&)> sink;
  return sink;
}
// Held while the sink is replaced or called: the heartbeat thread calls it too.
std::mutex& sink_mutex() {
  static std::mutex mutex;
  return mutex;
}

// `handler` for `signal` (SIG_DFL: the default), restarting the system calls it interrupts.
void install_handler(int signal, void (*handler)(int)) {
  struct sigaction action {};
  action.sa_handler = handler;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  sigaction(signal, &action, nullptr);
}

// set_flight_recorder(): the recorder and its dump, and the dump requests received
// (kFlightDumpSignal) and served.
struct FlightSlot {
  std::mutex mutex;
  std::shared_ptr<comm::FlightRecorder> recorder;
  std::function<void(const std::string&)> dump;
  int served = 0;
};
FlightSlot& flight_slot() {
  static FlightSlot slot;
  return slot;
}
std::atomic<int> g_dump_requests{0};
void on_dump_request(int) { g_dump_requests.fetch_add(1, std::memory_order_relaxed); }

// The "type" of a control message, found without parsing it ("" when it has none).
std::string type_of(const std::string& line) {
  constexpr std::string_view key = R"("type":")";
  const auto at = line.find(key);
  if (at == std::string::npos) return "";
  const auto begin = at + key.size();
  const auto end = line.find('"', begin);
  return end == std::string::npos ? "" : line.substr(begin, end - begin);
}

void record_control(const std::string& type, const char* direction) {
  if (type == "heartbeat") return;
  std::shared_ptr<comm::FlightRecorder> recorder;
  {
    std::lock_guard lock(flight_slot().mutex);
    recorder = flight_slot().recorder;
  }
  if (recorder) recorder->note_control(type, direction);
}

}  // namespace

void set_flight_recorder(std::shared_ptr<comm::FlightRecorder> recorder,
                         std::function<void(const std::string& reason)> dump) {
  install_handler(kFlightDumpSignal, dump ? on_dump_request : SIG_DFL);
  auto& slot = flight_slot();
  std::lock_guard lock(slot.mutex);
  slot.recorder = std::move(recorder);
  slot.dump = std::move(dump);
  slot.served = g_dump_requests.load();
}

void dump_flight_recorder(const std::string& reason) {
  auto& slot = flight_slot();
  std::lock_guard lock(slot.mutex);
  if (!slot.dump) return;
  try {
    slot.dump(reason);
  } catch (const std::exception& e) {
    const std::string line =
        std::string("cohort: could not write the flight recorder: ") + e.what() + "\n";
    [[maybe_unused]] const auto written = ::write(2, line.data(), line.size());
  }
}

void set_control_sink(std::function<void(const std::string&)> sink) {
  std::lock_guard lock(sink_mutex());
  control_sink() = std::move(sink);
}

bool has_control_channel() {
  if (control_fd() >= 0) return true;
  std::lock_guard lock(sink_mutex());
  return control_sink() != nullptr;
}

void send_control_message(const std::string& line) {
  if (line.find('\n') != std::string::npos) {
    throw RuntimeError("control message must be one line");
  }
  record_control(type_of(line), "send");
  {
    std::lock_guard lock(sink_mutex());
    if (control_sink()) {
      control_sink()(line);
      return;
    }
  }
  const int fd = control_fd();
  if (fd < 0) throw RuntimeError("no control channel: this process was not started by a driver");
  std::string framed = line + "\n";
  std::lock_guard lock(control_mutex());
  const char* data = framed.data();
  size_t left = framed.size();
  while (left > 0) {
    ssize_t n = ::send(fd, data, left, MSG_NOSIGNAL);             // the coordinator's socket
    if (n < 0 && errno == ENOTSOCK) n = ::write(fd, data, left);  // the driver's pipe
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      throw RuntimeError(std::string("cannot reach the driver over the control channel: ") +
                         std::strerror(errno));
    }
    data += n;
    left -= static_cast<size_t>(n);
  }
}

namespace {

struct HeartbeatThread {
  std::mutex mutex;
  std::condition_variable wake;
  bool stop = false;
  std::thread thread;
};
// Never destroyed: a process that ends without stop_heartbeat() must not join it at exit.
HeartbeatThread& heartbeat_thread() {
  static auto* beat = new HeartbeatThread;
  return *beat;
}

}  // namespace

namespace {
volatile sig_atomic_t g_stop_requested = 0;
void on_stop_request(int) { g_stop_requested = 1; }
std::atomic<int> g_peer_losses{0};
static_assert(std::atomic<int>::is_always_lock_free, "a signal handler increments it");
void on_peer_lost(int) { g_peer_losses.fetch_add(1, std::memory_order_relaxed); }
}  // namespace

void watch_peer_losses() { install_handler(kPeerLostSignal, on_peer_lost); }

int peer_losses() { return g_peer_losses.load(std::memory_order_relaxed); }

void note_peer_lost() { g_peer_losses.fetch_add(1, std::memory_order_relaxed); }

void watch_stop_requests() { install_handler(kStopRequestSignal, on_stop_request); }

bool stop_requested() { return g_stop_requested != 0; }

void start_heartbeat(std::chrono::milliseconds interval) {
  if (!has_control_channel()) return;
  auto& beat = heartbeat_thread();
  std::lock_guard lock(beat.mutex);
  if (beat.thread.joinable()) return;
  beat.stop = false;
  beat.thread = std::thread([interval, &beat] {
    while (true) {
      const std::string status = activity_status().dump();
      try {
        send_control_message(R"({"type":"heartbeat","status":)" + status + "}");
      } catch (const std::exception&) {
        return;  // the driver is gone; PDEATHSIG ends this process
      }
      // The driver asked for the flight recorder (kFlightDumpSignal): it stops this process
      // next, so it is written now.
      {
        auto& slot = flight_slot();
        std::unique_lock lock(slot.mutex);
        const int requests = g_dump_requests.load();
        if (requests != slot.served) {
          slot.served = requests;
          lock.unlock();
          dump_flight_recorder("the driver stops the group after a failure");
        }
      }
      std::unique_lock wait(beat.mutex);
      if (beat.wake.wait_for(wait, interval, [&] { return beat.stop; })) return;
    }
  });
}

void stop_heartbeat() {
  auto& beat = heartbeat_thread();
  std::thread thread;
  {
    std::lock_guard lock(beat.mutex);
    beat.stop = true;
    thread = std::move(beat.thread);
  }
  beat.wake.notify_all();
  if (thread.joinable()) thread.join();
}

namespace {

// This rank's end of its connection to rank 0's coordinator.
struct CoordinatorLink {
  std::mutex mutex;
  std::condition_variable changed;
  bool leaving = false;
  std::string address;
  std::string host;  // who hosts the coordinator, as messages name it
  int rank = -1;
};
CoordinatorLink& link() {
  static CoordinatorLink l;
  return l;
}

[[noreturn]] void stop_process(const std::string& why) {
  // One write: a launcher's own lines (mpirun's) must not land inside it.
  const std::string line = "cohort: " + why + "\n";
  [[maybe_unused]] const auto written = ::write(2, line.data(), line.size());
  std::cout.flush();
  std::fflush(nullptr);
  std::_Exit(1);
}

// Follows the coordinator: its beats, its abort, its silence, its end.
void follow_coordinator(int fd, HeartbeatOptions heartbeat) {
  HeartbeatMonitor monitor(1, heartbeat);
  monitor.heard(0);
  std::string in;
  const std::string who = "rank " + std::to_string(link().rank);
  while (true) {
    pollfd p{fd, POLLIN, 0};
    const int ready = ::poll(&p, 1, static_cast<int>(heartbeat.interval.count()));
    {
      std::lock_guard lock(link().mutex);
      if (link().leaving) return;
    }
    if (ready < 0 && errno != EINTR) return;
    if (ready > 0) {
      char buffer[16384];
      const ssize_t n = ::recv(fd, buffer, sizeof buffer, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        std::lock_guard lock(link().mutex);
        if (link().leaving) return;
        stop_process(who + " lost the coordinator at " + link().address + ": " + link().host +
                     "'s process ended or its machine went away");
      }
      in.append(buffer, static_cast<size_t>(n));
      monitor.heard(0);
      for (size_t end; (end = in.find('\n')) != std::string::npos;) {
        const std::string line = in.substr(0, end);
        in.erase(0, end + 1);
        Json message;
        try {
          message = Json::parse(line);
        } catch (const std::exception&) {
          continue;
        }
        const auto type = message.value("type", std::string{});
        record_control(type, "recv");
        // Live recovery: a peer is gone, and this rank's collectives stop waiting for it.
        if (type == "peer_lost") note_peer_lost();
        if (type == "abort" || type == "refused") {
          const std::string reason = message.value("reason", std::string("told to stop"));
          if (type == "abort") dump_flight_recorder("the coordinator stops the job: " + reason);
          stop_process(who + " stops: " + reason);
        }
      }
    }
    if (const auto silent = monitor.find_silent()) {
      std::lock_guard lock(link().mutex);
      if (!link().leaving) {
        stop_process(who + ": " +
                     silent->describe(link().host + ", which hosts the coordinator at " +
                                      link().address + ","));
      }
    }
  }
}

}  // namespace

void connect_to_coordinator(const std::string& address, int rank, const std::string& token,
                            const comm::JobSecret& secret, const HeartbeatOptions& heartbeat,
                            const std::string& coordinator_host) {
  heartbeat.validate();
  const auto [host, port] = comm::parse_host_port(address, "coordinator address");
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<uint16_t>(port));
  if (::inet_pton(AF_INET, host.c_str(), &to.sin_addr) != 1)
    throw RuntimeError("coordinator address '" + address + "': '" + host + "' is not IPv4");
  // Rank 0 listens before it publishes the address: a connect that takes a heartbeat timeout
  // means it is gone or unreachable.
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int error =
      fd < 0 ? errno
             : comm::socket::connect_before(fd, reinterpret_cast<sockaddr*>(&to), sizeof to,
                                            std::chrono::steady_clock::now() + heartbeat.timeout);
  if (error != 0) {
    const std::string why = std::strerror(error);
    if (fd >= 0) ::close(fd);
    throw PeerFailureError("rank " + std::to_string(rank) + " cannot reach the coordinator at " +
                           address + " (" + why + "): is " + coordinator_host + " running?");
  }
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  try {
    comm::prove_secret(fd, secret, std::chrono::steady_clock::now() + heartbeat.timeout,
                       "the coordinator at " + address);
  } catch (...) {
    ::close(fd);
    throw;
  }
  {
    std::lock_guard lock(link().mutex);
    link().address = address;
    link().host = coordinator_host;
    link().rank = rank;
  }
  control_fd_slot().store(fd);
  send_control_message(Json{{"type", "hello"}, {"rank", rank}, {"token", token}}.dump());
  std::thread(follow_coordinator, fd, heartbeat).detach();
}

void leave_coordinator() {
  {
    std::lock_guard lock(link().mutex);
    if (link().rank < 0 || link().leaving) return;
    link().leaving = true;
  }
  link().changed.notify_all();
  try {
    send_control_message(R"({"type":"bye"})");
  } catch (const std::exception&) {
    // The coordinator is gone already: nothing to tell it.
  }
}

void wait_for_coordinator(std::chrono::milliseconds within) {
  std::unique_lock lock(link().mutex);
  if (link().rank < 0) return;
  // The follower thread ends the process when the coordinator names a cause; else this returns.
  link().changed.wait_for(lock, within, [] { return link().leaving; });
}

}  // namespace cohort::runtime

// The coordinator under an external launcher (CoordinatorServer, hosted by rank 0 or cohort
// launch's job host) and what each rank tells
// it of its collectives (activity_status): the sockets around the judgement of coordinator.cpp.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <iostream>
#include <mutex>
#include <set>
#include <thread>

#include "cohort/comm/process_group.h"
#include "cohort/error.h"
#include "cohort/runtime/coordinator.h"
#include "cohort/timeouts.h"
#include "comm/handshake.h"
#include "comm/socket.h"

namespace cohort::runtime {

using std::chrono::milliseconds;

Json activity_status() {
  Json groups = Json::array();
  for (const auto& g : comm::group_activity()) {
    Json group{
        {"name", g.name}, {"ranks", g.global_ranks}, {"entered", g.entered}, {"last", g.last}};
    if (!g.activity.empty()) group["activity"] = g.activity;
    groups.push_back(std::move(group));
  }
  return Json{{"groups", groups}};
}

// ---------------------------------------------------------------------------------------------
// CoordinatorServer

namespace {

// One line to a rank within kServerClientTimeout; a rank that does not take it (gone, or no
// longer reading) has its connection shut, so that the loop drops it and serves the others.
bool write_line(int fd, const std::string& line) {
  const std::string framed = line + "\n";
  if (comm::socket::send_before(fd, framed.data(), framed.size(),
                                std::chrono::steady_clock::now() + kServerClientTimeout) == 0) {
    return true;
  }
  ::shutdown(fd, SHUT_RDWR);
  return false;
}

}  // namespace

struct CoordinatorServer::Impl {
  CoordinatorServerOptions options;
  std::function<void(const Coordinator::Verdict&)> on_verdict;
  Coordinator coordinator;
  int listen_fd = -1;
  int wake[2] = {-1, -1};
  std::string address;
  std::mutex mutex;  // the coordinator, `finished`, `verdict`
  std::condition_variable judged;
  bool finished = false;
  std::optional<Coordinator::Verdict> stopped;  // the host's own (stop())
  std::optional<Coordinator::Verdict> verdict;
  std::thread thread;

  struct Connection {
    int fd;
    comm::ServerHandshake proof;  // nothing it sends is parsed before it proved the job secret
    int rank = -1;                // after its hello
    std::string in;
    bool left = false;  // said bye
  };

  Impl(CoordinatorServerOptions o, std::function<void(const Coordinator::Verdict&)> v,
       ClockSource clock)
      : options(std::move(o)),
        on_verdict(std::move(v)),
        coordinator(options.world_size, options.heartbeat, std::move(clock)) {}

  void listen() {
    sockaddr_in bind_to{};
    bind_to.sin_family = AF_INET;
    bind_to.sin_port = 0;
    if (::inet_pton(AF_INET, options.bind_address.c_str(), &bind_to.sin_addr) != 1) {
      throw UsageError("coordinator: '" + options.bind_address +
                       "' is not an IPv4 address of this host");
    }
    listen_fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (listen_fd < 0 ||
        ::bind(listen_fd, reinterpret_cast<sockaddr*>(&bind_to), sizeof bind_to) != 0 ||
        ::listen(listen_fd, SOMAXCONN) != 0 || ::pipe2(wake, O_CLOEXEC) != 0) {
      const std::string why = std::strerror(errno);
      if (listen_fd >= 0) ::close(listen_fd);
      throw RuntimeError("coordinator: cannot listen on " + options.bind_address + ": " + why);
    }
    sockaddr_in bound{};
    socklen_t length = sizeof bound;
    ::getsockname(listen_fd, reinterpret_cast<sockaddr*>(&bound), &length);
    address = options.bind_address + ":" + std::to_string(ntohs(bound.sin_port));
  }

  // Under `mutex`. A line that is no message of ours is named on stderr and dropped: it never
  // ends the coordinator's thread, and so the process.
  void take(int rank, const std::string& line) {
    try {
      const Json message = Json::parse(line);
      coordinator.on_message(rank, message);
      if (options.on_message) options.on_message(rank, message);
    } catch (const std::exception& e) {
      std::cerr << "coordinator: ignored a malformed message from rank " << rank << " (" << e.what()
                << "): " << line.substr(0, 200) << std::endl;
    }
  }

  // The first rank that connects: 1 when rank 0 is in this process.
  int first_remote_rank() const { return options.rank0_in_process ? 1 : 0; }

  // Why a first line is no hello of this run's ranks ({"rank": first_remote_rank() ..
  // world_size - 1, "token": this run's}), or empty for a hello that is.
  std::string refusal(const std::string& line, int& rank) const {
    int64_t claimed = -1;
    std::string token;
    try {
      const Json hello = Json::parse(line);
      claimed = json_field<int64_t>(hello, "rank", -1);
      token = json_field<std::string>(hello, "token", "");
    } catch (const std::exception& e) {
      return std::string("its first line is no hello of a rank (") + e.what() + ")";
    }
    if (claimed < first_remote_rank() || claimed >= options.world_size || token != options.token) {
      return "this coordinator serves run " + options.token + " of " +
             std::to_string(options.world_size) + " ranks, not rank " + std::to_string(claimed) +
             " of run " + token;
    }
    rank = static_cast<int>(claimed);
    return "";
  }

  // Under `mutex`: a verdict not acted on yet, else nullopt.
  std::optional<Coordinator::Verdict> new_verdict() {
    if (finished || verdict) return std::nullopt;
    verdict = stopped ? stopped : coordinator.verdict();
    if (verdict) judged.notify_all();
    return verdict;
  }

  void serve() {
    std::vector<Connection> connections;
    std::vector<int> lost_peers;  // this round's, that the others go on without
    auto beat_due = std::chrono::steady_clock::now();
    const auto interval = options.heartbeat.interval;
    const std::string beat = R"({"type":"beat"})";
    while (true) {
      std::vector<pollfd> fds{{wake[0], POLLIN, 0}, {listen_fd, POLLIN, 0}};
      for (const auto& c : connections) fds.push_back({c.fd, POLLIN, 0});
      const auto wait =
          std::chrono::duration_cast<milliseconds>(beat_due - std::chrono::steady_clock::now());
      // At least once a second: a connection that never proves the secret is closed in time.
      if (::poll(fds.data(), fds.size(),
                 static_cast<int>(std::clamp<int64_t>(wait.count(), 0, 1000))) < 0 &&
          errno != EINTR) {
        break;
      }
      if (fds[0].revents != 0) {
        // 0: the destructor's, to end; 1: stop()'s, acted on below.
        char byte = 0;
        if (::read(wake[0], &byte, 1) != 1 || byte == 0) break;
      }
      const size_t polled = connections.size();
      if (fds[1].revents & POLLIN) {
        while (true) {
          const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
          if (fd < 0) break;
          const int one = 1;
          ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
          connections.push_back({.fd = fd, .proof = comm::ServerHandshake(fd, options.secret)});
        }
      }
      std::set<int> dropped;
      const auto now = std::chrono::steady_clock::now();
      for (size_t i = 0; i < polled; ++i) {
        Connection& c = connections[i];
        if (!c.proof.proven()) {  // what it sends next is read once poll says it is there
          if (c.proof.poll_step(fds[i + 2].revents != 0, now) ==
              comm::ServerHandshake::State::kRefused) {
            std::cerr << "coordinator: closed " << c.proof.why() << std::endl;
            dropped.insert(c.fd);
          }
          continue;
        }
        if (fds[i + 2].revents == 0) continue;
        char buffer[16384];
        const ssize_t n = ::recv(c.fd, buffer, sizeof buffer, 0);
        if (n < 0 && errno == EINTR) continue;
        std::lock_guard lock(mutex);
        if (n <= 0) {
          dropped.insert(c.fd);
          const std::string how =
              "ended without finishing: its connection to the coordinator closed (the process "
              "died or was killed)";
          if (c.rank >= 0 && !c.left && !finished && options.live.go_on_without &&
              options.live.go_on_without(c.rank, how)) {
            coordinator.on_finished(c.rank);  // no longer expected to beat
            lost_peers.push_back(c.rank);
          } else if (c.rank >= 0 && !c.left && !finished) {
            coordinator.on_lost(c.rank, how);
          } else if (c.rank >= 0) {
            coordinator.on_finished(c.rank);
          }
          continue;
        }
        c.in.append(buffer, static_cast<size_t>(n));
        if (c.in.find('\n') == std::string::npos && c.in.size() > kMaxCoordinatorLine) {
          const std::string why = "sent a line of over " + std::to_string(kMaxCoordinatorLine) +
                                  " bytes to the coordinator: its connection was closed";
          std::cerr << "coordinator: "
                    << (c.rank >= 0 ? "rank " + std::to_string(c.rank)
                                    : std::string("a connection"))
                    << " " << why << std::endl;
          if (c.rank >= 0 && !c.left && !finished) coordinator.on_lost(c.rank, why);
          dropped.insert(c.fd);
          continue;
        }
        for (size_t end; (end = c.in.find('\n')) != std::string::npos;) {
          const std::string line = c.in.substr(0, end);
          c.in.erase(0, end + 1);
          if (c.rank < 0) {
            int rank = -1;
            if (const auto why = refusal(line, rank); !why.empty()) {
              std::cerr << "coordinator: refused a connection: " << why << std::endl;
              write_line(c.fd, Json{{"type", "refused"}, {"reason", why}}.dump());
              dropped.insert(c.fd);
              break;
            }
            c.rank = rank;
            take(rank, line);
            continue;
          }
          if (line == R"({"type":"bye"})") {
            c.left = true;
            coordinator.on_finished(c.rank);
            continue;
          }
          take(c.rank, line);
        }
      }
      std::erase_if(connections, [&](const Connection& c) {
        if (!dropped.count(c.fd)) return false;
        ::close(c.fd);
        return true;
      });
      // Live recovery: the others' collectives stop waiting for a lost rank.
      for (int lost : lost_peers) {
        const std::string told = Json{{"type", "peer_lost"}, {"rank", lost}}.dump();
        for (const auto& c : connections)
          if (c.proof.proven() && c.rank >= 0) write_line(c.fd, told);
      }
      lost_peers.clear();
      if (options.live.on_tick) options.live.on_tick();
      std::optional<Coordinator::Verdict> stop;
      {
        std::lock_guard lock(mutex);
        // Live recovery: a hung rank is ended by its host, and the others go on without it.
        if (options.live.end_hung && !finished && !verdict) {
          if (const auto hung = coordinator.verdict();
              hung && hung->silent && hung->rank >= first_remote_rank() &&
              options.live.end_hung(hung->rank, hung->reason)) {
            coordinator.on_ending_hung(hung->rank);
          }
        }
        stop = new_verdict();
      }
      if (stop) {
        const std::string abort = Json{{"type", "abort"}, {"reason", stop->reason}}.dump();
        for (const auto& c : connections) {
          if (c.proof.proven()) write_line(c.fd, abort);
        }
        if (on_verdict) on_verdict(*stop);
      }
      if (std::chrono::steady_clock::now() >= beat_due) {
        for (const auto& c : connections) {
          if (c.proof.proven()) write_line(c.fd, beat);
        }
        beat_due = std::chrono::steady_clock::now() + interval;
      }
    }
    for (const auto& c : connections) ::close(c.fd);
  }
};

CoordinatorServer::CoordinatorServer(CoordinatorServerOptions options,
                                     std::function<void(const Coordinator::Verdict&)> on_verdict,
                                     ClockSource clock)
    : impl_(std::make_unique<Impl>(std::move(options), std::move(on_verdict), std::move(clock))) {
  impl_->listen();
  impl_->thread = std::thread([impl = impl_.get()] { impl->serve(); });
}

CoordinatorServer::~CoordinatorServer() {
  const char byte = 0;
  if (::write(impl_->wake[1], &byte, 1) < 0) {
    // The thread ends at its next beat anyway.
  }
  if (impl_->thread.joinable()) impl_->thread.join();
  ::close(impl_->listen_fd);
  ::close(impl_->wake[0]);
  ::close(impl_->wake[1]);
}

std::string CoordinatorServer::address() const { return impl_->address; }

void CoordinatorServer::deliver(int rank, const std::string& line) {
  std::lock_guard lock(impl_->mutex);
  impl_->take(rank, line);
}

std::optional<Coordinator::Verdict> CoordinatorServer::await_verdict(milliseconds within) {
  std::unique_lock lock(impl_->mutex);
  impl_->judged.wait_for(lock, within, [&] { return impl_->verdict.has_value(); });
  return impl_->verdict;
}

void CoordinatorServer::finish() {
  std::lock_guard lock(impl_->mutex);
  impl_->finished = true;
}

void CoordinatorServer::stop(const std::string& reason) {
  {
    std::lock_guard lock(impl_->mutex);
    if (impl_->stopped) return;
    impl_->stopped = Coordinator::Verdict{.rank = -1, .reason = reason};
  }
  const char byte = 1;  // the server's thread acts on it at once
  if (::write(impl_->wake[1], &byte, 1) < 0) {
    // It acts on it at its next beat.
  }
}

bool CoordinatorServer::all_finished() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->coordinator.all_finished();
}

void CoordinatorServer::regrouped(const std::vector<int>& restarted) {
  std::lock_guard lock(impl_->mutex);
  impl_->coordinator.on_regrouped(restarted);
}

}  // namespace cohort::runtime

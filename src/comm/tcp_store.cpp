#include "comm/tcp_store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <iostream>
#include <map>
#include <unordered_map>

#include "cohort/error.h"
#include "cohort/limits.h"
#include "cohort/timeouts.h"
#include "comm/handshake.h"
#include "comm/socket.h"
#include "comm/store_frame.h"

namespace cohort::comm {
namespace {

using Clock = std::chrono::steady_clock;

std::string i64_field(int64_t v) { return std::string(reinterpret_cast<const char*>(&v), 8); }
int64_t i64_of(const std::string& field) {
  int64_t v = 0;
  if (field.size() == 8) std::memcpy(&v, field.data(), 8);
  return v;
}

// All of `data` within `timeout` (a client's request); false when the server is gone or did not
// take it in time.
bool send_all(int fd, const std::string& data, std::chrono::milliseconds timeout) {
  return socket::send_before(fd, data.data(), data.size(),
                             std::chrono::steady_clock::now() + timeout) == 0;
}

// The addresses `host` names (a numeric address or a resolvable name), IPv4 or IPv6.
std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> resolve(const std::string& host, int port,
                                                           bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  addrinfo* result = nullptr;
  const std::string service = std::to_string(port);
  const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &result);
  if (rc != 0) {
    throw UsageError("rendezvous address '" + host + "' does not resolve (" + gai_strerror(rc) +
                     "): give a host name or IP address this machine can reach");
  }
  return {result, &freeaddrinfo};
}

}  // namespace

TcpStoreServer::TcpStoreServer(const std::string& host, int port, std::string job_id,
                               JobSecret secret)
    : job_id_(std::move(job_id)), secret_(std::move(secret)) {
  const auto addresses = resolve(host, port, true);
  std::string last_error = "no address";
  for (addrinfo* a = addresses.get(); a != nullptr && listen_fd_ < 0; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, SOMAXCONN) == 0 &&
        ::fcntl(fd, F_SETFL, O_NONBLOCK) == 0) {
      listen_fd_ = fd;
    } else {
      last_error = std::strerror(errno);
      ::close(fd);
    }
  }
  if (listen_fd_ < 0) {
    throw RuntimeError("cannot serve the rendezvous store on " + host + ":" + std::to_string(port) +
                       ": " + last_error +
                       (last_error == std::strerror(EADDRINUSE)
                            ? " (another job uses this port: pick another "
                              "MASTER_PORT / --master port)"
                            : " (is " + host + " an address of this host?)"));
  }
  sockaddr_storage bound{};
  socklen_t length = sizeof bound;
  ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&bound), &length);
  port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                            : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  if (::pipe2(wake_, O_CLOEXEC) != 0) {
    ::close(listen_fd_);
    throw RuntimeError(std::string("store: pipe: ") + std::strerror(errno));
  }
  thread_ = std::thread([this] { serve(); });
}

TcpStoreServer::~TcpStoreServer() {
  const char byte = 0;
  if (::write(wake_[1], &byte, 1) < 0) {
    // The thread then ends at its next poll timeout; nothing else to do.
  }
  if (thread_.joinable()) thread_.join();
  ::close(listen_fd_);
  ::close(wake_[0]);
  ::close(wake_[1]);
}

void TcpStoreServer::serve() {
  struct Client {
    int fd;
    ServerHandshake proof;  // nothing it sends is parsed before it proved it holds the secret
    std::string in;
    bool greeted = false;
  };
  // A wait for several keys: it is filed under the first of them that is missing, so a set
  // looks only at the waits that key blocks (a barrier of n ranks costs O(n) lookups per key,
  // not O(n^2)).
  struct Waiter {
    int fd;
    uint64_t id;
    std::vector<std::string> keys;
    size_t next = 0;  // keys before it were seen set
  };
  std::map<std::string, std::string> data;
  int64_t bytes = 0;  // of keys and values in `data`
  std::vector<Client> clients;
  std::map<uint64_t, Waiter> waiters;  // by a serial number
  std::unordered_map<std::string, std::vector<uint64_t>> blocked_on;
  uint64_t next_waiter = 0;

  // Replies a client has not taken yet, by its socket: the server sends what the socket takes and
  // keeps the rest for when poll says there is room, so a client that stops reading stalls nobody.
  // Past kMaxStoreClientBacklog, or when its socket fails, the client is shut (its loop drops it).
  struct Outbox {
    std::string bytes;
    size_t sent = 0;
  };
  std::unordered_map<int, Outbox> outboxes;
  auto flush = [&](int fd) {
    auto it = outboxes.find(fd);
    if (it == outboxes.end()) return;
    Outbox& out = it->second;
    while (out.sent < out.bytes.size()) {
      const ssize_t n = ::send(fd, out.bytes.data() + out.sent, out.bytes.size() - out.sent,
                               MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        out.sent += static_cast<size_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      ::shutdown(fd, SHUT_RDWR);  // gone: its next poll reads the end
      outboxes.erase(it);
      return;
    }
    if (out.sent == out.bytes.size()) {
      outboxes.erase(it);
    } else if (out.sent > out.bytes.size() / 2) {
      out.bytes.erase(0, out.sent);
      out.sent = 0;
    }
  };
  auto reply = [&](int fd, uint64_t id, bool ok, std::vector<std::string> fields) {
    Outbox& out = outboxes[fd];
    out.bytes += encode_store_frame(
        {.id = id, .code = static_cast<uint8_t>(ok ? 0 : 1), .fields = std::move(fields)});
    if (out.bytes.size() - out.sent > kMaxStoreClientBacklog) {
      std::cerr << "cohort: the rendezvous store dropped a client that took none of its last "
                << (out.bytes.size() - out.sent) / (1 << 20) << " MiB of replies" << std::endl;
      ::shutdown(fd, SHUT_RDWR);
      outboxes.erase(fd);
      return;
    }
    flush(fd);
  };
  // Advances a wait past the keys that are set: replies and forgets it when none is left, else
  // files it under the next missing key.
  auto advance = [&](uint64_t serial) {
    Waiter& w = waiters.at(serial);
    while (w.next < w.keys.size() && data.count(w.keys[w.next])) ++w.next;
    if (w.next == w.keys.size()) {
      reply(w.fd, w.id, true, {});
      waiters.erase(serial);
    } else {
      blocked_on[w.keys[w.next]].push_back(serial);
    }
  };
  auto put = [&](const std::string& key, std::string value) {
    auto [it, inserted] = data.try_emplace(key);
    bytes +=
        static_cast<int64_t>(value.size()) -
        (inserted ? -static_cast<int64_t>(key.size()) : static_cast<int64_t>(it->second.size()));
    it->second = std::move(value);
    if (!inserted) return;
    auto blocked = blocked_on.find(key);
    if (blocked == blocked_on.end()) return;
    const auto serials = std::move(blocked->second);
    blocked_on.erase(blocked);
    for (uint64_t serial : serials) {
      if (waiters.count(serial)) advance(serial);  // else its client went away
    }
  };
  auto erase = [&](std::map<std::string, std::string>::iterator it) {
    bytes -= static_cast<int64_t>(it->first.size() + it->second.size());
    return data.erase(it);
  };
  // Returns false to drop the client.
  auto handle = [&](Client& c, const StoreFrame& f) {
    const auto& a = f.fields;
    auto arg = [&](size_t i) -> const std::string& {
      static const std::string empty;
      return i < a.size() ? a[i] : empty;
    };
    if (!c.greeted) {
      if (f.code != kHello) return false;
      if (arg(0) != job_id_) {
        reply(c.fd, f.id, false,
              {"this rendezvous store belongs to job '" + job_id_ + "', not to job '" + arg(0) +
               "': two jobs were given the same address; give each its own port"});
        return false;
      }
      c.greeted = true;
      reply(c.fd, f.id, true, {});
      return true;
    }
    switch (f.code) {
      case kSet:
        put(arg(0), arg(1));
        reply(c.fd, f.id, true, {});
        break;
      case kGet: {
        auto it = data.find(arg(0));
        if (it == data.end()) {
          reply(c.fd, f.id, false, {"key '" + arg(0) + "' is not set"});
        } else {
          reply(c.fd, f.id, true, {it->second});
        }
        break;
      }
      case kGetMany: {
        std::vector<std::string> values;
        values.reserve(a.size());
        for (const auto& key : a) {
          auto it = data.find(key);
          if (it == data.end()) {
            values = {"key '" + key + "' is not set"};
            break;
          }
          values.push_back(it->second);
        }
        const bool all = values.size() == a.size();
        reply(c.fd, f.id, all, std::move(values));
        break;
      }
      case kAdd: {
        auto it = data.find(arg(0));
        const int64_t value = (it == data.end() ? 0 : std::stoll(it->second)) + i64_of(arg(1));
        put(arg(0), std::to_string(value));
        reply(c.fd, f.id, true, {i64_field(value)});
        break;
      }
      case kCheck: {
        bool all = true;
        for (const auto& key : a) all = all && data.count(key);
        reply(c.fd, f.id, true, {all ? "1" : "0"});
        break;
      }
      case kWait: {
        const uint64_t serial = next_waiter++;
        waiters.emplace(serial, Waiter{.fd = c.fd, .id = f.id, .keys = a});
        advance(serial);
        break;
      }
      case kDelete: {
        auto it = data.find(arg(0));
        const bool found = it != data.end();
        if (found) erase(it);
        reply(c.fd, f.id, true, {found ? "1" : "0"});
        break;
      }
      case kDeletePrefix: {
        int64_t count = 0;
        for (auto it = data.lower_bound(arg(0));
             it != data.end() && it->first.compare(0, arg(0).size(), arg(0)) == 0; ++count) {
          it = erase(it);
        }
        reply(c.fd, f.id, true, {i64_field(count)});
        break;
      }
      case kNumKeys:
        reply(c.fd, f.id, true, {i64_field(static_cast<int64_t>(data.size()))});
        break;
      case kStats:
        reply(c.fd, f.id, true,
              {i64_field(static_cast<int64_t>(data.size())), i64_field(bytes),
               i64_field(static_cast<int64_t>(clients.size()))});
        break;
      case kCompareSet: {
        auto it = data.find(arg(0));
        if (it == data.end() ? arg(1).empty() : it->second == arg(1)) put(arg(0), arg(2));
        it = data.find(arg(0));
        reply(c.fd, f.id, true, {it != data.end() ? it->second : arg(1)});
        break;
      }
      default:
        reply(c.fd, f.id, false, {"unknown store operation " + std::to_string(f.code)});
    }
    return true;
  };

  std::vector<pollfd> fds;
  while (true) {
    fds.assign({{wake_[0], POLLIN, 0}, {listen_fd_, POLLIN, 0}});
    for (const auto& c : clients) {
      fds.push_back(
          {c.fd, static_cast<short>(POLLIN | (outboxes.count(c.fd) != 0 ? POLLOUT : 0)), 0});
    }
    if (::poll(fds.data(), fds.size(), 1000) < 0 && errno != EINTR) break;
    const auto now = Clock::now();
    if (fds[0].revents != 0) break;
    const size_t polled = clients.size();
    if (fds[1].revents & POLLIN) {
      // Every connection that is waiting (the listening socket does not block): a rendezvous of
      // many ranks connects all at once.
      while (true) {
        const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
        if (fd < 0) break;
        const int one = 1;
        ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        clients.push_back({fd, ServerHandshake(fd, secret_)});
      }
    }
    std::vector<int> dropped;
    for (size_t i = 0; i < polled; ++i) {
      Client& c = clients[i];
      if (!c.proof.proven()) {  // what it sends next is read once poll says it is there
        if (c.proof.poll_step(fds[i + 2].revents != 0, now) == ServerHandshake::State::kRefused) {
          std::cerr << "cohort: the rendezvous store closed " << c.proof.why() << std::endl;
          dropped.push_back(c.fd);
        }
        continue;
      }
      if (fds[i + 2].revents & POLLOUT) flush(c.fd);
      if ((fds[i + 2].revents & ~POLLOUT) == 0) continue;
      char buffer[65536];
      const ssize_t n = ::recv(c.fd, buffer, sizeof buffer, 0);
      if (n <= 0) {
        if (n < 0 && errno == EINTR) continue;
        dropped.push_back(c.fd);
        continue;
      }
      c.in.append(buffer, static_cast<size_t>(n));
      try {
        StoreFrame frame;
        while (decode_store_frame(c.in, frame)) {
          if (!handle(c, frame)) {
            dropped.push_back(c.fd);
            break;
          }
        }
      } catch (const std::exception&) {
        dropped.push_back(c.fd);  // not our protocol: a stray connection
      }
    }
    for (int fd : dropped) {
      outboxes.erase(fd);
      std::erase_if(waiters, [fd](const auto& w) { return w.second.fd == fd; });
      std::erase_if(clients, [fd](const Client& c) { return c.fd == fd; });
      ::close(fd);
    }
  }
  for (const auto& c : clients) ::close(c.fd);
}

struct TcpStoreClient::Reply {
  bool ok = false;
  std::vector<std::string> fields;
};

TcpStoreClient::TcpStoreClient(const std::string& host, int port, const std::string& job_id,
                               JobSecret secret, std::chrono::milliseconds timeout)
    : StoreClient(timeout), host_(host), port_(port), job_id_(job_id), secret_(std::move(secret)) {
  const auto deadline = Clock::now() + timeout;
  std::string last_error;
  while (fd_ < 0) {
    const auto addresses = resolve(host, port, false);
    for (addrinfo* a = addresses.get(); a != nullptr && fd_ < 0; a = a->ai_next) {
      const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) continue;
      if (const int error = socket::connect_before(fd, a->ai_addr, a->ai_addrlen, deadline);
          error == 0) {
        fd_ = fd;
      } else {
        last_error = std::strerror(error);
        ::close(fd);
      }
    }
    if (fd_ >= 0) break;
    if (Clock::now() >= deadline) {
      throw TimeoutError(
          "cannot reach the rendezvous " + where() + " within " + std::to_string(timeout.count()) +
          " ms (" + last_error +
          "): is the master (rank 0, or node 0's launcher) running, and is MASTER_ADDR/"
          "MASTER_PORT its address?");
    }
    ::poll(nullptr, 0, 50);  // the master may not listen yet
  }
  const int one = 1;
  ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  try {
    prove_secret(fd_, secret_, std::max(deadline, Clock::now() + std::chrono::seconds(1)),
                 "the rendezvous " + where());
  } catch (...) {
    ::close(fd_);
    fd_ = -1;
    throw;
  }
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  const auto hello = call(kHello, {job_id}, std::max(std::chrono::milliseconds(1000), left));
  if (!hello.ok)
    throw UsageError("rendezvous " + where() + ": " +
                     (hello.fields.empty() ? "refused" : hello.fields[0]));
}

TcpStoreClient::~TcpStoreClient() {
  if (fd_ >= 0) ::close(fd_);
}

std::string TcpStoreClient::where() const {
  return "store at " + host_ + ":" + std::to_string(port_);
}

TcpStoreClient::Reply TcpStoreClient::call(uint8_t op, const std::vector<std::string>& fields,
                                           std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(mutex_);
  const uint64_t id = next_id_++;
  if (fd_ < 0 ||
      !send_all(fd_, encode_store_frame({.id = id, .code = op, .fields = fields}), timeout)) {
    throw PeerFailureError("lost the rendezvous " + where() +
                           " (its process or host went away, or it took no request for " +
                           std::to_string(timeout.count()) + " ms)");
  }
  const auto deadline = Clock::now() + timeout;
  std::string& in = pending_;
  while (true) {
    StoreFrame frame;
    while (decode_store_frame(in, frame)) {
      // A reply to an earlier wait that timed out comes late: not ours.
      if (frame.id == id) {
        return Reply{.ok = frame.code == 0, .fields = std::move(frame.fields)};
      }
    }
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0)
      throw TimeoutError(where() + ": no answer within " + std::to_string(timeout.count()) + " ms");
    pollfd p{fd_, POLLIN, 0};
    const int ready = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left, 1000)));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) continue;
    char buffer[65536];
    const ssize_t n = ::recv(fd_, buffer, sizeof buffer, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      ::close(fd_);
      fd_ = -1;
      throw PeerFailureError("lost the rendezvous " + where() + " (its process or host went away)");
    }
    in.append(buffer, static_cast<size_t>(n));
  }
}

void TcpStoreClient::set(const std::string& key, const std::vector<uint8_t>& value) {
  call(kSet, {key, std::string(value.begin(), value.end())}, timeout_);
}

std::vector<uint8_t> TcpStoreClient::compareSet(const std::string& key,
                                                const std::vector<uint8_t>& expected,
                                                const std::vector<uint8_t>& desired) {
  auto r = call(kCompareSet,
                {key, std::string(expected.begin(), expected.end()),
                 std::string(desired.begin(), desired.end())},
                timeout_);
  return {r.fields.at(0).begin(), r.fields.at(0).end()};
}

std::vector<uint8_t> TcpStoreClient::get(const std::string& key) {
  wait({key}, timeout_);
  const auto value = get_present(key);
  return {value.begin(), value.end()};
}

std::string TcpStoreClient::get_present(const std::string& key) {
  auto r = call(kGet, {key}, timeout_);
  if (!r.ok) throw RuntimeError(where() + ": " + r.fields.at(0));
  return r.fields.at(0);
}

std::vector<std::string> TcpStoreClient::get_many(const std::vector<std::string>& keys) {
  auto r = call(kGetMany, keys, timeout_);
  if (!r.ok) throw RuntimeError(where() + ": " + r.fields.at(0));
  return std::move(r.fields);
}

int64_t TcpStoreClient::delete_prefix(const std::string& prefix) {
  return i64_of(call(kDeletePrefix, {prefix}, timeout_).fields.at(0));
}

std::vector<int64_t> TcpStoreClient::stats() {
  const auto r = call(kStats, {}, timeout_);
  std::vector<int64_t> values;
  for (const auto& field : r.fields) values.push_back(i64_of(field));
  return values;
}

int64_t TcpStoreClient::add(const std::string& key, int64_t value) {
  return i64_of(call(kAdd, {key, i64_field(value)}, timeout_).fields.at(0));
}

bool TcpStoreClient::deleteKey(const std::string& key) {
  return call(kDelete, {key}, timeout_).fields.at(0) == "1";
}

bool TcpStoreClient::check(const std::vector<std::string>& keys) {
  return call(kCheck, keys, timeout_).fields.at(0) == "1";
}

int64_t TcpStoreClient::getNumKeys() { return i64_of(call(kNumKeys, {}, timeout_).fields.at(0)); }

void TcpStoreClient::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void TcpStoreClient::wait(const std::vector<std::string>& keys,
                          const std::chrono::milliseconds& timeout) {
  call(kWait, keys, timeout);
}

c10::intrusive_ptr<c10d::Store> TcpStoreClient::clone() {
  return c10::make_intrusive<TcpStoreClient>(host_, port_, job_id_, secret_, timeout_);
}

}  // namespace cohort::comm

#include "comm/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>

#include "cohort/comm/address.h"

namespace cohort::comm::socket {
namespace {

std::string errno_text() { return std::strerror(errno); }

// Milliseconds from now until `deadline`, 0 once it passed (a poll timeout).
int ms_until(std::chrono::steady_clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                        deadline - std::chrono::steady_clock::now())
                        .count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, 1 << 30));
}

sockaddr_un unix_address(const std::string& name, socklen_t& length) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  // Abstract namespace: no file to clean up, gone with the socket.
  addr.sun_path[0] = '\0';
  std::memcpy(addr.sun_path + 1, name.data(), std::min(name.size(), sizeof addr.sun_path - 2));
  length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 +
                                  std::min(name.size(), sizeof addr.sun_path - 2));
  return addr;
}

sockaddr_in ipv4_address(const std::string& address, const std::string& host, int port) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (::inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1)
    throw UsageError("address '" + address + "': '" + host + "' is not an IPv4 address");
  return addr;
}

}  // namespace

void wait_readable(int fd, std::chrono::milliseconds timeout, const std::string& peer) {
  pollfd p{fd, POLLIN, 0};
  int rc;
  do {
    rc = ::poll(&p, 1, static_cast<int>(timeout.count()));
  } while (rc < 0 && errno == EINTR);
  if (rc == 0)
    throw TimeoutError("a message from " + peer + " did not arrive whole within " +
                       std::to_string(timeout.count()) + " ms");
}

int send_before(int fd, const void* data, size_t bytes,
                std::chrono::steady_clock::time_point deadline) {
  const auto* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::send(fd, p, bytes, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      // The peer's window is full: wait for room, until the deadline.
      const int left = ms_until(deadline);
      if (left == 0) return ETIMEDOUT;
      pollfd w{fd, POLLOUT, 0};
      if (::poll(&w, 1, left) < 0 && errno != EINTR) return errno;
      continue;
    }
    if (n < 0) return errno;
    if (n == 0) return EIO;
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return 0;
}

void write_all(int fd, const void* data, size_t bytes, const std::string& peer,
               std::chrono::milliseconds timeout) {
  const int error = send_before(fd, data, bytes, std::chrono::steady_clock::now() + timeout);
  if (error == 0) return;
  if (error == EPIPE || error == ECONNRESET) throw PeerGone(peer + " closed its connection");
  if (error == ETIMEDOUT) {
    throw TimeoutError(peer + " took no data for " + std::to_string(timeout.count()) +
                       " ms: it stopped reading");
  }
  throw RuntimeError("sending to " + peer + " failed: " + std::strerror(error));
}

void read_all(int fd, void* data, size_t bytes, std::chrono::milliseconds timeout,
              const std::string& peer) {
  auto* p = static_cast<char*>(data);
  while (bytes > 0) {
    wait_readable(fd, timeout, peer);
    const ssize_t n = ::recv(fd, p, bytes, 0);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n <= 0) throw RuntimeError(peer + " closed its connection in the middle of a message");
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

int connect_before(int fd, const sockaddr* address, socklen_t length,
                   std::chrono::steady_clock::time_point deadline) {
  const auto left_ms = [&] { return ms_until(deadline); };
  const int flags = ::fcntl(fd, F_GETFL);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  int error = 0;
  while (true) {
    if (::connect(fd, address, length) == 0) {
      error = 0;
      break;
    }
    error = errno;
    if (error == EAGAIN && left_ms() > 0) {  // a Unix socket's full backlog: try again
      ::poll(nullptr, 0, std::min(10, left_ms()));
      continue;
    }
    if (error != EINPROGRESS && error != EINTR) break;
    // In progress: writable once connected or refused; the deadline first is ETIMEDOUT.
    error = ETIMEDOUT;
    while (left_ms() > 0) {
      pollfd p{fd, POLLOUT, 0};
      const int rc = ::poll(&p, 1, left_ms());
      if (rc < 0 && errno == EINTR) continue;
      if (rc < 0) {
        error = errno;
      } else if (rc > 0) {
        socklen_t size = sizeof error;
        if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &size) != 0) error = errno;
      }
      break;
    }
    break;
  }
  ::fcntl(fd, F_SETFL, flags);
  return error;
}

int connect_to(const std::string& address, std::chrono::milliseconds timeout,
               const std::string& peer, const std::string& hint) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  if (address.rfind("unix:", 0) == 0) {
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    socklen_t length = 0;
    auto addr = unix_address(address.substr(5), length);
    if (const int error =
            connect_before(fd, reinterpret_cast<sockaddr*>(&addr), length, deadline)) {
      ::close(fd);
      throw PeerGone("cannot connect to " + peer + " at " + address + ": " + std::strerror(error));
    }
    return fd;
  }
  const auto [host, port] = parse_host_port(address);
  const auto addr = ipv4_address(address, host, port);
  std::string why;
  while (std::chrono::steady_clock::now() < deadline) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const int error =
        connect_before(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr, deadline);
    if (error == 0) {
      int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      return fd;
    }
    why = std::strerror(error);
    ::close(fd);
    ::poll(nullptr, 0, 100);
  }
  throw TimeoutError("cannot connect to " + peer + " at " + address + " within " +
                     std::to_string(timeout.count()) + " ms: " + why + hint);
}

int listen_on(const std::string& address, std::string& bound, const std::string& what) {
  if (address.rfind("unix:", 0) == 0) {
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    socklen_t length = 0;
    auto addr = unix_address(address.substr(5), length);
    if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), length) != 0 || ::listen(fd, 64) != 0) {
      const auto why = errno_text();
      ::close(fd);
      throw RuntimeError("cannot listen for " + what + " on " + address + ": " + why);
    }
    bound = address;
    return fd;
  }
  const auto [host, port] = parse_host_port(address);
  auto addr = ipv4_address(address, host, port);
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(fd, 64) != 0) {
    const int error = errno;
    const auto why = errno_text();
    ::close(fd);
    throw UsageError(
        "cannot listen for " + what + " on " + address + ": " + why +
        (error == EADDRINUSE ? " (the port is taken: pick another, or 0 for any)" : ""));
  }
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  bound = host + ":" + std::to_string(ntohs(addr.sin_port));
  return fd;
}

}  // namespace cohort::comm::socket

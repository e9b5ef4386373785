// Stream sockets with deadlines (private to src/): what the preprocessing service and the
// parameter servers send their messages over. `peer` names the other end in messages ("a
// preprocessing peer", "parameter server 1"), so an error says who went away.
#pragma once
#include <sys/socket.h>

#include <chrono>
#include <cstddef>
#include <string>

#include "cohort/error.h"

namespace cohort::comm::socket {

// The other end closed its connection (or was never there).
struct PeerGone : RuntimeError {
  using RuntimeError::RuntimeError;
};

// Blocks until `fd` is readable; TimeoutError naming `peer` when `timeout` passes first.
void wait_readable(int fd, std::chrono::milliseconds timeout, const std::string& peer);
// Sends every byte before `deadline` without ever blocking past it: 0 when sent, else the errno
// (ETIMEDOUT when the peer did not take them in time, EPIPE or ECONNRESET when it closed).
int send_before(int fd, const void* data, size_t bytes,
                std::chrono::steady_clock::time_point deadline);
// Writes every byte within `timeout`; PeerGone when the peer closed, TimeoutError naming `peer`
// when it stopped reading, RuntimeError on another failure.
void write_all(int fd, const void* data, size_t bytes, const std::string& peer,
               std::chrono::milliseconds timeout);
// Reads exactly `bytes`, each chunk within `timeout`; RuntimeError when the peer closes midway.
void read_all(int fd, void* data, size_t bytes, std::chrono::milliseconds timeout,
              const std::string& peer);

// connect(2) that gives up at `deadline`: the socket connects without blocking and is waited on
// with poll, so a peer whose listen queue is full (or a host that drops the SYN) cannot hold the
// caller past it. 0 when connected, else the errno (ETIMEDOUT when the deadline passed first; a
// full Unix-socket backlog is retried until then). `fd` blocks again afterwards.
int connect_before(int fd, const sockaddr* address, socklen_t length,
                   std::chrono::steady_clock::time_point deadline);

// "unix:<name>" (abstract socket) or "host:port" (IPv4). Returns a connected socket (TCP_NODELAY),
// retrying a TCP connect until `timeout`; PeerGone (unix) or TimeoutError (TCP) naming `peer`,
// the address and `hint`.
int connect_to(const std::string& address, std::chrono::milliseconds timeout,
               const std::string& peer, const std::string& hint = "");
// Listens on `address` as above (a port of 0 picks one); `bound` gets the address bound.
// UsageError naming `what` ("preprocessing workers") when the address cannot be taken.
int listen_on(const std::string& address, std::string& bound, const std::string& what);

}  // namespace cohort::comm::socket

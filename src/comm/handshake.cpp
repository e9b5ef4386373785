#include "comm/handshake.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <openssl/crypto.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "comm/socket.h"

namespace cohort::comm {
namespace {

using Clock = std::chrono::steady_clock;

// Names the protocol and its version: a peer that sends anything else is no cohort server of
// this version (or no cohort server at all).
constexpr std::string_view kMagic{"cohort1\n", 8};

std::string random_nonce() {
  // The generated secret's 32 random bytes serve as a nonce as well (hex: 64 characters, of
  // which the first 32 are used).
  return JobSecret::generate().text().substr(0, 32);
}

std::string proof(const JobSecret& secret, std::string_view who, const std::string& server_nonce,
                  const std::string& client_nonce) {
  std::string message(who);
  message += server_nonce;
  message += client_nonce;
  const auto mac = secret.mac(message);
  return std::string(reinterpret_cast<const char*>(mac.data()), mac.size());
}

// Exactly `bytes` from `fd` before `deadline`; false when the peer closed first.
bool read_before(int fd, std::string& out, size_t bytes, Clock::time_point deadline,
                 const std::string& server) {
  out.clear();
  while (out.size() < bytes) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    pollfd p{fd, POLLIN, 0};
    const int rc =
        left <= 0 ? 0 : ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left, 1 << 30)));
    if (rc < 0 && errno == EINTR) continue;
    if (rc == 0) {
      throw TimeoutError(server + " did not complete the job secret's handshake in time");
    }
    char buffer[kClientProofBytes];
    const ssize_t n = ::recv(fd, buffer, std::min(sizeof buffer, bytes - out.size()), 0);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n <= 0) return false;
    out.append(buffer, static_cast<size_t>(n));
  }
  return true;
}

}  // namespace

bool constant_time_equal(const std::string& a, const std::string& b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

std::string peer_address(int fd) {
  sockaddr_storage address{};
  socklen_t length = sizeof address;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0)
    return "an unknown peer";
  char text[INET6_ADDRSTRLEN] = {};
  if (address.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&address);
    ::inet_ntop(AF_INET, &a->sin_addr, text, sizeof text);
    return std::string(text) + ":" + std::to_string(ntohs(a->sin_port));
  }
  if (address.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&address);
    ::inet_ntop(AF_INET6, &a->sin6_addr, text, sizeof text);
    return "[" + std::string(text) + "]:" + std::to_string(ntohs(a->sin6_port));
  }
  return "a local socket";
}

ServerHandshake::ServerHandshake(int fd, JobSecret secret, std::chrono::milliseconds within)
    : fd_(fd),
      secret_(std::move(secret)),
      nonce_(random_nonce()),
      deadline_(Clock::now() + within) {
  std::string challenge(kMagic);
  challenge += nonce_;
  // A socket just accepted has an empty send buffer: 40 bytes go at once or the peer is gone.
  if (socket::send_before(fd, challenge.data(), challenge.size(), Clock::now()) != 0) {
    refuse("closed before it was challenged");
  }
}

ServerHandshake::State ServerHandshake::refuse(const std::string& what) {
  state_ = State::kRefused;
  why_ = "a connection from " + peer_address(fd_) + ": it " + what;
  return state_;
}

ServerHandshake::State ServerHandshake::advance() {
  if (state_ != State::kPending) return state_;
  if (Clock::now() >= deadline_) return refuse("did not prove it holds the job secret in time");
  char buffer[kClientProofBytes];
  const ssize_t n = ::recv(fd_, buffer, kClientProofBytes - received_.size(), MSG_DONTWAIT);
  if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) return state_;
  if (n <= 0) return refuse("closed before it proved it holds the job secret");
  received_.append(buffer, static_cast<size_t>(n));
  if (received_.size() < kClientProofBytes) return state_;
  const std::string client_nonce = received_.substr(0, 32);
  if (!constant_time_equal(received_.substr(32), proof(secret_, "client", nonce_, client_nonce))) {
    return refuse("did not prove it holds the job secret (a wrong proof)");
  }
  const std::string reply = proof(secret_, "server", nonce_, client_nonce);
  if (socket::send_before(fd_, reply.data(), reply.size(), Clock::now() + kServerClientTimeout) !=
      0) {
    return refuse("did not take the server's proof");
  }
  state_ = State::kProven;
  return state_;
}

void prove_secret(int fd, const JobSecret& secret, Clock::time_point deadline,
                  const std::string& server) {
  std::string challenge;
  if (!read_before(fd, challenge, kChallengeBytes, deadline, server)) {
    throw RuntimeError(server + " closed the connection before its job secret challenge");
  }
  if (challenge.compare(0, kMagic.size(), kMagic) != 0) {
    throw RuntimeError(
        server +
        " is no cohort server of this version (its first bytes are no job secret "
        "challenge): is the address right, and is the same build deployed everywhere?");
  }
  const std::string server_nonce = challenge.substr(kMagic.size());
  const std::string client_nonce = random_nonce();
  const std::string answer = client_nonce + proof(secret, "client", server_nonce, client_nonce);
  if (socket::send_before(fd, answer.data(), answer.size(), deadline) != 0) {
    throw RuntimeError(server + " closed the connection during the job secret's handshake");
  }
  const std::string hint =
      ": the processes of one job must share one secret (COHORT_JOB_SECRET or "
      "COHORT_JOB_SECRET_FILE, the same on every node)";
  std::string reply;
  if (!read_before(fd, reply, kServerProofBytes, deadline, server)) {
    throw SecretRefused(server + " refused this process's proof of the job secret" + hint);
  }
  if (!constant_time_equal(reply, proof(secret, "server", server_nonce, client_nonce))) {
    throw SecretRefused(server + " could not prove it holds the job secret" + hint);
  }
}

}  // namespace cohort::comm

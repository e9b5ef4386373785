// The job secret's challenge and response (private to src/): the first bytes of every connection
// between a job's processes. The server sends a magic and a fresh nonce; the client answers with
// its own nonce and HMAC(secret, "client" | both nonces); the server checks it and answers with
// HMAC(secret, "server" | both nonces), which the client checks. So each end knows the other
// holds the secret, the secret never travels, and a recorded exchange cannot be replayed.
// Servers poll many connections from one thread: ServerHandshake never blocks.
#pragma once
#include <chrono>
#include <string>

#include "cohort/comm/job_secret.h"
#include "cohort/error.h"
#include "cohort/timeouts.h"

namespace cohort::comm {

/// The server refused this process's proof of the job secret, or the server could not prove it
/// holds the secret: the two were given different secrets (or are different jobs).
struct SecretRefused : UsageError {
  using UsageError::UsageError;
};

/// Bytes of each step: the challenge (magic and nonce), the client's proof, the server's.
inline constexpr size_t kChallengeBytes = 40;
inline constexpr size_t kClientProofBytes = 64;
inline constexpr size_t kServerProofBytes = 32;

/// The server's side of one connection, from accept to proof.
class ServerHandshake {
 public:
  enum class State { kPending, kProven, kRefused };

  /// No connection (a placeholder until a connection is accepted).
  ServerHandshake() = default;
  /// Sends the challenge on `fd`, a connection just accepted (a new socket's buffer takes it at
  /// once; if it cannot, the handshake is refused). The client must prove itself within `within`.
  ServerHandshake(int fd, JobSecret secret, std::chrono::milliseconds within = kHandshakeTimeout);

  /// Reads what arrived of the client's proof, without blocking and without reading past it
  /// (what the client sends next stays in the socket for the server). kProven once it is right
  /// and the server's own proof is sent; kRefused (see why()) when it is wrong, the client closed,
  /// or its deadline passed.
  State advance();
  /// For a server's poll loop: advances when its connection polled `readable` or its deadline
  /// passed (then it is refused), else leaves it be. What advance() returns.
  State poll_step(bool readable, std::chrono::steady_clock::time_point now) {
    return state_ == State::kPending && (readable || now >= deadline_) ? advance() : state_;
  }
  /// kProven once the client proved itself.
  bool proven() const { return state_ == State::kProven; }
  /// Why the connection was refused, with the peer's address ("a connection from 10.0.0.7:4242:
  /// it did not prove it holds the job secret in time").
  const std::string& why() const { return why_; }

 private:
  State refuse(const std::string& what);
  int fd_ = -1;
  JobSecret secret_;
  std::string nonce_;
  std::string received_;
  std::chrono::steady_clock::time_point deadline_;
  State state_ = State::kPending;
  std::string why_;
};

/// The client's side, blocking until `deadline`: reads the challenge on `fd`, proves this process
/// holds `secret` and checks the server's proof. `server` names the other end in errors
/// ("the rendezvous store at 10.0.0.1:29500"). SecretRefused when either proof fails,
/// TimeoutError past the deadline, RuntimeError when the server is no cohort server or closes.
void prove_secret(int fd, const JobSecret& secret, std::chrono::steady_clock::time_point deadline,
                  const std::string& server);

/// Whether `a` equals `b`, in a time that does not tell how much of them matched (for comparing
/// a secret or token a peer sent).
bool constant_time_equal(const std::string& a, const std::string& b);

/// "10.0.0.7:4242", "[::1]:4242" or "a local socket": who is at the other end of `fd`, for logs.
std::string peer_address(int fd);

}  // namespace cohort::comm

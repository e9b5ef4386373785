// Fuzz target: the job secret's handshake (src/comm/handshake.h) with a peer that sends anything.
// The first byte picks the side under test: even, the server reads the input as a client's proof;
// odd, a client reads it as a server's challenge and proof. Neither may crash, block past its
// deadline or take a proof that is not one.
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>

#include "comm/handshake.h"

namespace {

const cohort::comm::JobSecret& secret() {
  static const auto s = cohort::comm::JobSecret::from_text("the fuzzed job's secret", "fuzz");
  return s;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0 || size > 4096) return 0;  // more than a socket pair's buffer takes at once
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) std::abort();
  const bool server_side = data[0] % 2 == 0;
  if (server_side) {
    cohort::comm::ServerHandshake server(fds[0], secret(), std::chrono::milliseconds(50));
    if (::send(fds[1], data + 1, size - 1, MSG_NOSIGNAL) < 0) std::abort();
    ::shutdown(fds[1], SHUT_WR);
    auto state = server.advance();
    for (int i = 0; i < 100 && state == cohort::comm::ServerHandshake::State::kPending; ++i)
      state = server.advance();
    // 64 bytes of a random input are never the HMAC of this secret.
    if (state == cohort::comm::ServerHandshake::State::kProven) std::abort();
  } else {
    if (::send(fds[1], data + 1, size - 1, MSG_NOSIGNAL) < 0) std::abort();
    ::shutdown(fds[1], SHUT_WR);
    try {
      cohort::comm::prove_secret(fds[0], secret(),
                                 std::chrono::steady_clock::now() + std::chrono::milliseconds(50),
                                 "the fuzzed server");
      std::abort();  // a random server proved the secret
    } catch (const std::exception&) {
      // Refused, not a cohort server, or closed: the client names it and goes no further.
    }
  }
  ::close(fds[0]);
  ::close(fds[1]);
  return 0;
}

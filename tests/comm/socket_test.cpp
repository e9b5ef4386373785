// Connects end at their deadline: a listener whose queue is full (the kernel then drops the SYN,
// and a blocking connect(2) waits for minutes) holds no client past the caller's timeout.
#include "comm/socket.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <vector>

#include "cohort/comm/store.h"
#include "cohort/error.h"
#include "support/expect.h"

namespace cohort::comm {
namespace {

using Clock = std::chrono::steady_clock;

// A loopback listener that never accepts, its queue filled by connections of its own: a further
// connect gets no answer. Closes everything when it ends.
class FullListener {
 public:
  FullListener() {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof addr;
    if (::bind(fd_, reinterpret_cast<sockaddr*>(&addr), length) != 0 || ::listen(fd_, 0) != 0 ||
        ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &length) != 0) {
      throw RuntimeError("cannot listen on loopback for the test");
    }
    port_ = ntohs(addr.sin_port);
    // Fill the queue: connections until one is left waiting (at most a few are taken).
    for (int i = 0; i < 16; ++i) {
      const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      fillers_.push_back(fd);
      const int error = socket::connect_before(fd, reinterpret_cast<sockaddr*>(&addr), length,
                                               Clock::now() + std::chrono::milliseconds(300));
      if (error == ETIMEDOUT) return;
    }
    throw RuntimeError("the listener's queue did not fill: the test cannot make a connect hang");
  }
  ~FullListener() {
    for (int fd : fillers_) ::close(fd);
    ::close(fd_);
  }
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
  std::vector<int> fillers_;
};

TEST(Socket, AConnectToAListenerThatNeverAnswersEndsAtItsDeadline) {
  FullListener listener;
  const auto address = "127.0.0.1:" + std::to_string(listener.port());
  const auto started = Clock::now();
  cohort::testing::expect_error<TimeoutError>(
      [&] { socket::connect_to(address, std::chrono::milliseconds(400), "a test peer"); },
      "cannot connect to a test peer at " + address + " within 400 ms");
  // Well before a blocking connect(2) would give up (its SYN retries take minutes).
  EXPECT_LT(Clock::now() - started, std::chrono::seconds(20));
}

TEST(Socket, TheStoresClientEndsAtItsDeadlineToo) {
  FullListener listener;
  const auto started = Clock::now();
  cohort::testing::expect_error<TimeoutError>(
      [&] {
        Store::connect({.host = "127.0.0.1",
                        .port = listener.port(),
                        .is_server = false,
                        .timeout = std::chrono::milliseconds(400)});
      },
      "cannot reach the rendezvous store at 127.0.0.1:" + std::to_string(listener.port()) +
          " within 400 ms");
  EXPECT_LT(Clock::now() - started, std::chrono::seconds(20));
}

TEST(Socket, AConnectionRefusedIsNamedAtOnce) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t length = sizeof addr;
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), length), 0);
  ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &length), 0);
  ::close(fd);  // bound, never listening: a connect is refused
  const int client = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  EXPECT_EQ(socket::connect_before(client, reinterpret_cast<sockaddr*>(&addr), length,
                                   Clock::now() + std::chrono::seconds(10)),
            ECONNREFUSED);
  ::close(client);
}

// A peer that stops reading holds a writer no longer than its timeout: the data it did not take
// is named, and the writer is free for its other peers.
TEST(Socket, AWriteToAPeerThatStopsReadingEndsAtItsDeadline) {
  int pair[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair), 0);
  const std::vector<char> chunk(1 << 20, 'x');  // more than both socket buffers hold, in the end
  const auto started = Clock::now();
  cohort::testing::expect_error<TimeoutError>(
      [&] {
        for (int i = 0; i < 64; ++i)
          socket::write_all(pair[0], chunk.data(), chunk.size(), "a stalled peer",
                            std::chrono::milliseconds(300));
      },
      "a stalled peer took no data for 300 ms: it stopped reading");
  EXPECT_LT(Clock::now() - started, std::chrono::seconds(20));
  EXPECT_EQ(socket::send_before(pair[0], chunk.data(), chunk.size(),
                                Clock::now() + std::chrono::milliseconds(100)),
            ETIMEDOUT);
  ::close(pair[1]);
  cohort::testing::expect_error<socket::PeerGone>(
      [&] {
        socket::write_all(pair[0], chunk.data(), chunk.size(), "a closed peer",
                          std::chrono::milliseconds(300));
      },
      "a closed peer closed its connection");
  ::close(pair[0]);
}

}  // namespace
}  // namespace cohort::comm

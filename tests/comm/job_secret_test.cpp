// The job secret and its handshake: the HMAC is the real HMAC-SHA256; a file is taken only when
// private; each end of a handshake finds out whether the other holds the same secret, without the
// secret travelling, and the server never reads past the proof or waits past its deadline.
#include "cohort/comm/job_secret.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "comm/handshake.h"
#include "support/expect.h"

namespace cohort::comm {
namespace {

using Clock = std::chrono::steady_clock;

std::string hex(const std::array<uint8_t, 32>& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (uint8_t b : bytes) {
    out += digits[b >> 4];
    out += digits[b & 15];
  }
  return out;
}

// A connected pair of stream sockets, closed at the end.
struct SocketPair {
  int server = -1;
  int client = -1;
  SocketPair() {
    int fds[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
    server = fds[0];
    client = fds[1];
  }
  ~SocketPair() {
    if (server >= 0) ::close(server);
    if (client >= 0) ::close(client);
  }
};

// Runs the server's side on `fds.server` until it is decided (or 10 s pass).
ServerHandshake::State serve(ServerHandshake& handshake) {
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  auto state = handshake.advance();
  while (state == ServerHandshake::State::kPending && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));  // polls a non-blocking socket
    state = handshake.advance();
  }
  return state;
}

JobSecret secret(const std::string& text) { return JobSecret::from_text(text, "test"); }

TEST(JobSecret, ItsMacIsHmacSha256) {
  // RFC 4231, test case 2 needs a 4-byte key; case 1's 20 bytes of 0x0b pass the length rule.
  const auto key = JobSecret::from_text(std::string(20, '\x0b'), "test");
  EXPECT_EQ(hex(key.mac("Hi There")),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
}

TEST(JobSecret, GeneratedSecretsAreLongAndDiffer) {
  const auto a = JobSecret::generate();
  const auto b = JobSecret::generate();
  EXPECT_EQ(a.text().size(), 64u);
  EXPECT_NE(a.text(), b.text());
  EXPECT_FALSE(a.empty());
}

TEST(JobSecret, AShortSecretIsRefusedNamingItsSource) {
  cohort::testing::expect_error<UsageError>(
      [] { JobSecret::from_text("short", "COHORT_JOB_SECRET"); },
      "COHORT_JOB_SECRET holds a secret of 5 bytes; a job secret needs at least 16");
}

TEST(JobSecret, AFileIsTakenOnlyWhenPrivateAndNotEmpty) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("cohort_job_secret_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "secret").string();
  const auto written = JobSecret::generate();
  written.write_file(path);
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(JobSecret::read_file(path).text(), written.text());

  ::chmod(path.c_str(), 0644);
  cohort::testing::expect_error<UsageError>([&] { JobSecret::read_file(path); },
                                            "has mode 0644: others could read it; make it "
                                            "private with: chmod 600 " +
                                                path);
  ::chmod(path.c_str(), 0600);
  { std::ofstream(path, std::ios::trunc) << "\n"; }
  cohort::testing::expect_error<UsageError>([&] { JobSecret::read_file(path); }, "is empty");
  cohort::testing::expect_error<UsageError>([&] { JobSecret::read_file(path + "-missing"); },
                                            "job secret file " + path + "-missing");
  std::filesystem::remove_all(dir);
}

TEST(Handshake, BothEndsOfOneSecretAreProvenAndTheServerReadsNoFurther) {
  SocketPair pair;
  ServerHandshake server(pair.server, secret("one job's secret!"));
  std::thread client([&] {
    prove_secret(pair.client, secret("one job's secret!"), Clock::now() + std::chrono::seconds(10),
                 "the server");
    ASSERT_EQ(::send(pair.client, "next", 4, MSG_NOSIGNAL), 4);  // the protocol's first bytes
  });
  EXPECT_EQ(serve(server), ServerHandshake::State::kProven) << server.why();
  client.join();
  char after[4];
  ASSERT_EQ(::recv(pair.server, after, sizeof after, MSG_WAITALL), 4);
  EXPECT_EQ(std::string(after, 4), "next");
}

TEST(Handshake, AnotherSecretIsRefusedOnBothSides) {
  SocketPair pair;
  ServerHandshake server(pair.server, secret("one job's secret!"));
  std::thread client([&] {
    cohort::testing::expect_error<SecretRefused>(
        [&] {
          prove_secret(pair.client, secret("another job's secret"),
                       Clock::now() + std::chrono::seconds(10), "the server");
        },
        "the server refused this process's proof of the job secret");
  });
  EXPECT_EQ(serve(server), ServerHandshake::State::kRefused);
  EXPECT_NE(server.why().find("did not prove it holds the job secret (a wrong proof)"),
            std::string::npos)
      << server.why();
  ::shutdown(pair.server, SHUT_RDWR);  // what a server does with a refused connection
  client.join();
}

TEST(Handshake, AServerWithoutTheSecretIsFoundOut) {
  SocketPair pair;
  std::thread impostor([&] {
    // A challenge of the right shape, then a reply that proves nothing.
    const std::string challenge = std::string("cohort1\n") + std::string(32, 'n');
    ::send(pair.server, challenge.data(), challenge.size(), MSG_NOSIGNAL);
    char proof[kClientProofBytes];
    ::recv(pair.server, proof, sizeof proof, MSG_WAITALL);
    const std::string reply(kServerProofBytes, 'r');
    ::send(pair.server, reply.data(), reply.size(), MSG_NOSIGNAL);
  });
  cohort::testing::expect_error<SecretRefused>(
      [&] {
        prove_secret(pair.client, secret("one job's secret!"),
                     Clock::now() + std::chrono::seconds(10), "the server");
      },
      "the server could not prove it holds the job secret");
  impostor.join();
}

TEST(Handshake, AClientThatSaysNothingIsRefusedAtItsDeadline) {
  SocketPair pair;
  ServerHandshake server(pair.server, secret("one job's secret!"), std::chrono::milliseconds(0));
  // Nothing to read, but the deadline passed: a server's loop refuses it.
  EXPECT_EQ(server.poll_step(/*readable=*/false, Clock::now()), ServerHandshake::State::kRefused);
  EXPECT_NE(server.why().find("did not prove it holds the job secret in time"), std::string::npos)
      << server.why();
}

TEST(Handshake, APeerThatIsNoCohortServerIsNamed) {
  SocketPair pair;
  // An SSH server's banner, padded to a challenge's length.
  const std::string banner = "SSH-2.0-OpenSSH_9.2p1 Debian-2+deb12u3\r\n" + std::string(40, ' ');
  ASSERT_EQ(::send(pair.server, banner.data(), banner.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(banner.size()));
  cohort::testing::expect_error<RuntimeError>(
      [&] {
        prove_secret(pair.client, secret("one job's secret!"),
                     Clock::now() + std::chrono::seconds(10), "the store at 10.0.0.1:22");
      },
      "the store at 10.0.0.1:22 is no cohort server of this version");
}

}  // namespace
}  // namespace cohort::comm

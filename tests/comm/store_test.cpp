#include "cohort/comm/store.h"

#include <gtest/gtest.h>

#include <unistd.h>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cohort/error.h"
#include "comm/handshake.h"
#include "comm/socket.h"
#include "comm/store_frame.h"
#include "support/expect.h"

namespace cohort::comm {
namespace {

TEST(Store, ServerPicksAFreePortAndClientsShareKeys) {
  auto server = Store::connect({.is_server = true, .timeout = std::chrono::seconds(5)});
  ASSERT_GT(server.port(), 0);
  auto client = Store::connect({.port = server.port(), .timeout = std::chrono::seconds(5)});
  client.set("greeting", "hello");
  EXPECT_EQ(server.get("greeting"), "hello");
  EXPECT_EQ(server.add("counter", 2), 2);
  EXPECT_EQ(client.add("counter", 3), 5);
  EXPECT_TRUE(client.check({"greeting", "counter"}));
  EXPECT_FALSE(client.check({"absent"}));
}

TEST(Store, TwoServersDoNotCollide) {
  auto a = Store::connect({.is_server = true});
  auto b = Store::connect({.is_server = true});
  EXPECT_NE(a.port(), b.port());
}

TEST(Store, WaitNamesTheMissingKeys) {
  auto server = Store::connect({.is_server = true, .timeout = std::chrono::seconds(5)});
  server.set("present", "1");
  cohort::testing::expect_error<TimeoutError>(
      [&] {
        server.wait({"present", "late"}, std::chrono::milliseconds(200));
      },
      "[late]");
}

TEST(Store, WaitReturnsWhenAnotherClientSetsTheKey) {
  auto server = Store::connect({.is_server = true, .timeout = std::chrono::seconds(5)});
  std::thread setter([port = server.port()] {
    auto client = Store::connect({.port = port});
    client.set("ready", "yes");
  });
  server.wait({"ready"}, std::chrono::seconds(10));
  setter.join();
  EXPECT_EQ(server.get("ready"), "yes");
}

// A thread may wait on a second connection while the first goes on using its own: the waiter
// returns once the first sets its key. The second client joins with the first's job and secret.
TEST(Store, ASecondConnectionWaitsWhileTheFirstIsUsed) {
  const auto secret = JobSecret::from_text("the store test's secret", "test");
  auto server = Store::connect({.is_server = true,
                                .timeout = std::chrono::seconds(20),
                                .job_id = "job-a",
                                .secret = secret});
  auto again = server.connect_again();
  EXPECT_EQ(again.port(), server.port());
  EXPECT_EQ(server.stats().clients, 2);
  const auto start = std::chrono::steady_clock::now();
  std::thread waiter([&] { again.wait({"go"}, std::chrono::seconds(20)); });
  server.set("go", "now");
  waiter.join();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  EXPECT_EQ(again.get("go"), "now");
  EXPECT_THROW(Store().connect_again(), RuntimeError);
}

TEST(Store, UnreachableServerFailsWithinTheDeadline) {
  // Take a port, close the server, then nobody listens there.
  int port = Store::connect({.is_server = true}).port();
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW(Store::connect({.port = port, .timeout = std::chrono::milliseconds(500)}),
               RuntimeError);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
}

TEST(Store, ListensOnlyOnTheGivenAddress) {
  auto server =
      Store::connect({.host = "127.0.0.1", .is_server = true, .timeout = std::chrono::seconds(5)});
  // 127.0.0.2 is this host too, but not the address the server was given.
  cohort::testing::expect_error<TimeoutError>(
      [&] {
        Store::connect({.host = "127.0.0.2",
                        .port = server.port(),
                        .timeout = std::chrono::milliseconds(300)});
      },
      "cannot reach the rendezvous store at 127.0.0.2:");
}

TEST(Store, ATakenPortIsNamed) {
  auto first = Store::connect({.is_server = true});
  cohort::testing::expect_error<RuntimeError>(
      [&] { Store::connect({.port = first.port(), .is_server = true}); },
      "another job uses this port");
}

TEST(Store, AClientOfAnotherJobIsRefused) {
  auto server =
      Store::connect({.is_server = true, .timeout = std::chrono::seconds(5), .job_id = "job-a"});
  cohort::testing::expect_error<UsageError>(
      [&] {
        Store::connect(
            {.port = server.port(), .timeout = std::chrono::seconds(5), .job_id = "job-b"});
      },
      "belongs to job 'job-a', not to job 'job-b'");
  auto same = Store::connect(
      {.port = server.port(), .timeout = std::chrono::seconds(5), .job_id = "job-a"});
  same.set("k", "v");
  EXPECT_EQ(server.get("k"), "v");
}

// A client without the job's secret gets nothing from the store: its proof is refused before any
// request of it is read, and it learns which store refused it and why.
TEST(Store, AClientWithoutTheJobSecretIsRefused) {
  const auto secret = JobSecret::from_text("the store test's secret", "test");
  auto server =
      Store::connect({.is_server = true, .timeout = std::chrono::seconds(5), .secret = secret});
  server.set("k", "v");
  for (const auto& other : {JobSecret(), JobSecret::from_text("another job's secret", "test")}) {
    cohort::testing::expect_error<UsageError>(
        [&] {
          Store::connect(
              {.port = server.port(), .timeout = std::chrono::seconds(5), .secret = other});
        },
        "the rendezvous store at 127.0.0.1:" + std::to_string(server.port()) +
            " refused this process's proof of the job secret");
  }
  auto member =
      Store::connect({.port = server.port(), .timeout = std::chrono::seconds(5), .secret = secret});
  EXPECT_EQ(member.get("k"), "v");
  EXPECT_EQ(server.stats().clients, 2);  // the refused ones hold no connection
}

TEST(Store, ALateAnswerToATimedOutWaitIsNotTakenForAnother) {
  auto server = Store::connect({.is_server = true, .timeout = std::chrono::seconds(5)});
  auto client = Store::connect({.port = server.port(), .timeout = std::chrono::seconds(5)});
  EXPECT_THROW(client.wait({"later"}, std::chrono::milliseconds(100)), TimeoutError);
  server.set("later", "1");  // the server now answers the abandoned wait
  server.set("other", "2");
  EXPECT_EQ(client.get("other"), "2");
  EXPECT_EQ(client.add("n", 1), 1);
}

TEST(Store, LosingTheServerIsAPeerFailure) {
  auto server =
      std::make_optional(Store::connect({.is_server = true, .timeout = std::chrono::seconds(5)}));
  auto client = Store::connect({.port = server->port(), .timeout = std::chrono::seconds(5)});
  server.reset();
  EXPECT_THROW(client.wait({"never"}, std::chrono::seconds(5)), RuntimeError);
  cohort::testing::expect_error<PeerFailureError>([&] { client.set("k", "v"); },
                                                  "lost the rendezvous store");
}

TEST(Store, GetManyReadsKeysInOneCallAndNamesAMissingOne) {
  auto server = Store::connect({.is_server = true, .timeout = std::chrono::seconds(5)});
  server.set("a", "1");
  server.set("b", "22");
  EXPECT_EQ(server.get_many({"b", "a"}), (std::vector<std::string>{"22", "1"}));
  cohort::testing::expect_error<RuntimeError>(
      [&] {
        server.get_many({"a", "nope"});
      },
      "key 'nope' is not set");
}

TEST(Store, RemovePrefixDeletesAStepsKeysAndStatsCountWhatIsLeft) {
  auto server = Store::connect({.is_server = true, .timeout = std::chrono::seconds(5)});
  server.set("step/1/a", "xx");
  server.set("step/1/b", "yyy");
  server.set("step/10/a", "z");
  server.set("other", "12345");
  auto stats = server.stats();
  EXPECT_EQ(stats.keys, 4);
  EXPECT_EQ(stats.bytes, (8 + 2) + (8 + 3) + (9 + 1) + (5 + 5));
  EXPECT_EQ(stats.clients, 1);
  EXPECT_EQ(server.remove_prefix("step/1/"), 2);
  stats = server.stats();
  EXPECT_EQ(stats.keys, 2);
  EXPECT_EQ(stats.bytes, (9 + 1) + (5 + 5));
  // Replacing a value counts its new size only.
  server.set("other", "1");
  EXPECT_EQ(server.stats().bytes, (9 + 1) + (5 + 1));
  EXPECT_FALSE(server.check({"step/1/a"}));
  EXPECT_TRUE(server.check({"step/10/a"}));
}

TEST(Store, ABarrierOfManyRanksReturnsEveryValue) {
  auto server = Store::connect({.is_server = true, .timeout = std::chrono::seconds(30)});
  constexpr int kWorld = 32;
  std::vector<std::vector<std::string>> seen(kWorld);
  std::vector<std::thread> ranks;
  for (int r = 0; r < kWorld; ++r) {
    ranks.emplace_back([&, r] {
      auto client = Store::connect({.port = server.port(), .timeout = std::chrono::seconds(30)});
      seen[static_cast<size_t>(r)] = client.arrive_and_wait(
          "many/", r, kWorld, "v" + std::to_string(r), "arrive", std::chrono::seconds(30));
    });
  }
  for (auto& t : ranks) t.join();
  for (const auto& values : seen) {
    ASSERT_EQ(values.size(), static_cast<size_t>(kWorld));
    for (int r = 0; r < kWorld; ++r)
      EXPECT_EQ(values[static_cast<size_t>(r)], "v" + std::to_string(r));
  }
}

TEST(Store, ABarrierNameReusedWithOtherParticipantsIsRefused) {
  auto server = Store::connect({.is_server = true, .timeout = std::chrono::seconds(5)});
  server.arrive_and_wait("once/", 0, 1, "1", "arrive", std::chrono::seconds(5));
  cohort::testing::expect_error<UsageError>(
      [&] { server.arrive_and_wait("once/", 0, 2, "1", "arrive", std::chrono::seconds(5)); },
      "barrier 'once/' was entered by rank 0 as a barrier of 2 ranks but it is a barrier of 1 "
      "ranks");
}

// One client asks for a large value over and over and does not read the replies: the store's one
// thread keeps what the socket does not take and serves the others (before, it stalled on that
// client for kServerClientTimeout and dropped it); the client gets every reply once it reads.
TEST(Store, AClientThatStopsReadingKeepsItsRepliesAndTheOthersAreServed) {
  auto server = Store::connect(
      {.host = "127.0.0.1", .port = 0, .is_server = true, .timeout = std::chrono::seconds(20)});
  auto other = Store::connect({.host = "127.0.0.1",
                               .port = server.port(),
                               .is_server = false,
                               .timeout = std::chrono::seconds(20)});
  const std::string big(1 << 20, 'x');
  other.set("big", big);
  const int fd = socket::connect_to("127.0.0.1:" + std::to_string(server.port()),
                                    std::chrono::seconds(5), "the store");
  // A member of the job (the store's secret is the default: none), so its requests are served.
  prove_secret(fd, JobSecret(), std::chrono::steady_clock::now() + std::chrono::seconds(5),
               "the store");
  // A hello with the default (empty) job id, then 16 gets.
  std::string requests = encode_store_frame({.id = 1, .code = kHello, .fields = {""}});
  for (uint64_t id = 2; id < 18; ++id)
    requests += encode_store_frame({.id = id, .code = kGet, .fields = {"big"}});
  socket::write_all(fd, requests.data(), requests.size(), "the store", std::chrono::seconds(5));
  // 16 MiB of replies that nobody reads, far more than the socket takes: the store keeps them for
  // that client, which stays connected, and serves the others meanwhile.
  EXPECT_EQ(other.get("big"), big);
  other.set("after", "served");
  EXPECT_EQ(other.get("after"), "served");
  EXPECT_EQ(server.stats().clients, 3);
  // Then it reads them, all 16, whole and in order.
  for (uint64_t id = 1; id < 18; ++id) {
    uint32_t length = 0;
    socket::read_all(fd, &length, 4, std::chrono::seconds(10), "the store");
    std::string frame(length, '\0');
    socket::read_all(fd, frame.data(), length, std::chrono::seconds(10), "the store");
    uint64_t reply_id = 0;
    std::memcpy(&reply_id, frame.data(), 8);
    EXPECT_EQ(reply_id, id);
    if (id > 1) {
      EXPECT_EQ(frame.size(), 13u + 4u + big.size()) << id;
    }
  }
  ::close(fd);
}

}  // namespace
}  // namespace cohort::comm

#include "cohort/comm/store.h"

#include <gtest/gtest.h>

#include <optional>
#include <thread>

#include "cohort/error.h"
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

}  // namespace
}  // namespace cohort::comm

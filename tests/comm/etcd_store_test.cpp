// The rendezvous store kept in a real etcd (Debian's etcd-server) on loopback.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <thread>

#include "cohort/comm/process_group.h"
#include "cohort/comm/store.h"
#include "cohort/error.h"
#include "comm/handshake.h"
#include "support/etcd_server.h"
#include "support/expect.h"

namespace cohort::comm {
namespace {

using Clock = std::chrono::steady_clock;
using cohort::testing::expect_error;

class EtcdStore : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why_not;
    etcd_ = cohort::testing::EtcdServer::start(why_not);
    if (!etcd_) GTEST_SKIP() << why_not;
  }
  // A client of job `job` (a fresh secret unless given).
  Store join(const std::string& job, const JobSecret& secret,
             std::chrono::seconds lease = kDefaultEtcdLeaseTtl) {
    return Store::connect({.host = "127.0.0.1",
                           .port = etcd_->port(),
                           .timeout = std::chrono::seconds(10),
                           .job_id = job,
                           .secret = secret,
                           .etcd = true,
                           .etcd_lease_ttl = lease});
  }
  std::unique_ptr<cohort::testing::EtcdServer> etcd_;
  JobSecret secret_ = JobSecret::generate();
};

TEST_F(EtcdStore, ClientsOfAJobShareItsKeys) {
  auto a = join("job-a", secret_);
  auto b = join("job-a", secret_);
  EXPECT_TRUE(a.in_etcd());
  EXPECT_EQ(a.where(), "etcd at 127.0.0.1:" + std::to_string(etcd_->port()));
  a.set("greeting", std::string("hello\0world", 11));  // any bytes
  EXPECT_EQ(b.get("greeting"), std::string("hello\0world", 11));
  EXPECT_EQ(a.add("counter", 2), 2);
  EXPECT_EQ(b.add("counter", 3), 5);
  EXPECT_TRUE(b.check({"greeting", "counter"}));
  EXPECT_FALSE(b.check({"greeting", "absent"}));
  EXPECT_EQ(b.get_many({"counter", "greeting"}),
            (std::vector<std::string>{"5", std::string("hello\0world", 11)}));
  a.set("step/1/x", "1");
  a.set("step/1/y", "1");
  a.set("step/2/x", "1");
  EXPECT_EQ(b.remove_prefix("step/1/"), 2);
  EXPECT_FALSE(a.check({"step/1/x"}));
  EXPECT_TRUE(a.check({"step/2/x"}));
  EXPECT_EQ(b.stats().keys, a.stats().keys);
}

TEST_F(EtcdStore, JobsDoNotSeeEachOthersKeys) {
  auto a = join("job-a", secret_);
  auto b = join("job-b", JobSecret::generate());
  a.set("key", "of a");
  EXPECT_FALSE(b.check({"key"}));
  b.set("key", "of b");
  EXPECT_EQ(a.get("key"), "of a");
}

// Racing increments from many threads: every one counted once (etcd's revisions order them).
TEST_F(EtcdStore, AddIsAtomicAcrossClients) {
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      auto client = join("job-add", secret_);
      for (int i = 0; i < 10; ++i) client.add("count", 1);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(join("job-add", secret_).add("count", 0), 40);
}

TEST_F(EtcdStore, BarrierAndWaitNameTheMissing) {
  auto a = join("job-w", secret_);
  auto b = join("job-w", secret_);
  std::thread late(
      [&] { b.arrive_and_wait("join/", 1, 2, "b", "join", std::chrono::seconds(10)); });
  EXPECT_EQ(a.arrive_and_wait("join/", 0, 2, "a", "join", std::chrono::seconds(10)),
            (std::vector<std::string>{"a", "b"}));
  late.join();
  expect_error<TimeoutError>(
      [&] {
        a.wait({"join/0", "never"}, std::chrono::milliseconds(300));
      },
      "etcd at 127.0.0.1:" + std::to_string(etcd_->port()) +
          ": keys [never] did not appear within 300 ms");
  expect_error<TimeoutError>(
      [&] { a.arrive_and_wait("three/", 0, 3, "a", "join", std::chrono::milliseconds(300)); },
      "ranks [1, 2] of 3 did not join within 300 ms");
}

TEST_F(EtcdStore, AnotherSecretIsRefused) {
  join("job-s", secret_).set("x", "1");
  expect_error<SecretRefused>([&] { join("job-s", JobSecret::generate()); },
                              "holds job 'job-s' with another job secret");
  expect_error<SecretRefused>([&] { join("job-s", JobSecret()); },
                              "holds job 'job-s' with another job secret");
}

TEST_F(EtcdStore, AnEndpointThatDoesNotAnswerIsABadEndpointNamedWithinTheTimeout) {
  const int port = etcd_->port();
  etcd_->kill();
  const auto started = Clock::now();
  expect_error<UsageError>(
      [&] {
        Store::connect({.host = "127.0.0.1",
                        .port = port,
                        .timeout = std::chrono::seconds(2),
                        .job_id = "job-x",
                        .etcd = true});
      },
      "cannot reach the rendezvous etcd at 127.0.0.1:" + std::to_string(port) + " within 2000 ms");
  EXPECT_LT(Clock::now() - started, std::chrono::seconds(10));
}

// The job's keys live as long as one of its processes keeps the lease alive, and go with it.
TEST_F(EtcdStore, KeysGoWithTheJobsLease) {
  const auto lease = std::chrono::seconds(3);
  {
    auto first = join("job-l", secret_, lease);
    first.set("kept", "1");
    auto second = join("job-l", secret_, lease);
    // Past two leases with both alive: renewed.
    const auto renewed = Clock::now() + 2 * lease;
    while (Clock::now() < renewed) {
      ASSERT_TRUE(second.check({"kept"})) << "the key went while the job's clients lived";
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  }
  // Both gone: etcd drops the job's keys when the lease runs out. Watched from outside the job
  // (a client of the job would renew its lease on joining).
  const auto deadline = Clock::now() + 5 * lease;
  const std::string kept = R"({"key": "L2NvaG9ydC9qb2ItbC9rZXB0"})";  // "/cohort/job-l/kept"
  ASSERT_NE(etcd_->post("/v3/kv/range", kept).find("\"kvs\""), std::string::npos)
      << "the key went with its clients at once";
  while (etcd_->post("/v3/kv/range", kept).find("\"kvs\"") != std::string::npos) {
    ASSERT_LT(Clock::now(), deadline) << "the job's keys outlived its lease";
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  auto next = join("job-l", secret_, lease);  // the job afresh, under a new lease
  EXPECT_FALSE(next.check({"kept"}));
}

// etcd's refusals are read as such, not taken for a lost etcd: a job whose lease is gone (here
// revoked by another client of etcd) is told so at once, and the next client starts it afresh.
TEST_F(EtcdStore, AJobWhoseLeaseIsGoneIsToldSo) {
  auto a = join("job-g", secret_);
  a.set("x", "1");
  const std::string lease = a.get("@lease");
  ASSERT_NE(etcd_->post("/v3/lease/revoke", "{\"ID\": \"" + lease + "\"}"), "");
  expect_error<PeerFailureError>(
      [&] { a.set("y", "1"); },
      "etcd at 127.0.0.1:" + std::to_string(etcd_->port()) +
          " no longer holds the job's lease (/v3/kv/put: etcdserver: requested lease not found)");
  auto b = join("job-g", secret_);
  EXPECT_NE(b.get("@lease"), lease);
  EXPECT_FALSE(b.check({"x"}));
  b.set("y", "1");
  EXPECT_EQ(b.get("y"), "1");
}

// A record of a lease that etcd no longer has (read just as the lease ran out) is replaced, not
// tried until the timeout.
TEST_F(EtcdStore, ARecordedLeaseThatRanOutIsReplaced) {
  auto a = join("job-r", secret_);
  a.set("@lease", "12345");  // no such lease
  auto b = join("job-r", secret_);
  EXPECT_NE(b.get("@lease"), "12345");
  b.set("z", "1");
  EXPECT_EQ(a.get("z"), "1");
}

// Gloo rendezvous through etcd as through cohort's own store.
TEST_F(EtcdStore, GlooProcessGroupRendezvousThroughIt) {
  std::vector<double> sums(3);
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < 3; ++rank) {
    ranks.emplace_back([&, rank] {
      auto group = ProcessGroup::create(join("job-gloo", secret_), rank, 3,
                                        {.setup_timeout = std::chrono::seconds(30)});
      std::vector<at::Tensor> tensors{torch::full({4}, static_cast<double>(rank + 1))};
      group.allreduce(tensors);
      sums[static_cast<size_t>(rank)] = tensors[0][3].item<double>();
    });
  }
  for (auto& r : ranks) r.join();
  EXPECT_EQ(sums, (std::vector<double>{6, 6, 6}));
}

}  // namespace
}  // namespace cohort::comm

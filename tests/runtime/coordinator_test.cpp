#include "cohort/runtime/coordinator.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <memory>
#include <thread>

#include "cohort/error.h"
#include "comm/handshake.h"
#include "support/expect.h"

namespace cohort::runtime {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

// A clock the test moves by hand: the coordinator's timing without sleeping.
struct FakeClock {
  SteadyTime now{};
  ClockSource source() {
    return [this] { return now; };
  }
  void advance(milliseconds by) { now += by; }
};

HeartbeatOptions beats(milliseconds timeout, milliseconds grace = milliseconds(0)) {
  return {.interval = heartbeat_interval_for(timeout), .timeout = timeout, .startup_grace = grace};
}

TEST(HeartbeatOptions, NonPositiveValuesAreRefusedNamingThem) {
  cohort::testing::expect_error<UsageError>(
      [] { HeartbeatOptions{.interval = milliseconds(0)}.validate(); },
      "heartbeat interval 0 ms: it must be > 0");
  cohort::testing::expect_error<UsageError>(
      [] { HeartbeatOptions{.timeout = milliseconds(-5)}.validate(); },
      "heartbeat timeout -5 ms: it must be > 0");
  cohort::testing::expect_error<UsageError>(
      [] { HeartbeatMonitor(2, HeartbeatOptions{.timeout = milliseconds(0)}); },
      "heartbeat timeout 0 ms");
}

TEST(HeartbeatOptions, TheIntervalIsAFifthOfTheTimeoutWithinBounds) {
  EXPECT_EQ(heartbeat_interval_for(seconds(3)), milliseconds(600));
  EXPECT_EQ(heartbeat_interval_for(seconds(30)), milliseconds(1000));
  EXPECT_EQ(heartbeat_interval_for(milliseconds(20)), milliseconds(10));
}

TEST(HeartbeatMonitor, AMemberIsSilentExactlyAtTheTimeout) {
  FakeClock clock;
  HeartbeatMonitor monitor(2, beats(seconds(3)), clock.source());
  monitor.heard(0);
  monitor.heard(1);
  clock.advance(milliseconds(2'000));
  monitor.heard(0);
  clock.advance(milliseconds(999));
  EXPECT_FALSE(monitor.find_silent());
  clock.advance(milliseconds(1));
  const auto silent = monitor.find_silent();
  ASSERT_TRUE(silent);
  EXPECT_EQ(silent->member, 1);
  EXPECT_EQ(silent->describe("rank 1"),
            "rank 1 sent no heartbeat for 3 s: it hangs or was stopped");
}

TEST(HeartbeatMonitor, StartUpGetsTheGraceAndFinishedMembersAreNotExpected) {
  FakeClock clock;
  HeartbeatMonitor monitor(2, beats(seconds(3), seconds(10)), clock.source());
  monitor.heard(0);
  clock.advance(seconds(12));
  monitor.heard(0);
  EXPECT_FALSE(monitor.find_silent());  // 12 s < 10 s grace + 3 s
  clock.advance(seconds(1));
  const auto silent = monitor.find_silent();
  ASSERT_TRUE(silent);
  EXPECT_EQ(silent->member, 1);
  EXPECT_FALSE(silent->started);
  EXPECT_NE(silent->describe("rank 1").find("within 13 s of its start"), std::string::npos);
  monitor.finished(1);
  EXPECT_FALSE(monitor.find_silent());
}

TEST(HeartbeatMonitor, OneStillStartingIsGivenItsGraceFromTheLatestPeersArrival) {
  // A loaded machine starts rank 0 late; its rendezvous deadline (the grace) runs from then, so
  // rank 1, which never starts, is given up only after it: the rendezvous names it first.
  FakeClock clock;
  HeartbeatMonitor monitor(2, beats(seconds(3), seconds(2)), clock.source());
  clock.advance(seconds(4));
  monitor.heard(0);
  clock.advance(milliseconds(4'999));
  monitor.heard(0);
  EXPECT_FALSE(monitor.find_silent());  // 5 s allowed from rank 0's arrival, not from the start
  clock.advance(milliseconds(1));
  const auto silent = monitor.find_silent();
  ASSERT_TRUE(silent);
  EXPECT_EQ(silent->member, 1);
  EXPECT_FALSE(silent->started);
  // A replacement that starts after its peers' last arrival (rank 1's own, at 9 s) is given its
  // grace from its own start, at 11 s.
  monitor.heard(1);
  clock.advance(seconds(2));
  monitor.heard(0);
  monitor.restarted(1);
  clock.advance(milliseconds(2'500));
  monitor.heard(0);
  clock.advance(milliseconds(2'499));
  monitor.heard(0);
  EXPECT_FALSE(monitor.find_silent());  // 4.999 s after its restart
  clock.advance(milliseconds(1));
  ASSERT_TRUE(monitor.find_silent());
  EXPECT_EQ(monitor.find_silent()->member, 1);
}

Json heartbeat(std::vector<std::tuple<std::string, std::vector<int>, int64_t>> groups) {
  Json list = Json::array();
  for (const auto& [name, ranks, entered] : groups) {
    list.push_back({{"name", name}, {"ranks", ranks}, {"entered", entered}, {"last", "allreduce"}});
  }
  return Json{{"type", "heartbeat"}, {"status", {{"groups", list}}}};
}

TEST(StallReport, NamesTheMembersBehindInEveryGroupIncludingSubGroups) {
  // Ranks 0-3; sub-groups {0,1} and {2,3}. Rank 3 stopped: group "world" and {2,3} wait for it.
  std::vector<Json> status{
      heartbeat({{"world", {0, 1, 2, 3}, 7}, {"world/1.0", {0, 1}, 3}})["status"],
      heartbeat({{"world", {0, 1, 2, 3}, 7}, {"world/1.0", {0, 1}, 3}})["status"],
      heartbeat({{"world", {0, 1, 2, 3}, 7}, {"world/1.1", {2, 3}, 5}})["status"],
      heartbeat({{"world", {0, 1, 2, 3}, 6}, {"world/1.1", {2, 3}, 4}})["status"]};
  const std::string report = stall_report(status);
  EXPECT_NE(report.find("group world: ranks [3] did not enter collective #7"), std::string::npos)
      << report;
  EXPECT_NE(report.find("group world/1.1: ranks [3] did not enter collective #5 (rank 2 entered 5 "
                        "(last allreduce), rank 3 entered 4 (last allreduce))"),
            std::string::npos)
      << report;
  EXPECT_EQ(report.find("world/1.0"), std::string::npos) << report;  // level
  status[3] = Json();  // nothing heard from rank 3: unknown, and behind
  EXPECT_NE(stall_report(status).find("rank 3 unknown"), std::string::npos);
  EXPECT_EQ(stall_report({Json(), Json()}), "");
}

TEST(StallReport, NamesWhereEachRankOfAPipelineWaits) {
  // Point-to-point groups differ in counts by design; their activity says where a rank waits.
  auto pipeline = [](int64_t entered, const std::string& activity) {
    Json status = heartbeat({{"world/0.0", {0, 1}, entered}})["status"];
    status["groups"][0]["last"] = "recv";
    status["groups"][0]["activity"] = activity;
    return status;
  };
  const std::string report =
      stall_report({pipeline(4, "pipeline stage 0: recv gradient of micro-batch 1"),
                    pipeline(4, "pipeline stage 1: recv activation of micro-batch 2")});
  EXPECT_NE(report.find("group world/0.0: ranks wait in (rank 0 entered 4 (last recv, in pipeline "
                        "stage 0: recv gradient of micro-batch 1), rank 1 entered 4 (last recv, "
                        "in pipeline stage 1: recv activation of micro-batch 2))"),
            std::string::npos)
      << report;
}

TEST(Coordinator, ASilentRankIsNamedWithTheStallReport) {
  FakeClock clock;
  Coordinator coordinator(2, beats(seconds(3)), clock.source());
  coordinator.on_message(0, heartbeat({{"train", {0, 1}, 5}}));
  coordinator.on_message(1, heartbeat({{"train", {0, 1}, 4}}));
  for (int i = 0; i < 4; ++i) {
    clock.advance(milliseconds(600));
    coordinator.on_message(0, heartbeat({{"train", {0, 1}, 5}}));
    EXPECT_FALSE(coordinator.verdict()) << "after " << (i + 1) * 600 << " ms";
  }
  clock.advance(milliseconds(600));  // rank 1 silent for 3 s: the timeout
  const auto verdict = coordinator.verdict();
  ASSERT_TRUE(verdict);
  EXPECT_EQ(verdict->rank, 1);
  EXPECT_EQ(verdict->reason,
            "rank 1 sent no heartbeat for 3 s: it hangs or was stopped; group train: ranks [1] did "
            "not enter collective #5 (rank 0 entered 5 (last allreduce), rank 1 entered 4 (last "
            "allreduce))");
}

TEST(Coordinator, ARanksOwnErrorIsTheCauseAndTheFirstVerdictStays) {
  FakeClock clock;
  Coordinator coordinator(3, beats(seconds(3)), clock.source());
  coordinator.on_message(
      0, {{"type", "error"}, {"message", "connection closed by peer"}, {"consequence", true}});
  EXPECT_FALSE(coordinator.verdict());  // a consequence waits for its cause
  coordinator.on_message(2, {{"type", "error"}, {"message", "injected failure"}});
  auto verdict = coordinator.verdict();
  ASSERT_TRUE(verdict);
  EXPECT_EQ(verdict->rank, 2);
  EXPECT_EQ(verdict->reason, "rank 2 failed: injected failure");
  coordinator.on_lost(1, "ended without finishing");
  clock.advance(seconds(10));
  EXPECT_EQ(coordinator.verdict()->reason, "rank 2 failed: injected failure");
}

TEST(Coordinator, AConsequenceWithoutACauseIsTheVerdictTwoIntervalsLater) {
  FakeClock clock;
  const auto options = beats(seconds(3));
  Coordinator coordinator(2, options, clock.source());
  coordinator.on_message(1, {{"type", "heartbeat"}});
  coordinator.on_message(0, {{"type", "error"}, {"message", "timed out"}, {"consequence", true}});
  clock.advance(2 * options.interval - milliseconds(1));
  coordinator.on_message(1, {{"type", "heartbeat"}});
  EXPECT_FALSE(coordinator.verdict());
  clock.advance(milliseconds(1));
  ASSERT_TRUE(coordinator.verdict());
  EXPECT_EQ(coordinator.verdict()->reason, "rank 0 failed: timed out");
}

TEST(Coordinator, ALostRankIsNamedAndAFinishedOneIsNot) {
  FakeClock clock;
  Coordinator coordinator(3, beats(seconds(3)), clock.source());
  coordinator.on_finished(2);
  clock.advance(seconds(2));
  EXPECT_FALSE(coordinator.verdict());
  coordinator.on_lost(1, "exited with code 1");
  ASSERT_TRUE(coordinator.verdict());
  EXPECT_EQ(coordinator.verdict()->rank, 1);
  EXPECT_EQ(coordinator.verdict()->reason, "rank 1 exited with code 1");
}

// A rank's end of the coordinator's protocol, by hand: the job secret's handshake (with
// `secret`, unless `prove` is false), then one line of JSON per message.
class RawRank {
 public:
  explicit RawRank(const std::string& address, const comm::JobSecret& secret = {},
                   bool prove = true) {
    const auto colon = address.rfind(':');
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_port = htons(static_cast<uint16_t>(std::stoi(address.substr(colon + 1))));
    ::inet_pton(AF_INET, address.substr(0, colon).c_str(), &to.sin_addr);
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    EXPECT_EQ(::connect(fd_, reinterpret_cast<sockaddr*>(&to), sizeof to), 0);
    if (prove)
      comm::prove_secret(fd_, secret, std::chrono::steady_clock::now() + seconds(10),
                         "the coordinator");
  }
  ~RawRank() { close(); }
  void send(const Json& message) { send_raw(message.dump() + "\n"); }
  void send_raw(const std::string& bytes) {
    ASSERT_EQ(::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(bytes.size()));
  }
  // Whether the coordinator closed this connection within 10 s (beats read and dropped).
  bool closed_by_peer() {
    const auto deadline = std::chrono::steady_clock::now() + seconds(10);
    char buffer[4096];
    while (std::chrono::steady_clock::now() < deadline) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 100) <= 0) continue;
      if (::read(fd_, buffer, sizeof buffer) <= 0) return true;
    }
    return false;
  }
  // The next line from the coordinator that is not a beat, within 10 s.
  Json next_message() {
    const auto deadline = std::chrono::steady_clock::now() + seconds(10);
    while (std::chrono::steady_clock::now() < deadline) {
      for (size_t end; (end = in_.find('\n')) != std::string::npos;) {
        const Json message = Json::parse(in_.substr(0, end));
        in_.erase(0, end + 1);
        if (message.value("type", "") != "beat") return message;
      }
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 100) <= 0) continue;
      char buffer[4096];
      const ssize_t n = ::read(fd_, buffer, sizeof buffer);
      if (n <= 0) break;
      in_.append(buffer, static_cast<size_t>(n));
    }
    return Json();
  }
  int fd() const { return fd_; }
  void close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
  std::string in_;
};

TEST(CoordinatorServer, ARankWhoseConnectionDropsIsNamedAndTheOthersAreToldToStop) {
  std::optional<Coordinator::Verdict> seen;
  CoordinatorServer server({.world_size = 3, .heartbeat = beats(seconds(30)), .token = "run-a"},
                           [&](const Coordinator::Verdict& v) { seen = v; });
  RawRank one(server.address()), two(server.address());
  one.send({{"type", "hello"}, {"rank", 1}, {"token", "run-a"}});
  two.send({{"type", "hello"}, {"rank", 2}, {"token", "run-a"}});
  server.deliver(0, R"({"type":"heartbeat","status":null})");
  two.close();  // rank 2 dies
  const auto verdict = server.await_verdict(seconds(10));
  ASSERT_TRUE(verdict);
  EXPECT_EQ(verdict->rank, 2);
  EXPECT_NE(verdict->reason.find("rank 2 ended without finishing"), std::string::npos)
      << verdict->reason;
  const Json abort = one.next_message();
  EXPECT_EQ(abort.value("type", ""), "abort") << abort.dump();
  EXPECT_EQ(abort.value("reason", ""), verdict->reason);
}

TEST(CoordinatorServer, ARankOfAnotherRunIsRefusedAndOneThatSaidByeMayLeave) {
  CoordinatorServer server({.world_size = 2, .heartbeat = beats(seconds(30)), .token = "run-a"},
                           nullptr);
  RawRank stranger(server.address());
  stranger.send({{"type", "hello"}, {"rank", 1}, {"token", "run-b"}});
  const Json refused = stranger.next_message();
  EXPECT_EQ(refused.value("type", ""), "refused") << refused.dump();
  EXPECT_NE(refused.value("reason", "").find("not rank 1 of run run-b"), std::string::npos);
  RawRank one(server.address());
  one.send({{"type", "hello"}, {"rank", 1}, {"token", "run-a"}});
  one.send({{"type", "bye"}});
  one.close();
  server.deliver(0, R"({"type":"heartbeat","status":null})");
  EXPECT_FALSE(server.await_verdict(milliseconds(300)));
}

// The job host of cohort launch holds no rank: rank 0 connects as every rank does, may be lost
// and replaced like any (its silence is the host's to end, its loss the others' to go on after),
// and the run ends when every rank said bye.
TEST(CoordinatorServer, AJobHostTakesRankZeroAsAnyRankAndEndsWhenEveryRankLeft) {
  std::vector<int> lost, hung;
  CoordinatorServerOptions options{
      .world_size = 2, .rank0_in_process = false, .heartbeat = beats(seconds(2)), .token = "run-a"};
  options.live.go_on_without = [&](int rank, const std::string&) {
    lost.push_back(rank);
    return true;
  };
  options.live.end_hung = [&](int rank, const std::string&) {
    hung.push_back(rank);
    return true;
  };
  CoordinatorServer server(options, nullptr);
  auto zero = std::make_unique<RawRank>(server.address());
  RawRank one(server.address());
  zero->send({{"type", "hello"}, {"rank", 0}, {"token", "run-a"}});
  one.send({{"type", "hello"}, {"rank", 1}, {"token", "run-a"}});
  // Rank 0 goes silent while rank 1 beats: the host is asked to end rank 0, not told a verdict.
  const auto deadline = std::chrono::steady_clock::now() + seconds(20);
  while (hung.empty() && std::chrono::steady_clock::now() < deadline) {
    one.send({{"type", "heartbeat"}, {"status", nullptr}});
    std::this_thread::sleep_for(milliseconds(100));  // a beat's interval, not a synchronisation
  }
  ASSERT_EQ(hung, std::vector<int>{0});
  zero.reset();  // its host ended it: the connection closes, and the others go on
  const Json told = one.next_message();
  EXPECT_EQ(told.value("type", ""), "peer_lost") << told.dump();
  EXPECT_EQ(told.value("rank", -1), 0);
  EXPECT_EQ(lost, std::vector<int>{0});
  EXPECT_FALSE(server.all_finished());  // rank 1 still trains
  server.regrouped({0});                // a replacement takes rank 0's place
  RawRank replacement(server.address());
  replacement.send({{"type", "hello"}, {"rank", 0}, {"token", "run-a"}});
  one.send({{"type", "bye"}});
  replacement.send({{"type", "bye"}});
  const auto until = std::chrono::steady_clock::now() + seconds(10);
  while (!server.all_finished() && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(milliseconds(20));
  EXPECT_TRUE(server.all_finished());
  EXPECT_FALSE(server.await_verdict(milliseconds(0)));
}

// The host stops the group itself (a report broke a rule of the run): every rank is told to stop
// with the host's reason, and the verdict names no rank.
TEST(CoordinatorServer, TheHostsOwnStopIsAVerdictToldToEveryRank) {
  CoordinatorServer server({.world_size = 2,
                            .rank0_in_process = false,
                            .heartbeat = beats(seconds(30)),
                            .token = "run-a"},
                           nullptr);
  RawRank zero(server.address()), one(server.address());
  zero.send({{"type", "hello"}, {"rank", 0}, {"token", "run-a"}});
  one.send({{"type", "hello"}, {"rank", 1}, {"token", "run-a"}});
  server.stop("rank 0 reported metric 'loss' as text");
  const auto verdict = server.await_verdict(seconds(10));
  ASSERT_TRUE(verdict);
  EXPECT_EQ(verdict->rank, -1);
  EXPECT_EQ(verdict->reason, "rank 0 reported metric 'loss' as text");
  for (RawRank* rank : {&zero, &one}) {
    const Json abort = rank->next_message();
    EXPECT_EQ(abort.value("type", ""), "abort") << abort.dump();
    EXPECT_EQ(abort.value("reason", ""), verdict->reason);
  }
}

// A connection without the job's secret (one that sends a rank's hello at once, one that proves
// another secret) is closed before any line of it is read. A line of the wrong shape (the issue's
// `{"rank":"1","token":42}` aborted rank 0 with a JSON type_error) or an endless line closes that
// connection; the coordinator and its run go on. A rank's own malformed message is dropped, and
// its next good one counts.
TEST(CoordinatorServer, MalformedLinesCloseTheirConnectionAndNeverTheCoordinator) {
  const auto secret = comm::JobSecret::from_text("the coordinator test's secret", "test");
  CoordinatorServer server(
      {.world_size = 2, .heartbeat = beats(seconds(30)), .token = "run-a", .secret = secret},
      nullptr);
  {
    RawRank unproven(server.address(), secret, /*prove=*/false);
    // A hello where the proof belongs (longer than a proof: judged at once, not at the deadline).
    unproven.send(
        {{"type", "hello"}, {"rank", 1}, {"token", "run-a"}, {"padding", std::string(64, ' ')}});
    EXPECT_TRUE(unproven.closed_by_peer());
    cohort::testing::expect_error<comm::SecretRefused>(
        [&] {
          RawRank outsider(server.address(),
                           comm::JobSecret::from_text("another job's secret", "test"));
        },
        "the coordinator refused this process's proof of the job secret");
  }
  for (const std::string line : {R"({"rank":"1","token":42})", R"({"rank":1.5,"token":"run-a"})",
                                 R"([1,2])", R"("hello")", R"({"token":"run-a"})", "not json"}) {
    RawRank stranger(server.address(), secret);
    stranger.send_raw(line + "\n");
    const Json refused = stranger.next_message();
    EXPECT_EQ(refused.value("type", ""), "refused") << line << ": " << refused.dump();
    EXPECT_TRUE(stranger.closed_by_peer()) << line;
  }
  {
    RawRank endless(server.address(), secret);
    // Past the cap without a newline; the coordinator may close while the last bytes travel.
    const std::string chunk(65536, 'x');
    for (size_t sent = 0; sent <= kMaxCoordinatorLine + chunk.size(); sent += chunk.size()) {
      if (::send(endless.fd(), chunk.data(), chunk.size(), MSG_NOSIGNAL) <= 0) break;
    }
    EXPECT_TRUE(endless.closed_by_peer());
  }
  RawRank one(server.address(), secret);
  one.send({{"type", "hello"}, {"rank", 1}, {"token", "run-a"}});
  one.send_raw("[]\n");
  one.send({{"type", 7}});
  one.send({{"type", "error"}, {"message", 42}});
  one.send({{"type", "error"}, {"message", "out of memory"}});
  const auto verdict = server.await_verdict(seconds(10));
  ASSERT_TRUE(verdict);
  EXPECT_EQ(verdict->rank, 1);
  EXPECT_EQ(verdict->reason, "rank 1 failed: out of memory");
}

// A heartbeat whose status is not activity_status()'s shape (found by tests/fuzz: a number where
// a group belongs ended the coordinator's thread with a JSON type_error in its stall report) is
// refused naming the field, and the stall report reads only well-formed statuses.
TEST(Coordinator, AHeartbeatWithAMalformedStatusIsNamedAndNotRecorded) {
  Coordinator c(2, beats(seconds(30)));
  const std::vector<std::pair<Json, std::string>> cases{
      {Json{{"groups", 5}}, "field 'groups' is number, not an array"},
      {Json{{"groups", Json::array({7})}}, "a message must be a JSON object, not number"},
      {Json{{"groups", Json::array({Json{{"name", "train"}, {"ranks", "all"}}})}},
       "field 'ranks' is string, not an array"},
      {Json{{"groups", Json::array({Json{{"name", "train"}, {"ranks", Json::array({-1})}}})}},
       "field 'ranks' holds -1, not a rank"},
      {Json{{"groups", Json::array({Json{{"entered", "3"}}})}},
       "field 'entered' is string \"3\", not an integer"}};
  for (const auto& [status, fragment] : cases) {
    cohort::testing::expect_error<UsageError>(
        [&] {
          c.on_message(1, {{"type", "heartbeat"}, {"status", status}});
        },
        fragment);
  }
  EXPECT_EQ(c.status()[1], Json());
  EXPECT_EQ(c.stall_report(), "");
  EXPECT_EQ(stall_report({Json{{"groups", 5}}, Json{{"groups", Json::array({7})}}}), "");
}

TEST(Coordinator, AMessageWithAFieldOfTheWrongTypeIsNamedAndChangesNothing) {
  Coordinator c(2, beats(seconds(30)));
  cohort::testing::expect_error<UsageError>([&] { c.on_message(1, Json::array()); },
                                            "a message must be a JSON object, not array");
  cohort::testing::expect_error<UsageError>(
      [&] {
        c.on_message(1, {{"type", "error"}, {"consequence", "yes"}});
      },
      "field 'consequence' is string \"yes\", not true or false");
  EXPECT_FALSE(c.verdict());
}

}  // namespace
}  // namespace cohort::runtime

#include "cohort/runtime/worker_group.h"

#include <gtest/gtest.h>

#include <poll.h>
#include <sys/wait.h>

#include <csignal>
#include <fstream>

#include "cohort/error.h"
#include "support/subprocess.h"
#include "support/tiny_mnist.h"

namespace cohort::runtime {
namespace {

using cohort::testing::process_alive;

WorkerGroupOptions shell(int n, const std::string& script) {
  WorkerGroupOptions o;
  o.num_workers = n;
  o.executable = "/bin/sh";
  o.argv = {"sh", "-c", script};
  o.stop_grace = std::chrono::milliseconds(1000);
  return o;
}

TEST(WorkerGroup, GivesEachWorkerItsRankAndCollectsOutputAndLogs) {
  auto dir = cohort::testing::temp_dir("group_logs");
  auto options =
      shell(3, "echo \"out $RANK of $WORLD_SIZE role $COHORT_ROLE\"; echo err $LOCAL_RANK >&2");
  options.rank_env = [](int rank) {
    return std::map<std::string, std::string>{
        {"RANK", std::to_string(rank)}, {"WORLD_SIZE", "3"}, {"LOCAL_RANK", std::to_string(rank)}};
  };
  options.log_dir = dir;
  WorkerGroup group(options);
  group.start();
  std::map<int, std::vector<std::string>> lines;
  WorkerGroupHandlers handlers;
  handlers.on_output = [&](int rank, int, bool is_stderr, const std::string& line) {
    lines[rank].push_back((is_stderr ? "E:" : "O:") + line);
  };
  auto outcome = group.wait(handlers);
  EXPECT_TRUE(outcome.success) << outcome.failure_reason;
  for (int r = 0; r < 3; ++r) {
    const auto& l = lines[r];
    EXPECT_NE(std::find(l.begin(), l.end(), "O:out " + std::to_string(r) + " of 3 role worker"),
              l.end());
    EXPECT_NE(std::find(l.begin(), l.end(), "E:err " + std::to_string(r)), l.end());
    auto log = cohort::testing::read_text((dir / ("rank-" + std::to_string(r) + ".log")).string());
    EXPECT_NE(log.find("out " + std::to_string(r) + " of 3"), std::string::npos) << log;
  }
  std::filesystem::remove_all(dir);
}

TEST(WorkerGroup, ControlMessagesArriveOnTheirOwnChannel) {
  auto options = shell(2, "echo \"hello from $RANK\" >&$COHORT_CONTROL_FD; echo plain");
  options.rank_env = [](int rank) {
    return std::map<std::string, std::string>{{"RANK", std::to_string(rank)}};
  };
  WorkerGroup group(options);
  group.start();
  std::vector<std::string> control;
  int plain = 0;
  WorkerGroupHandlers handlers;
  handlers.on_control = [&](int rank, const std::string& m) {
    control.push_back(std::to_string(rank) + ":" + m);
  };
  handlers.on_output = [&](int, int, bool, const std::string& line) { plain += line == "plain"; };
  EXPECT_TRUE(group.wait(handlers).success);
  std::sort(control.begin(), control.end());
  EXPECT_EQ(control, (std::vector<std::string>{"0:hello from 0", "1:hello from 1"}));
  EXPECT_EQ(plain, 2);
}

TEST(WorkerGroup, OneFailureStopsTheOthersAndLeavesNoProcess) {
  // Rank 1 fails once rank 0 is surely running (it waits for rank 0's file); rank 0 would
  // otherwise run for a minute.
  auto dir = cohort::testing::temp_dir("group_fail");
  auto marker = (dir / "rank0_running").string();
  auto options = shell(2, "if [ \"$RANK\" = 0 ]; then touch " + marker +
                              "; exec sleep 60; else while [ ! -f " + marker +
                              " ]; do sleep 0.05; done; exit 3; fi");
  options.rank_env = [](int rank) {
    return std::map<std::string, std::string>{{"RANK", std::to_string(rank)}};
  };
  WorkerGroup group(options);
  group.start();
  auto pids = group.pids();
  const auto start = std::chrono::steady_clock::now();
  auto outcome = group.wait();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
  EXPECT_FALSE(outcome.success);
  ASSERT_TRUE(outcome.first_failure);
  EXPECT_EQ(outcome.first_failure->rank, 1);
  EXPECT_EQ(outcome.first_failure->exit_code, 3);
  EXPECT_NE(outcome.failure_reason.find("rank 1"), std::string::npos) << outcome.failure_reason;
  EXPECT_TRUE(outcome.exits[0].stopped_by_driver);
  for (int pid : pids) EXPECT_FALSE(process_alive(pid)) << pid;
  std::filesystem::remove_all(dir);
}

TEST(WorkerGroup, AKilledWorkerIsReportedWithItsSignal) {
  auto options = shell(1, "kill -9 $$");
  WorkerGroup group(options);
  group.start();
  auto outcome = group.wait();
  EXPECT_FALSE(outcome.success);
  ASSERT_TRUE(outcome.first_failure);
  EXPECT_EQ(outcome.first_failure->signal, SIGKILL);
  EXPECT_NE(outcome.failure_reason.find("killed by signal 9"), std::string::npos)
      << outcome.failure_reason;
}

TEST(WorkerGroup, HelpersOfAWorkerThatDiedAreStoppedToo) {
  // Rank 1 starts a helper in its process group, then is killed; rank 0 runs on meanwhile.
  auto dir = cohort::testing::temp_dir("group_helpers");
  auto helper_file = (dir / "helper.pid").string();
  auto options = shell(2, "if [ \"$RANK\" = 0 ]; then exec sleep 60; else sleep 60 & echo $! > " +
                              helper_file + ".tmp; mv " + helper_file + ".tmp " + helper_file +
                              "; kill -9 $$; fi");
  options.rank_env = [](int rank) {
    return std::map<std::string, std::string>{{"RANK", std::to_string(rank)}};
  };
  WorkerGroup group(options);
  group.start();
  auto outcome = group.wait();
  EXPECT_FALSE(outcome.success);
  ASSERT_TRUE(outcome.first_failure);
  EXPECT_EQ(outcome.first_failure->rank, 1);
  const int helper = std::stoi(cohort::testing::read_text(helper_file));
  EXPECT_TRUE(cohort::testing::wait_for_exit(helper, std::chrono::seconds(10)))
      << "helper " << helper << " outlived its worker";
  EXPECT_FALSE(process_group_alive(group.pids()[1]));
  std::filesystem::remove_all(dir);
}

// The driver's report bookkeeping relies on this order: a rank's last messages are handled
// before its exit, also when it wrote them after the poll that woke the group up.
TEST(WorkerGroup, AWorkersLastMessagesAreHandledBeforeItsExit) {
  auto dir = cohort::testing::temp_dir("group_order");
  const auto go = (dir / "go").string();
  const auto done = (dir / "done").string();
  // Rank 1 writes and exits only once the handler of rank 0's message is running, i.e. after
  // the group's poll() returned; that handler returns only once rank 1 has exited.
  auto options =
      shell(2, "if [ \"$RANK\" = 0 ]; then echo first >&$COHORT_CONTROL_FD; while [ ! -f " + done +
                   " ]; do sleep 0.05; done; else while [ ! -f " + go +
                   " ]; do sleep 0.05; done; echo last >&$COHORT_CONTROL_FD; fi");
  options.rank_env = [](int rank) {
    return std::map<std::string, std::string>{{"RANK", std::to_string(rank)}};
  };
  WorkerGroup group(options);
  group.start();
  std::vector<std::string> events;
  WorkerGroupHandlers handlers;
  handlers.on_control = [&](int rank, const std::string& m) {
    events.push_back(std::to_string(rank) + ":" + m);
    if (m != "first") return;
    std::ofstream(go).flush();
    // Without reaping it: the group must find the exit itself.
    siginfo_t info{};
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (std::chrono::steady_clock::now() < deadline) {
      info.si_pid = 0;
      ::waitid(P_PID, static_cast<id_t>(group.pids()[1]), &info, WEXITED | WNOHANG | WNOWAIT);
      if (info.si_pid != 0) break;
      ::poll(nullptr, 0, 10);
    }
    EXPECT_NE(info.si_pid, 0) << "rank 1 did not exit within 20 s";
    std::ofstream(done).flush();
  };
  handlers.on_exit = [&](const WorkerExit& exit) {
    events.push_back(std::to_string(exit.rank) + ":exit");
  };
  EXPECT_TRUE(group.wait(handlers).success);
  const auto last = std::find(events.begin(), events.end(), "1:last");
  const auto exit = std::find(events.begin(), events.end(), "1:exit");
  ASSERT_NE(last, events.end());
  ASSERT_NE(exit, events.end());
  EXPECT_LT(last - events.begin(), exit - events.begin())
      << "rank 1's exit was handled before its last message";
  std::filesystem::remove_all(dir);
}

TEST(WorkerGroup, DestructorStopsRunningWorkers) {
  std::vector<int> pids;
  {
    WorkerGroup group(shell(2, "exec sleep 60"));
    group.start();
    pids = group.pids();
    for (int pid : pids) EXPECT_TRUE(process_alive(pid));
  }
  for (int pid : pids) EXPECT_FALSE(process_alive(pid)) << pid;
}

// A worker left for later (cohort launch's job host) does not run until restart() starts it, and
// counts as ended cleanly while it never does.
TEST(WorkerGroup, AWorkerStartedLaterRunsOnlyWhenStarted) {
  auto options = shell(2, "echo \"ran $RANK\"");
  options.rank_env = [](int rank) {
    return std::map<std::string, std::string>{{"RANK", std::to_string(rank)}};
  };
  options.started_later = [](int rank) { return rank == 1; };
  options.rank_name = [](int rank) { return rank == 1 ? "the job host" : "rank 0"; };
  {
    WorkerGroup group(options);
    group.start();
    EXPECT_EQ(group.pids()[1], -1);
    std::vector<std::string> lines;
    WorkerGroupHandlers handlers;
    handlers.on_output = [&](int rank, int, bool, const std::string& line) {
      lines.push_back(std::to_string(rank) + ":" + line);
    };
    const auto outcome = group.wait(handlers);
    EXPECT_TRUE(outcome.success) << outcome.failure_reason;
    EXPECT_EQ(lines, std::vector<std::string>{"0:ran 0"});
  }
  WorkerGroup group(options);
  group.start();
  std::vector<std::string> lines;
  bool started = false;
  WorkerGroupHandlers handlers;
  handlers.on_output = [&](int rank, int, bool, const std::string& line) {
    lines.push_back(std::to_string(rank) + ":" + line);
  };
  handlers.on_tick = [&] {
    if (started) return;
    started = true;
    group.restart(1, {});
    EXPECT_GT(group.pids()[1], 0);
  };
  const auto outcome = group.wait(handlers);
  EXPECT_TRUE(outcome.success) << outcome.failure_reason;
  std::sort(lines.begin(), lines.end());
  EXPECT_EQ(lines, (std::vector<std::string>{"0:ran 0", "1:ran 1"}));
  EXPECT_EQ(outcome.exits.at(1).name, "the job host");
}

TEST(WorkerGroup, RejectsZeroWorkers) { EXPECT_THROW(WorkerGroup(shell(0, "true")), UsageError); }

}  // namespace
}  // namespace cohort::runtime

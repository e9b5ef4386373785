#include "support/local_group.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <iostream>
#include <memory>
#include <thread>

#include "support/subprocess.h"

namespace cohort::testing {

void run_ranks(int world, const std::function<void(comm::ProcessGroup&)>& fn,
               comm::ProcessGroupOptions options) {
  auto server = comm::Store::connect({.is_server = true, .timeout = std::chrono::seconds(20)});
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(world);
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        auto store =
            comm::Store::connect({.port = server.port(), .timeout = std::chrono::seconds(20)});
        auto group = comm::ProcessGroup::create(store, rank, world, options);
        fn(group);
      } catch (...) {
        errors[rank] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

void run_rank_processes(int world, const std::function<void(comm::ProcessGroup&)>& fn,
                        comm::ProcessGroupOptions options) {
  // Which call of the test this is: a copy runs the one it was started for.
  static int calls = 0;
  const int call = calls++;
  if (const char* rank_env = std::getenv("COHORT_TEST_RANK")) {
    if (std::atoi(std::getenv("COHORT_TEST_CALL")) != call) return;
    const int rank = std::atoi(rank_env);
    int code = 0;
    try {
      auto store = comm::Store::connect({.port = std::atoi(std::getenv("COHORT_TEST_STORE_PORT")),
                                         .timeout = std::chrono::seconds(20)});
      auto group = comm::ProcessGroup::create(store, rank, world, options);
      fn(group);
      if (::testing::Test::HasFailure()) code = 1;
    } catch (const std::exception& e) {
      std::cerr << "rank " << rank << ": " << e.what() << std::endl;
      code = 1;
    }
    std::cout.flush();
    std::cerr.flush();
    std::_Exit(code);
  }
  const auto* test = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string filter =
      std::string("--gtest_filter=") + test->test_suite_name() + "." + test->name();
  char exe[4096];
  const ssize_t length = ::readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  ASSERT_GT(length, 0) << "cannot read /proc/self/exe";
  exe[length] = 0;
  auto server = comm::Store::connect({.is_server = true, .timeout = std::chrono::seconds(20)});
  std::vector<std::unique_ptr<Process>> ranks;
  for (int rank = 0; rank < world; ++rank) {
    ranks.push_back(
        std::make_unique<Process>(std::vector<std::string>{exe, filter},
                                  std::map<std::string, std::string>{
                                      {"COHORT_TEST_RANK", std::to_string(rank)},
                                      {"COHORT_TEST_CALL", std::to_string(call)},
                                      {"COHORT_TEST_STORE_PORT", std::to_string(server.port())}}));
  }
  for (int rank = 0; rank < world; ++rank) {
    const auto result = ranks[rank]->wait(std::chrono::seconds(120));
    EXPECT_TRUE(result.exit_code == 0 && !result.timed_out)
        << "rank " << rank << " of " << world
        << (result.timed_out ? " timed out"
                             : " exited with code " + std::to_string(result.exit_code))
        << ":\n"
        << result.output;
  }
}

}  // namespace cohort::testing

// Test main. Tests that use cohort::Trainer (or tune::Tuner) start workers (and trials) by
// re-executing this test binary; in such a process only the test that started it runs, up to its
// fit(), which runs the worker's loop (or the trial) and ends the process.
#include <gtest/gtest.h>

#include <cstdlib>

#include <unistd.h>

#include <string>

#include "cohort/runtime/worker_info.h"
#include "support/tiny_mnist.h"

namespace {

constexpr const char* kTestVar = "COHORT_TEST_CASE";

class PublishCurrentTest : public testing::EmptyTestEventListener {
  void OnTestStart(const testing::TestInfo& info) override {
    std::string name = std::string(info.test_suite_name()) + "." + info.name();
    setenv(kTestVar, name.c_str(), 1);
  }
};

}  // namespace

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  if (!cohort::runtime::spawned_role().empty()) {
    const char* name = std::getenv(kTestVar);
    testing::GTEST_FLAG(filter) = name ? name : "-*";
  } else {
    setenv(cohort::testing::kTestRootPidVar, std::to_string(::getpid()).c_str(), 1);
    testing::UnitTest::GetInstance()->listeners().Append(new PublishCurrentTest);
  }
  return RUN_ALL_TESTS();
}

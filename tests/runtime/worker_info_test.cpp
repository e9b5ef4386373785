#include "cohort/runtime/worker_info.h"

#include <gtest/gtest.h>

#include <cstdlib>

#include "cohort/error.h"
#include "support/expect.h"

namespace cohort::runtime {
namespace {

class WorkerInfoTest : public ::testing::Test {
 protected:
  const std::vector<const char*> vars{"RANK",       "WORLD_SIZE", "LOCAL_RANK",  "LOCAL_WORLD_SIZE",
                                      "NODE_RANK",  "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"};
  std::map<std::string, std::string> saved;
  void SetUp() override {
    for (auto* v : vars) {
      if (const char* value = std::getenv(v)) saved[v] = value;
      unsetenv(v);
    }
  }
  void TearDown() override {
    for (auto* v : vars) unsetenv(v);
    for (auto& [k, v] : saved) setenv(k.c_str(), v.c_str(), 1);
  }
  void set(std::map<std::string, std::string> values) {
    for (auto& [k, v] : values) setenv(k.c_str(), v.c_str(), 1);
  }
  void expect_error(const std::string& fragment) {
    cohort::testing::expect_error<UsageError>([] { worker_info_from_env(); }, fragment);
  }
};

TEST_F(WorkerInfoTest, AbsentWhenNotLaunched) { EXPECT_FALSE(worker_info_from_env().has_value()); }

TEST_F(WorkerInfoTest, ReadsTorchrunVariables) {
  set({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"},
       {"GROUP_RANK", "1"}, {"MASTER_ADDR", "10.1.2.3"}, {"MASTER_PORT", "29500"}});
  auto info = worker_info_from_env();
  ASSERT_TRUE(info);
  EXPECT_EQ(info->world_rank, 3);
  EXPECT_EQ(info->world_size, 4);
  EXPECT_EQ(info->local_rank, 1);
  EXPECT_EQ(info->local_world_size, 2);
  EXPECT_EQ(info->node_rank, 1);
  EXPECT_EQ(info->master_addr, "10.1.2.3");
  EXPECT_EQ(info->master_port, 29500);
  // And back: what a spawner hands its children parses to the same thing.
  for (auto& [k, v] : worker_env(*info)) setenv(k.c_str(), v.c_str(), 1);
  auto again = worker_info_from_env();
  EXPECT_EQ(again->world_rank, 3);
  EXPECT_EQ(again->node_rank, 1);
}

TEST_F(WorkerInfoTest, InconsistentVariablesAreNamed) {
  set({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}});
  expect_error("RANK=2 must be < WORLD_SIZE=2");
  set({{"RANK", "0"}, {"WORLD_SIZE", "x"}});
  expect_error("WORLD_SIZE='x' is not an integer");
  unsetenv("MASTER_ADDR");
  set({{"RANK", "0"}, {"WORLD_SIZE", "2"}});
  expect_error("MASTER_ADDR is not set");
  unsetenv("WORLD_SIZE");
  expect_error("RANK is set but WORLD_SIZE is not");
}

}  // namespace
}  // namespace cohort::runtime

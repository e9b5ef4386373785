#include "cohort/runtime/worker_info.h"

#include <gtest/gtest.h>

#include <cstdlib>

#include "cohort/error.h"
#include "support/expect.h"

namespace cohort::runtime {
namespace {

class WorkerInfoTest : public ::testing::Test {
 protected:
  const std::vector<const char*> vars{"RANK",
                                      "WORLD_SIZE",
                                      "LOCAL_RANK",
                                      "LOCAL_WORLD_SIZE",
                                      "NODE_RANK",
                                      "GROUP_RANK",
                                      "MASTER_ADDR",
                                      "MASTER_PORT",
                                      "TORCHELASTIC_RUN_ID",
                                      "TORCHELASTIC_RESTART_COUNT",
                                      "TORCHELASTIC_USE_AGENT_STORE",
                                      "OMPI_COMM_WORLD_RANK",
                                      "OMPI_COMM_WORLD_SIZE",
                                      "OMPI_COMM_WORLD_LOCAL_RANK",
                                      "OMPI_COMM_WORLD_LOCAL_SIZE",
                                      "OMPI_COMM_WORLD_NODE_RANK",
                                      "OMPI_MCA_ess_base_jobid",
                                      "PMIX_NAMESPACE",
                                      "SLURM_PROCID",
                                      "SLURM_STEP_NUM_TASKS",
                                      "SLURM_LOCALID",
                                      "SLURM_NODEID",
                                      "SLURM_STEP_TASKS_PER_NODE",
                                      "SLURM_JOB_ID",
                                      "SLURM_STEP_ID",
                                      "SLURM_STEP_NODELIST",
                                      "SLURM_JOB_NODELIST",
                                      "SLURM_RESTART_COUNT",
                                      kJobIdVar,
                                      kLauncherVar,
                                      kRestartRoundVar,
                                      kStoreOnLauncherVar,
                                      kStorePortVar,
                                      kDataMembersVar,
                                      kDataMemberVar,
                                      kTrainRanksVar,
                                      kDataDatasetVar,
                                      kDataShardVar,
                                      kJobSecretVar,
                                      kJobSecretFileVar,
                                      kInsecureVar,
                                      kRoleVar};
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

// The job secret comes one way: the variable, a private file, or none at all (COHORT_INSECURE=1);
// two ways at once, a short secret or a wrong value are named with the fix.
TEST_F(WorkerInfoTest, TheJobSecretComesOneWayAndIsChecked) {
  EXPECT_FALSE(job_secret_from_env().has_value());
  set({{kJobSecretVar, "a secret of this job"}});
  EXPECT_EQ(job_secret_from_env()->text(), "a secret of this job");
  set({{kJobSecretFileVar, "/nonexistent/secret"}});
  cohort::testing::expect_error<UsageError>(
      [] { job_secret_from_env(); },
      "COHORT_JOB_SECRET and COHORT_JOB_SECRET_FILE are both set: give the job's secret one way");
  unsetenv(kJobSecretFileVar);
  set({{kInsecureVar, "1"}});
  cohort::testing::expect_error<UsageError>([] { job_secret_from_env(); },
                                            "COHORT_INSECURE=1 with COHORT_JOB_SECRET set");
  unsetenv(kJobSecretVar);
  EXPECT_TRUE(job_secret_from_env()->empty());
  set({{kInsecureVar, "yes"}});
  cohort::testing::expect_error<UsageError>([] { job_secret_from_env(); },
                                            "COHORT_INSECURE='yes': give 1 or 0");
  unsetenv(kInsecureVar);
  set({{kJobSecretVar, "too short"}});
  cohort::testing::expect_error<UsageError>(
      [] { job_secret_from_env(); },
      "COHORT_JOB_SECRET holds a secret of 9 bytes; a job secret needs at least 16");
}

TEST_F(WorkerInfoTest, ReadsTorchrunVariables) {
  set({{"RANK", "3"},
       {"WORLD_SIZE", "4"},
       {"LOCAL_RANK", "1"},
       {"LOCAL_WORLD_SIZE", "2"},
       {"GROUP_RANK", "1"},
       {"MASTER_ADDR", "10.1.2.3"},
       {"MASTER_PORT", "29500"}});
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

// cohort's own integer variables are checked as torchrun's are (they were read with atoi: "2x"
// was 2 and "x" 0).
TEST_F(WorkerInfoTest, IntegerVariablesAreWholeNumbersOrNamed) {
  EXPECT_EQ(env_int(kDataMembersVar, 7, 0), 7);  // unset: the fallback
  set({{kDataMembersVar, "3"}});
  EXPECT_EQ(env_int(kDataMembersVar, 0, 0), 3);
  set({{kDataMembersVar, "2x"}});
  cohort::testing::expect_error<UsageError>([] { env_int(kDataMembersVar, 0, 0); },
                                            "COHORT_DATA_MEMBERS='2x' is not an integer");
  set({{kDataMembersVar, "-1"}});
  cohort::testing::expect_error<UsageError>([] { env_int(kDataMembersVar, 0, 0); },
                                            "COHORT_DATA_MEMBERS=-1 must be >= 0");
}

// A data worker of cohort launch reads its store and its ranks' count through runtime/, checked
// (the train layer read them with its own parser, and the shard with sscanf: "1/2x" was 1 of 2).
TEST_F(WorkerInfoTest, ADataWorkersVariablesAreCheckedAndNamed) {
  EXPECT_FALSE(data_member_from_env().has_value());
  set({{kDataMemberVar, "1"},
       {"MASTER_ADDR", "node0"},
       {kStorePortVar, "29400"},
       {kTrainRanksVar, "4"},
       {kRestartRoundVar, "2"},
       {kJobIdVar, "job7"}});
  const auto member = data_member_from_env();
  ASSERT_TRUE(member.has_value());
  EXPECT_EQ(member->member, 1);
  EXPECT_EQ(member->job.master_addr, "node0");
  EXPECT_EQ(member->job.store_port, 29400);
  EXPECT_EQ(member->job.train_ranks, 4);
  EXPECT_EQ(member->job.restart_round, 2);
  EXPECT_EQ(member->job.job_id, "job7");
  // The job host finds its job the same way, and takes its ranks as its number of workers.
  const auto host = job_host_from_env();
  EXPECT_EQ(host.master_addr, "node0");
  EXPECT_EQ(host.train_ranks, 4);
  EXPECT_EQ(host.restart_round, 2);
  EXPECT_FALSE(launched_world_size().has_value());  // a data worker holds no rank
  set({{kRoleVar, kJobHostRole}});
  EXPECT_EQ(launched_world_size(), 4);
  unsetenv(kRoleVar);
  set({{"RANK", "1"}, {"WORLD_SIZE", "3"}, {"MASTER_PORT", "29500"}});
  EXPECT_EQ(launched_world_size(), 3);
  for (const char* v : {"RANK", "WORLD_SIZE", "MASTER_PORT"}) unsetenv(v);
  set({{kStorePortVar, "70000"}});
  cohort::testing::expect_error<UsageError>([] { data_member_from_env(); },
                                            "COHORT_STORE_PORT=70000 is not a port");
  set({{kStorePortVar, "29400"}, {kTrainRanksVar, "four"}});
  cohort::testing::expect_error<UsageError>([] { data_member_from_env(); },
                                            "COHORT_TRAIN_RANKS='four' is not an integer");
  unsetenv(kTrainRanksVar);
  cohort::testing::expect_error<UsageError>([] { data_member_from_env(); },
                                            "must be set: start data workers with cohort launch");
  cohort::testing::expect_error<UsageError>([] { job_host_from_env(); },
                                            "must be set: start the job host with cohort launch");

  set({{kDataDatasetVar, "train"}, {kDataShardVar, "1/3"}});
  const auto shard = data_shard_from_env();
  EXPECT_EQ(shard.dataset, "train");
  EXPECT_EQ(shard.rank, 1);
  EXPECT_EQ(shard.shards, 3);
  for (const char* bad : {"1/2x", "3/3", "-1/2", "1", "/2", "a/b"}) {
    set({{kDataShardVar, bad}});
    cohort::testing::expect_error<UsageError>(
        [] { data_shard_from_env(); },
        std::string("COHORT_DATA_SHARD is '") + bad + "', not the rank's shard as r/n");
  }
  unsetenv(kDataDatasetVar);
  cohort::testing::expect_error<UsageError>([] { data_shard_from_env(); },
                                            "COHORT_DATA_DATASET is not set");
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

TEST_F(WorkerInfoTest, NothingIsDetectedInAPlainStart) {
  EXPECT_FALSE(detect_launch().has_value());
}

TEST_F(WorkerInfoTest, DetectsTorchrunWithItsAgentStore) {
  set({{"RANK", "1"},
       {"WORLD_SIZE", "2"},
       {"LOCAL_RANK", "1"},
       {"LOCAL_WORLD_SIZE", "2"},
       {"MASTER_ADDR", "10.0.0.1"},
       {"MASTER_PORT", "29500"},
       {"TORCHELASTIC_RUN_ID", "exp7"},
       {"TORCHELASTIC_RESTART_COUNT", "2"},
       {"TORCHELASTIC_USE_AGENT_STORE", "True"}});
  auto info = detect_launch();
  ASSERT_TRUE(info);
  EXPECT_EQ(info->launcher, "torchrun");
  EXPECT_EQ(info->job_id, "exp7");
  EXPECT_EQ(info->restart_round, 2);
  // The agent's c10d store holds MASTER_PORT: rank 0 serves cohort's next to it.
  EXPECT_EQ(info->store_port, 29501);
  EXPECT_FALSE(info->store_on_launcher);
}

TEST_F(WorkerInfoTest, DetectsOpenMpi) {
  set({{"OMPI_COMM_WORLD_RANK", "1"},
       {"OMPI_COMM_WORLD_SIZE", "2"},
       {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
       {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
       {"OMPI_COMM_WORLD_NODE_RANK", "0"},
       {"OMPI_MCA_ess_base_jobid", "123456"}});
  auto info = detect_launch();
  ASSERT_TRUE(info);
  EXPECT_EQ(info->launcher, "openmpi");
  EXPECT_EQ(info->world_rank, 1);
  EXPECT_EQ(info->world_size, 2);
  EXPECT_EQ(info->local_rank, 1);
  EXPECT_EQ(info->master_addr, "127.0.0.1");  // every rank on this host
  EXPECT_EQ(info->master_port, 15000 + 123456 % 10000);
  EXPECT_EQ(info->job_id, "openmpi-123456");
  // Open MPI 5 names its job only in PMIX_NAMESPACE: two jobs on one host get different ports.
  unsetenv("OMPI_MCA_ess_base_jobid");
  set({{"PMIX_NAMESPACE", "prterun-vm-11490@1"}});
  EXPECT_EQ(detect_launch()->master_port, 15000 + 114901 % 10000);
  EXPECT_EQ(detect_launch()->job_id, "openmpi-prterun-vm-11490@1");
  set({{"PMIX_NAMESPACE", "prterun-vm-11502@1"}});
  EXPECT_NE(detect_launch()->master_port, 15000 + 114901 % 10000);
  // Across hosts there is no address to guess.
  set({{"OMPI_COMM_WORLD_LOCAL_SIZE", "1"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}});
  cohort::testing::expect_error<UsageError>([] { detect_launch(); }, "mpirun -x MASTER_ADDR=");
  set({{"OMPI_COMM_WORLD_RANK", "2"}});
  cohort::testing::expect_error<UsageError>(
      [] { detect_launch(); }, "OMPI_COMM_WORLD_RANK=2 must be < OMPI_COMM_WORLD_SIZE=2");
}

TEST_F(WorkerInfoTest, DetectsSlurm) {
  set({{"SLURM_PROCID", "5"},
       {"SLURM_STEP_NUM_TASKS", "7"},
       {"SLURM_LOCALID", "1"},
       {"SLURM_NODEID", "2"},
       {"SLURM_STEP_TASKS_PER_NODE", "2(x3),1"},
       {"SLURM_JOB_ID", "4242"},
       {"SLURM_STEP_ID", "0"},
       {"SLURM_STEP_NODELIST", "gpu[07-09],cpu1"}});
  auto info = detect_launch();
  ASSERT_TRUE(info);
  EXPECT_EQ(info->launcher, "slurm");
  EXPECT_EQ(info->world_rank, 5);
  EXPECT_EQ(info->world_size, 7);
  EXPECT_EQ(info->local_rank, 1);
  EXPECT_EQ(info->node_rank, 2);
  EXPECT_EQ(info->local_world_size, 2);
  EXPECT_EQ(info->master_addr, "gpu07");
  EXPECT_EQ(info->master_port, 15000 + 4242);
  EXPECT_EQ(info->job_id, "slurm-4242.0");
  set({{"MASTER_ADDR", "10.9.8.7"}, {"MASTER_PORT", "23456"}});
  EXPECT_EQ(detect_launch()->master_addr, "10.9.8.7");
  EXPECT_EQ(detect_launch()->master_port, 23456);
  set({{"SLURM_PROCID", "7"}});
  cohort::testing::expect_error<UsageError>([] { detect_launch(); },
                                            "SLURM_PROCID=7 must be < SLURM_STEP_NUM_TASKS=7");
}

TEST_F(WorkerInfoTest, ParsesSlurmListsAndTaskCounts) {
  EXPECT_EQ(first_slurm_host("node1"), "node1");
  EXPECT_EQ(first_slurm_host("node[07-09,12],gpu1"), "node07");
  EXPECT_EQ(first_slurm_host("rack[3,5]-n[1-4]"), "rack3-n1");
  EXPECT_EQ(first_slurm_host("a,b"), "a");
  EXPECT_EQ(slurm_tasks_on_node("2(x3),1", 0), 2);
  EXPECT_EQ(slurm_tasks_on_node("2(x3),1", 2), 2);
  EXPECT_EQ(slurm_tasks_on_node("2(x3),1", 3), 1);
  EXPECT_EQ(slurm_tasks_on_node("4", 0), 4);
  cohort::testing::expect_error<UsageError>([] { slurm_tasks_on_node("2(x3),1", 4); },
                                            "no entry for node 4");
}

}  // namespace
}  // namespace cohort::runtime

#include "train/async_checkpoint.h"

#include <gtest/gtest.h>

#include <fstream>

#include "cohort/error.h"
#include "support/expect.h"
#include "support/tiny_mnist.h"
#include "train/run_files.h"

namespace cohort::train {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

// Two ranks' saves of one report, as the session makes them: each rank's files captured in its
// writer's memory, one staging folder in the run directory, rank 0's commit of both.
class AsyncCheckpoint : public ::testing::Test {
 protected:
  void TearDown() override { remove_tree(dir); }

  // `rank` captures one file named after it, as a save function writes it.
  void capture(AsyncCheckpointWriter& writer, int rank) {
    const auto root = dir / ("report-rank" + std::to_string(rank));
    FileCapture capture(root, writer.captured());
    write_atomically(root / "optimizer" / ("shard-" + std::to_string(rank) + ".bin"),
                     "state of rank " + std::to_string(rank));
  }

  AsyncCheckpointWriter::Job job_of(AsyncCheckpointWriter& writer, int rank) {
    capture(writer, rank);
    AsyncCheckpointWriter::Job job{.has_files = true,
                                   .staging = dir / ".staging" / "token-1",
                                   .keys = "async-checkpoint/token/1/",
                                   .rank = rank,
                                   .umask = 077,
                                   .report_index = 1};
    if (rank == 0) {
      job.commit = AsyncCheckpointWriter::Commit{.meta = {{"metrics", {{"steps", 5}}}},
                                                 .final_path = final_path,
                                                 .ranks = {0, 1},
                                                 .message = {{"type", "checkpoint"}}};
    }
    return job;
  }

  std::filesystem::path dir = cohort::testing::temp_dir("async_checkpoint");
  std::filesystem::path final_path = dir / "checkpoint_000001";
  comm::Store store = comm::Store::connect({.is_server = true, .timeout = seconds(20)});
};

// What a save writes under the capture's root stays in memory, a buffer per file kept for the
// next capture (which drops the files it does not write again); a file elsewhere is written.
TEST_F(AsyncCheckpoint, ACaptureKeepsTheFilesUnderItsRootInMemory) {
  CapturedFiles captured;
  const auto root = dir / "report";
  {
    FileCapture capture(root, captured);
    write_atomically(root / "model.safetensors", std::string(1000, 'm'));
    write_atomically(root / "sub" / ".." / "optimizer.pt", "state");
    write_atomically(dir / "elsewhere.json", "{}");
  }
  EXPECT_FALSE(std::filesystem::exists(root));
  EXPECT_TRUE(std::filesystem::exists(dir / "elsewhere.json"));
  auto files = captured.files();
  ASSERT_EQ(files.size(), 2u);
  EXPECT_EQ(files[0].first, "model.safetensors");
  EXPECT_EQ(*files[0].second, std::string(1000, 'm'));
  EXPECT_EQ(files[1].first, "optimizer.pt");
  const auto* buffer = files[0].second->data();
  {
    FileCapture capture(root, captured);
    write_atomically(root / "model.safetensors", std::string(900, 'n'));
  }
  files = captured.files();
  ASSERT_EQ(files.size(), 1u);
  EXPECT_EQ(*files[0].second, std::string(900, 'n'));
  EXPECT_EQ(files[0].second->data(), buffer);  // the same memory, reused
  std::filesystem::create_directories(root);
  write_atomically(root / "model.safetensors", "after");  // no capture now: to disk
  EXPECT_TRUE(std::filesystem::exists(root / "model.safetensors"));
}

// Rank 0 commits only once rank 1's files are in too: then the checkpoint holds both, with its
// meta.json and a manifest that verifies.
TEST_F(AsyncCheckpoint, TheCommitWaitsForEveryRanksFilesAndHoldsThemAll) {
  AsyncCheckpointWriter rank0(store, seconds(20)), rank1(store, seconds(20));
  auto job0 = job_of(rank0, 0), job1 = job_of(rank1, 1);
  EXPECT_FALSE(rank0.busy());
  rank0.start(job0);
  EXPECT_TRUE(rank0.busy());  // what SaveOptions::skip_when_busy asks every rank
  EXPECT_FALSE(std::filesystem::exists(final_path));  // rank 1's files are not in
  EXPECT_THROW(rank0.start({}), RuntimeError);        // one save in flight at most
  rank1.start(job1);
  rank1.wait();
  rank0.wait();
  ASSERT_TRUE(std::filesystem::is_directory(final_path));
  EXPECT_TRUE(std::filesystem::exists(final_path / "optimizer" / "shard-0.bin"));
  EXPECT_TRUE(std::filesystem::exists(final_path / "optimizer" / "shard-1.bin"));
  EXPECT_EQ(read_json(final_path / kMetaFile)["metrics"]["steps"], 5);
  verify_manifest(final_path);
  EXPECT_FALSE(std::filesystem::exists(job0.staging));
  EXPECT_EQ(store.remove_prefix(job0.keys), 0);  // its keys went with the commit
  EXPECT_EQ(rank0.wait(), 0.0);                  // nothing in flight
  EXPECT_FALSE(rank0.busy());
}

// A loop that ends (fails) while its save waits for a rank that never comes: the save stops at
// once, and nothing is committed (the previous checkpoint stays the latest).
TEST_F(AsyncCheckpoint, AnAbandonedSaveIsNeverCommitted) {
  const auto start = std::chrono::steady_clock::now();
  {
    AsyncCheckpointWriter rank0(store, seconds(60));
    rank0.start(job_of(rank0, 0));
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, seconds(10));
  EXPECT_FALSE(std::filesystem::exists(final_path));
}

// A rank that cannot write its files (here: its staging folder's place is a file) fails its own
// wait() naming the report, and rank 0's names that rank: nothing is committed.
TEST_F(AsyncCheckpoint, ARanksFailureIsNamedAndNothingIsCommitted) {
  AsyncCheckpointWriter rank0(store, seconds(20)), rank1(store, seconds(20));
  auto job1 = job_of(rank1, 1);
  job1.staging = dir / "a-file";
  write_atomically(job1.staging, "not a folder");
  rank0.start(job_of(rank0, 0));
  rank1.start(job1);
  cohort::testing::expect_error<RuntimeError>(
      [&] { rank1.wait(); },
      "the asynchronous checkpoint of report #1 failed on rank 1: could not write its files into");
  cohort::testing::expect_error<RuntimeError>([&] { rank0.wait(); },
                                              "rank 1 could not write its files into");
  EXPECT_FALSE(std::filesystem::exists(final_path));
}

// A rank that never writes its files fails rank 0's save at the deadline, naming it.
TEST_F(AsyncCheckpoint, ARankThatNeverWritesIsNamedAtTheDeadline) {
  AsyncCheckpointWriter rank0(store, milliseconds(500));
  rank0.start(job_of(rank0, 0));
  cohort::testing::expect_error<TimeoutError>(
      [&] { rank0.wait(); },
      "ranks [1] did not write their files within 500 ms; the checkpoint is not committed");
  EXPECT_FALSE(std::filesystem::exists(final_path));
}

}  // namespace
}  // namespace cohort::train

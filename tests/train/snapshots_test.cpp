#include "train/snapshots.h"

#include <gtest/gtest.h>

#include <fstream>

#include "cohort/json.h"
#include "support/tiny_mnist.h"
#include "train/run_files.h"

namespace cohort::train {
namespace {

// Each rank's buddy keeps the copy of its files: on a single node the next rank, across nodes the
// rank at the same place on the next node, so that losing one node leaves every file somewhere.
TEST(SnapshotBuddies, AreOnAnotherNodeWhenTheJobSpansNodes) {
  EXPECT_EQ(snapshot_buddies({0}), std::vector<int>({-1}));
  EXPECT_EQ(snapshot_buddies({0, 0, 0, 0}), std::vector<int>({1, 2, 3, 0}));
  EXPECT_EQ(snapshot_buddies({0, 0, 1, 1}), std::vector<int>({2, 3, 0, 1}));
  EXPECT_EQ(snapshot_buddies({0, 0, 1, 1, 2, 2}), std::vector<int>({2, 3, 4, 5, 0, 1}));
  // Uneven nodes: every rank still has a buddy elsewhere.
  const auto uneven = snapshot_buddies({0, 0, 0, 1});
  EXPECT_EQ(uneven, std::vector<int>({3, 3, 3, 0}));
}

HeldSnapshot held(const std::string& name, int64_t saved_ns, std::vector<int> own,
                  std::vector<int> copies, int world = 4) {
  return {.name = name,
          .saved_ns = saved_ns,
          .world_size = world,
          .steps = saved_ns * 10,
          .own = std::move(own),
          .copies = std::move(copies)};
}

// The newest snapshot that every rank's node holds whole, and newer than the disk's, is chosen;
// what cannot be used is said, with the ranks it lacks.
TEST(ChooseSnapshot, TakesTheNewestThatEveryNodeHoldsWhole) {
  // One node, four ranks, two snapshots: the newer.
  const std::vector<HeldSnapshot> node{held("snapshot_a_2", 20, {0, 1, 2, 3}, {0, 1, 2, 3}),
                                       held("snapshot_a_1", 10, {0, 1, 2, 3}, {0, 1, 2, 3})};
  auto choice = choose_snapshot({node, node, node, node}, 1, 5);
  ASSERT_TRUE(choice.snapshot);
  EXPECT_EQ(choice.snapshot->name, "snapshot_a_2");
  EXPECT_NE(choice.why.find("snapshot_a_2 (step 200)"), std::string::npos) << choice.why;
  // A checkpoint on disk newer than both: the disk, and nothing to say.
  choice = choose_snapshot({node, node, node, node}, 1, 30);
  EXPECT_FALSE(choice.snapshot);
  EXPECT_EQ(choice.why, "");
  // No checkpoint on disk at all: the snapshot.
  EXPECT_TRUE(choose_snapshot({node, node, node, node}, 0, std::nullopt).snapshot);
}

TEST(ChooseSnapshot, UsesBuddyCopiesAndSaysWhenTheSurvivorsLackFiles) {
  // Two nodes of two ranks each: each holds its own ranks' files and copies of the other's.
  const std::vector<HeldSnapshot> first{held("snapshot_a_1", 10, {0, 1}, {2, 3})};
  const std::vector<HeldSnapshot> second{held("snapshot_a_1", 10, {2, 3}, {0, 1})};
  auto choice = choose_snapshot({first, first, second, second}, 2, 1);
  ASSERT_TRUE(choice.snapshot);
  EXPECT_EQ(choice.snapshot->own, std::vector<int>({2, 3}));
  EXPECT_NE(choice.why.find("rank 2's node with the buddy copies of ranks [0, 1]"),
            std::string::npos)
      << choice.why;
  // The second node lost, the group restarted on the first alone: still whole there.
  EXPECT_TRUE(choose_snapshot({first, first}, 0, 1).snapshot);
  // A node whose copies were never written: the disk, naming the ranks nobody holds.
  const std::vector<HeldSnapshot> partial{held("snapshot_a_1", 10, {0, 1}, {})};
  choice = choose_snapshot({partial, partial}, 0, 1);
  EXPECT_FALSE(choice.snapshot);
  EXPECT_NE(choice.why.find("no surviving node holds the files of ranks [2, 3]"), std::string::npos)
      << choice.why;
  EXPECT_NE(choice.why.find("restoring from the latest checkpoint on disk"), std::string::npos)
      << choice.why;
  // Whole only across nodes (three nodes, one lost): not restored from, and said so.
  const std::vector<HeldSnapshot> a{held("snapshot_a_1", 10, {0, 1}, {4, 5}, 6)};
  const std::vector<HeldSnapshot> b{held("snapshot_a_1", 10, {2, 3}, {0, 1}, 6)};
  choice = choose_snapshot({a, a, b, b}, 0, std::nullopt);
  EXPECT_FALSE(choice.snapshot);
  EXPECT_NE(choice.why.find("do not each hold every rank's files"), std::string::npos)
      << choice.why;
}

// A node's snapshot folder as the writers leave it, read back; a rank whose own files are gone is
// restored from its buddy's copy, into a checkpoint folder with a manifest that verifies.
TEST(SnapshotFolder, RestoresLostOwnFilesFromTheBuddyCopies) {
  const auto run = testing::temp_dir("snapshots") / "run-0123";
  const auto snap = run / "snapshot_tok_3";
  const auto put = [](const std::filesystem::path& file, const std::string& text) {
    std::filesystem::create_directories(file.parent_path());
    write_atomically(file, text);
  };
  put(snap / kSnapshotCheckpointDir / "model.safetensors", "model of rank 0");
  put(snap / kSnapshotCheckpointDir / "optimizer" / "shard-1.pt", "shard of rank 1");
  put(snap / kSnapshotRanksDir / "0.json", R"(["model.safetensors"])");
  put(snap / kSnapshotRanksDir / "1.json", R"(["optimizer/shard-1.pt"])");
  put(snap / kSnapshotCopiesDir / "0" / "model.safetensors", "model of rank 0");
  put(snap / kSnapshotCopiesDir / "0.json", R"(["model.safetensors"])");
  put(snap / kSnapshotCopiesDir / "1" / "optimizer" / "shard-1.pt", "shard of rank 1");
  put(snap / kSnapshotCopiesDir / "1.json", R"(["optimizer/shard-1.pt"])");
  put(snap / kSnapshotCheckpointDir / kMetaFile,
      R"({"saved_ns": 42, "world_size": 2, "metrics": {"steps": 7}})");
  write_manifest(snap / kSnapshotCheckpointDir);
  // Half written (staging) and another run's leftovers are never taken.
  put(run / "staging_tok_4" / kSnapshotCheckpointDir / "model.safetensors", "half");

  auto found = held_snapshots(run);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].name, "snapshot_tok_3");
  EXPECT_EQ(found[0].saved_ns, 42);
  EXPECT_EQ(found[0].steps, 7);
  EXPECT_EQ(found[0].own, std::vector<int>({0, 1}));
  EXPECT_EQ(found[0].copies, std::vector<int>({0, 1}));
  // Every rank's own files here: the snapshot's checkpoint folder itself.
  EXPECT_EQ(snapshot_checkpoint(run, found[0], 0), snap / kSnapshotCheckpointDir);

  // Rank 1's own files lost (its node's, in a job across nodes): made from the copy.
  std::filesystem::remove(snap / kSnapshotCheckpointDir / "optimizer" / "shard-1.pt");
  std::filesystem::remove(snap / kSnapshotRanksDir / "1.json");
  found = held_snapshots(run);
  ASSERT_EQ(found[0].own, std::vector<int>({0}));
  const auto made = snapshot_checkpoint(run, found[0], 1);
  EXPECT_NE(made, snap / kSnapshotCheckpointDir);
  EXPECT_NO_THROW(verify_manifest(made));
  EXPECT_EQ(read_json(made / kMetaFile)["saved_ns"], 42);
  std::ifstream shard(made / "optimizer" / "shard-1.pt");
  std::string text;
  std::getline(shard, text);
  EXPECT_EQ(text, "shard of rank 1");

  // Pruning keeps the newest and drops other starts' staging folders, not this start's.
  put(run / "snapshot_tok_1" / kSnapshotCheckpointDir / kMetaFile,
      R"({"saved_ns": 1, "world_size": 2})");
  put(run / "staging_old_9" / "x", "crashed start's");
  prune_snapshots(run, 1, "tok");
  EXPECT_TRUE(std::filesystem::exists(snap));
  EXPECT_FALSE(std::filesystem::exists(run / "snapshot_tok_1"));
  EXPECT_FALSE(std::filesystem::exists(run / "staging_old_9"));
  EXPECT_TRUE(std::filesystem::exists(run / "staging_tok_4"));
  remove_tree(run.parent_path());
}

// The run's folder is named after its run directory, so that two runs of one name in different
// storage paths never share snapshots.
TEST(SnapshotFolder, IsOneRunsAlone) {
  const auto a = snapshot_run_folder("/dev/shm/x", "/tmp/a/run");
  EXPECT_EQ(a.parent_path(), "/dev/shm/x");
  EXPECT_EQ(a.filename().string().rfind("run-", 0), 0u);
  EXPECT_NE(a, snapshot_run_folder("/dev/shm/x", "/tmp/b/run"));
  EXPECT_EQ(a, snapshot_run_folder("/dev/shm/x", "/tmp/a/./run"));
}

}  // namespace
}  // namespace cohort::train

// A checkpoint's manifests as data (src/train/manifest.h): piece names read back only as written,
// and the reads of a tensor's range take each element from one piece, whatever the pieces'
// order and overlaps, so that a gap is seen as one.
#include "train/manifest.h"

#include <gtest/gtest.h>

#include <vector>

#include "cohort/error.h"
#include "support/expect.h"

namespace cohort::train::detail {
namespace {

TEST(Manifest, PieceNamesReadBackAsWritten) {
  const auto piece = parse_piece_name(piece_name("layers/0/weight", 4096));
  ASSERT_TRUE(piece.has_value());
  EXPECT_EQ(piece->tensor, "layers/0/weight");
  EXPECT_EQ(piece->offset, 4096);
  for (const char* name : {"weight", "w/", "w/-1", "w/007", "w/1e3", "w/9223372036854775808",
                           "w/99999999999999999999"}) {
    EXPECT_FALSE(parse_piece_name(name).has_value()) << name;
  }
  EXPECT_EQ(parse_piece_name("w/9223372036854775807")->offset, INT64_MAX);
}

TEST(Manifest, EachElementIsReadFromOnePiece) {
  // Out of order and overlapping: [0, 6) and [4, 10) fill [2, 9) once.
  const std::vector<PieceRange> pieces = {{4, 6}, {0, 6}};
  const auto reads = plan_piece_reads(pieces, 2, 7);
  ASSERT_EQ(reads.size(), 2u);
  EXPECT_EQ(reads[0].piece, 1u);
  EXPECT_EQ(reads[0].begin, 2);
  EXPECT_EQ(reads[0].end, 6);
  EXPECT_EQ(reads[1].piece, 0u);
  EXPECT_EQ(reads[1].begin, 6);
  EXPECT_EQ(reads[1].end, 9);
  // Two copies of one half cover half: the other half's elements are not counted twice over.
  int64_t covered = 0;
  for (const auto& r : plan_piece_reads({{0, 5}, {0, 5}}, 0, 10)) covered += r.end - r.begin;
  EXPECT_EQ(covered, 5);
  EXPECT_TRUE(plan_piece_reads({{0, 5}}, 5, 5).empty());
  cohort::testing::expect_error<UsageError>(
      [] {
        plan_piece_reads({{INT64_MAX - 1, 8}}, 0, 4);
      },
      "a piece of 8 elements at 9223372036854775806 is no range of a tensor");
}

TEST(Manifest, AManifestThatNamesFilesOutsideItsFolderIsRefused) {
  const Json entry = {{"size", 12}, {"crc32", "0badf00d"}};
  const auto entries =
      read_manifest_entries(Json{{"files", {{"zero-rank0-of-1.safetensors", entry}}}}, "m.json");
  ASSERT_EQ(entries.size(), 1u);
  EXPECT_EQ(entries[0].size, 12u);
  for (const char* name : {"../x", "/etc/passwd", "a/../../x", ""}) {
    cohort::testing::expect_error<UsageError>(
        [&] {
          read_manifest_entries(Json{{"files", {{name, entry}}}}, "m.json");
        },
        "m.json names '" + std::string(name) + "', which is no file inside the checkpoint");
  }
  cohort::testing::expect_error<UsageError>(
      [&] {
        read_manifest_entries(Json{{"files", {{"a", {{"size", -1}}}}}}, "m.json");
      },
      "m.json describes a without a size (an integer >= 0) and a crc32");
  cohort::testing::expect_error<UsageError>(
      [] {
        read_state_manifest(Json{{"format", kStateFormat}, {"files", Json::array()}, {"values", 3}},
                            "optimizer", "o.json");
      },
      "o.json holds values that are no object");
}

}  // namespace
}  // namespace cohort::train::detail

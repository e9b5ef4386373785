// A batch's columns as a preprocessing peer describes them: shared memory or inline bytes come
// back as the tensors sent, and a description that lies (offsets, sizes, shapes, types, the
// region's real size) is refused before any tensor is made over it.
#include "data/wire.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <torch/torch.h>
#include <unistd.h>

#include <string>
#include <utility>
#include <vector>

#include "cohort/error.h"
#include "support/expect.h"

namespace cohort::data {
namespace {

Block sample_block() {
  Block block;
  block.columns["image"] = torch::arange(24, torch::kFloat).view({2, 3, 4});
  block.columns["label"] = torch::tensor({7, 3}, torch::kLong);
  return block;
}

void expect_same(const Block& a, const Block& b) {
  ASSERT_EQ(a.columns.size(), b.columns.size());
  for (const auto& [name, column] : a.columns)
    EXPECT_TRUE(column.equal(b.columns.at(name))) << name;
}

TEST(Wire, ABatchComesBackThroughSharedMemoryAndInline) {
  const Block block = sample_block();
  size_t bytes = 0;
  const Json columns = wire::describe_block(block, bytes);
  expect_same(
      block, wire::map_block_memfd(wire::write_block_memfd(block, columns, bytes), columns, bytes));
  int pair[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair), 0);
  wire::write_block_inline(pair[0], block);
  expect_same(block,
              wire::read_block_inline(pair[1], columns, bytes, std::chrono::milliseconds(1000)));
  ::close(pair[0]);
  ::close(pair[1]);
}

TEST(Wire, AColumnThatDoesNotLieInsideItsBatchIsRefused) {
  const Block block = sample_block();
  size_t bytes = 0;
  const Json good = wire::describe_block(block, bytes);
  const auto altered = [&](const std::string& key, const Json& value) {
    Json columns = good;
    columns[0][key] = value;
    return columns;
  };
  const std::vector<std::pair<Json, std::string>> cases = {
      {altered("offset", bytes), "does not lie whole and aligned inside the batch's"},
      {altered("offset", 2), "does not lie whole and aligned"},
      {altered("bytes", 8), "its shape is not its size"},
      {altered("shape", Json::array({2, -3, 4})), "has the size -3, not a count"},
      {altered("shape", Json::array({uint64_t{1} << 62, 8})), "its shape is not its size"},
      {altered("dtype", "complex"), "has the unknown type 'complex'"},
      {Json::array({good[0], good[0]}),
       "column 'image' of a batch: a column needs a name of its own"},
      {altered("name", 5), "field 'name' is number"},
      {Json::object(), "a batch's 'columns' is no array"},
  };
  for (const auto& [columns, fragment] : cases) {
    cohort::testing::expect_error<std::exception>(
        [&] { wire::map_block_memfd(wire::write_block_memfd(block, good, bytes), columns, bytes); },
        fragment);
  }
  // Shared memory smaller than announced: its tensors would read past its end.
  cohort::testing::expect_error<RuntimeError>(
      [&] {
        wire::map_block_memfd(wire::write_block_memfd(block, good, bytes), good, bytes + 4096);
      },
      "passed shared memory of " + std::to_string(bytes) + " bytes for a batch of " +
          std::to_string(bytes + 4096));
  // A size past the cap is refused before a buffer is allocated for it.
  int pair[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair), 0);
  cohort::testing::expect_error<UsageError>(
      [&] {
        wire::read_block_inline(pair[1], good, size_t{1} << 40, std::chrono::milliseconds(100));
      },
      "a batch of 1099511627776 bytes, over the cap of 17179869184 (kMaxDataBlockBytes)");
  ::close(pair[0]);
  ::close(pair[1]);
}

}  // namespace
}  // namespace cohort::data

// The data plane's messages as data (src/data/wire_messages.h): what a worker or its consumer
// announces is refused, naming the field, before anything is allocated or run for it.
#include "data/wire_messages.h"

#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "cohort/error.h"
#include "support/expect.h"

namespace cohort::data::wire {
namespace {

TEST(WireMessages, ATaskNamesItsRowsAsIndexes) {
  const auto task =
      read_consumer_message(Json{{"type", "task"}, {"index", 3}, {"epoch", 1}, {"rows", {4, 0}}});
  EXPECT_EQ(task.index, 3);
  EXPECT_EQ(task.rows, (std::vector<int64_t>{4, 0}));
  EXPECT_EQ(read_consumer_message(Json{{"type", "refuse"}, {"reason", "r"}}).reason, "r");
  const std::vector<std::pair<Json, std::string>> cases = {
      {Json{{"type", "task"}, {"epoch", 1}, {"rows", {1}}},
       "a task must name its task and epoch (>= 0): 'index' is -1"},
      {Json{{"type", "task"}, {"index", 2}, {"epoch", 1}}, "task 2 has no array 'rows'"},
      {Json{{"type", "task"}, {"index", 2}, {"epoch", 1}, {"rows", {1, -5}}},
       "task 2 names the row -5, not an index"},
      {Json{{"type", "task"}, {"index", 2}, {"epoch", 1}, {"rows", {"1"}}},
       "task 2 names the row \"1\", not an index"},
      {Json{{"type", "task"}, {"index", "2"}}, "field 'index' is string"},
      {Json::array(), "a message must be a JSON object"},
  };
  for (const auto& [message, fragment] : cases)
    cohort::testing::expect_error<UsageError>([&] { read_consumer_message(message); }, fragment);
}

TEST(WireMessages, AResultNamesItsTaskAndCountsWithinTheCaps) {
  const auto result = read_worker_message(
      Json{{"type", "result"}, {"index", 0}, {"skipped_rows", 2}, {"payload_bytes", 64}});
  EXPECT_EQ(result.skipped_rows, 2);
  EXPECT_EQ(result.payload_bytes, 64u);
  const std::vector<std::pair<Json, std::string>> cases = {
      {Json{{"type", "result"}}, "a result must name its task: 'index' is -1"},
      {Json{{"type", "result"}, {"index", 0}, {"skipped_rows", -1}},
       "field 'skipped_rows' is -1, not a count"},
      {Json{{"type", "result"}, {"index", 0}, {"payload_bytes", uint64_t{1} << 40}},
       "a batch of 1099511627776 bytes, over the cap of 17179869184 (kMaxDataBlockBytes)"},
      {Json{{"type", "hello"}, {"pid", "7"}}, "field 'pid' is string"},
  };
  for (const auto& [message, fragment] : cases)
    cohort::testing::expect_error<UsageError>([&] { read_worker_message(message); }, fragment);
}

}  // namespace
}  // namespace cohort::data::wire

#include "cohort/comm/flight_recorder.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <future>
#include <mutex>

#include "cohort/comm/process_group.h"
#include "cohort/error.h"
#include "support/local_group.h"

namespace cohort::comm {
namespace {

using cohort::testing::run_ranks;

TEST(FlightRecorder, KeepsTheLastOperationsAndCountsTheDropped) {
  FlightRecorder recorder(3);
  recorder.add_group("pg", {0, 1});
  std::vector<int64_t> ids;
  for (int i = 1; i <= 5; ++i)
    ids.push_back(recorder.begin({.group = "pg", .seq = i, .op = "allreduce"}));
  EXPECT_EQ(ids, (std::vector<int64_t>{1, 2, 3, 4, 5}));
  recorder.end(ids[0], FlightState::kCompleted);  // dropped already: nothing
  recorder.end(ids[3], FlightState::kCompleted);
  recorder.end(ids[4], FlightState::kTimedOut);
  recorder.end(ids[4], FlightState::kCompleted);  // ended already: stays timed out
  const auto entries = recorder.entries();
  ASSERT_EQ(entries.size(), 3u);
  EXPECT_EQ(entries[0].id, 3);
  EXPECT_EQ(entries[0].state, FlightState::kStarted);
  EXPECT_EQ(entries[1].state, FlightState::kCompleted);
  EXPECT_EQ(entries[2].state, FlightState::kTimedOut);
  EXPECT_GE(entries[2].ended_s, entries[2].started_s);
  EXPECT_EQ(recorder.dropped(), 2);
  const Json json = recorder.to_json(1, "asked");
  EXPECT_EQ(json["rank"], 1);
  EXPECT_EQ(json["reason"], "asked");
  EXPECT_EQ(json["dropped"], 2);
  EXPECT_EQ(json["groups"]["pg"]["entered"], 5);
  EXPECT_EQ(json["groups"]["pg"]["ranks"], (std::vector<int>{0, 1}));
  EXPECT_EQ(json["entries"][2]["state"], "timed out");
}

// Two ranks of a real group: rank 1 leaves a collective out, rank 0's times out. Their records
// name that collective and what rank 1 did last.
TEST(FlightRecorder, AGroupRecordsItsCallsAndTheRecordsNameTheCallARankLeftOut) {
  std::mutex mutex;
  std::vector<Json> records(2);
  std::promise<void> rank0_done;
  auto done = rank0_done.get_future().share();
  run_ranks(2,
            [&](ProcessGroup& g) {
              std::vector<at::Tensor> t{torch::ones({3}), torch::ones({3})};
              g.allreduce(t);
              std::vector<at::Tensor> b{torch::zeros({2}, torch::kInt64)};
              g.broadcast(b, 0);
              at::Tensor x = torch::zeros({4});
              if (g.rank() == 0) g.send(x, 1, 7);
              if (g.rank() == 1) g.recv(x, 0, 7);
              // A sub-group records into its parent's recorder, under its own name.
              auto sub = g.new_group({0, 1});
              sub.barrier();
              if (g.rank() == 1) {
                done.wait();  // alive, but never enters the next all-reduce
              } else {
                std::vector<at::Tensor> y{torch::ones({5})};
                g.set_activity("step 3");
                EXPECT_THROW(g.allreduce(y), TimeoutError);
              }
              std::lock_guard lock(mutex);
              records[static_cast<size_t>(g.rank())] =
                  g.flight_recorder()->to_json(g.rank(), "test");
              if (g.rank() == 0) rank0_done.set_value();
            },
            {.timeout = std::chrono::milliseconds(500)});

  const Json& rank0 = records[0];
  ASSERT_EQ(rank0["entries"].size(), 5u) << rank0.dump(1);
  const Json& first = rank0["entries"][0];
  EXPECT_EQ(first["op"], "allreduce");
  EXPECT_EQ(first["dtype"], "Float");
  EXPECT_EQ(first["numel"], 3);
  EXPECT_EQ(first["tensors"], 2);
  EXPECT_EQ(first["seq"], 1);
  EXPECT_EQ(first["state"], "completed");
  EXPECT_EQ(rank0["entries"][1]["dtype"], "Long");
  EXPECT_EQ(rank0["entries"][2]["op"], "send");
  EXPECT_EQ(rank0["entries"][2]["peer"], 1);
  const Json& barrier = rank0["entries"][3];
  EXPECT_EQ(barrier["op"], "barrier");
  EXPECT_NE(barrier["group"], first["group"]);
  EXPECT_EQ(barrier["seq"], 1);
  const Json& last = rank0["entries"][4];
  EXPECT_EQ(last["seq"], 4);
  EXPECT_EQ(last["state"], "timed out");
  EXPECT_NE(last["detail"].get<std::string>().find("step 3"), std::string::npos) << last.dump();
  EXPECT_EQ(records[1]["entries"][2]["op"], "recv");

  const std::string report = flight_divergence(records);
  const std::string group = first["group"];
  EXPECT_NE(report.find("group " + group +
                        ": collective #4 allreduce (Float, 5 elements): ranks "
                        "[0] entered it (rank 0 timed out); ranks [1] did not: rank 1 (its last: "
                        "#3 recv (Float, 4 elements) with group rank 0, completed; then " +
                        barrier["group"].get<std::string>() + " barrier, completed)"),
            std::string::npos)
      << report;
}

// Records of two ranks, written by hand: `ops` per rank, each {op, numel, state}.
Json records_of(int rank, const std::vector<std::tuple<std::string, int64_t, std::string>>& ops) {
  Json entries = Json::array();
  int64_t seq = 0;
  for (const auto& [op, numel, state] : ops) {
    ++seq;
    entries.push_back({{"id", seq},
                       {"group", "pg"},
                       {"seq", seq},
                       {"op", op},
                       {"dtype", "Float"},
                       {"numel", numel},
                       {"tensors", 1},
                       {"state", state},
                       {"started_s", 100.0 + static_cast<double>(seq)},
                       {"ended_s", 0.0}});
  }
  return Json{{"rank", rank},
              {"written_at_s", 110.0},
              {"groups", {{"pg", {{"ranks", {0, 1, 2}}, {"entered", seq}}}}},
              {"entries", entries}};
}

TEST(FlightDivergence, NamesTheFirstCallThatDiffersInKind) {
  const std::vector<Json> records{
      records_of(0, {{"allreduce", 10, "completed"}, {"allreduce", 10, "started"}}),
      records_of(1, {{"allreduce", 10, "completed"}, {"allreduce", 12, "started"}}),
      records_of(2, {{"allreduce", 10, "completed"}, {"broadcast", 10, "started"}})};
  EXPECT_EQ(flight_divergence(records),
            "group pg: collective #2 differs: rank 0 called allreduce (Float, 10 elements), rank "
            "1 allreduce (Float, 12 elements)");
}

TEST(FlightDivergence, NamesRanksStillWaitingAndThoseWithoutRecords) {
  const std::vector<Json> records{
      records_of(0, {{"allreduce", 10, "completed"}, {"allreduce", 10, "completed"}}),
      records_of(1, {{"allreduce", 10, "completed"}, {"allreduce", 10, "started"}}),
      Json{{"groups", 3}, {"entries", "none"}}};  // malformed: as good as none
  EXPECT_EQ(flight_divergence(records),
            "group pg: collective #2 allreduce (Float, 10 elements): ranks [0] completed it, "
            "ranks [1] did not (rank 1 still in it, 8.0 s after it began); no records from ranks "
            "[2]");
}

TEST(FlightDivergence, WithOneRanksRecordsNamesWhereItWaits) {
  const std::vector<Json> records{
      records_of(0, {{"allreduce", 10, "completed"}, {"allreduce", 10, "started"}}), nullptr,
      nullptr};
  EXPECT_EQ(flight_divergence(records),
            "group pg: collective #2 allreduce (Float, 10 elements): ranks [0] did not finish it "
            "(rank 0 still in it, 8.0 s after it began); no records from ranks [1, 2]");
}

// Records are read back from files a failing rank wrote: a field of the wrong type makes that
// rank's records none, and a count of calls far past what a ring holds costs nothing.
TEST(FlightDivergence, AMalformedRecordIsReadAsNone) {
  Json wrong_type = records_of(1, {{"allreduce", 10, "completed"}});
  wrong_type["entries"][0]["numel"] = "ten";
  Json huge_count = records_of(2, {{"allreduce", 10, "completed"}});
  huge_count["groups"]["pg"]["entered"] = int64_t{1} << 62;
  Json bad_rank = records_of(0, {{"allreduce", 10, "completed"}});
  bad_rank["groups"]["pg"]["ranks"] = Json::array({0, -1});
  EXPECT_EQ(flight_divergence({bad_rank, wrong_type, huge_count}), "");
  EXPECT_EQ(
      flight_divergence({records_of(0, {{"allreduce", 10, "completed"}}), wrong_type, huge_count}),
      "group pg: collective #2: ranks [2] entered it (rank 2 kept no record of it); ranks [0] did "
      "not: rank 0 (its last: #1 allreduce (Float, 10 elements), completed); no records "
      "from ranks [1]");
}

TEST(FlightDivergence, RecordsThatAgreeSayNothing) {
  const std::vector<Json> records{records_of(0, {{"allreduce", 10, "completed"}}),
                                  records_of(1, {{"allreduce", 10, "completed"}}),
                                  records_of(2, {{"allreduce", 10, "completed"}})};
  EXPECT_EQ(flight_divergence(records), "");
  EXPECT_EQ(flight_divergence({}), "");
  EXPECT_EQ(flight_divergence({nullptr, nullptr}), "");
}

}  // namespace
}  // namespace cohort::comm

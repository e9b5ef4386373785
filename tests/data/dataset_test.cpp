#include "cohort/data/dataset.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <fstream>
#include <numeric>
#include <set>
#include <thread>

#include <opencv2/imgcodecs.hpp>

#include "cohort/data/data_iterator.h"
#include "cohort/data/preprocessors.h"
#include "cohort/error.h"
#include "cohort/runtime/process.h"
#include "cohort/runtime/worker_info.h"
#include "comm/handshake.h"
#include "data/wire.h"
#include "support/expect.h"
#include "support/subprocess.h"
#include "support/tiny_mnist.h"

namespace cohort::data {
namespace {

using cohort::testing::expect_error;

Dataset numbers(int64_t n) {
  return Dataset::from_tensors(
      {{"x", torch::arange(n, torch::kFloat).unsqueeze(1)}, {"y", torch::arange(n) % 3}});
}

std::vector<int64_t> ids_of(DataIterator& it, IterBatchesOptions options = {}) {
  std::vector<int64_t> ids;
  for (Block& b : it.iter_batches(options)) {
    auto id = b[kIdColumn].contiguous();
    ids.insert(ids.end(), id.data_ptr<int64_t>(), id.data_ptr<int64_t>() + id.numel());
  }
  return ids;
}

TEST(Dataset, MapAndFilterStreamInBatchesKeepingIds) {
  auto ds = numbers(100)
                .map_batches(
                    [](Block b) {
                      b["x"] = b["x"] * 2;
                      return b;
                    },
                    {.name = "double", .batch_size = 16})
                .filter([](const Block& b) { return b["y"] != 0; }, "drop multiples of 3");
  auto it = ds.iterator();
  std::vector<int64_t> sizes;
  std::vector<int64_t> ids;
  for (Block& b : it.iter_batches({.batch_size = 10})) {
    sizes.push_back(b.num_rows());
    EXPECT_TRUE(torch::equal(b["x"].squeeze(1), b[kIdColumn].to(torch::kFloat) * 2));
    auto id = b[kIdColumn];
    ids.insert(ids.end(), id.data_ptr<int64_t>(), id.data_ptr<int64_t>() + id.numel());
  }
  std::vector<int64_t> expected;
  for (int64_t i = 0; i < 100; ++i) {
    if (i % 3 != 0) expected.push_back(i);
  }
  EXPECT_EQ(ids, expected);
  EXPECT_EQ(sizes, (std::vector<int64_t>{10, 10, 10, 10, 10, 10, 6}));
  EXPECT_EQ(ds.count(), 66);
  EXPECT_EQ(ids_of(it, {.batch_size = 10, .drop_last = true}).size(), 60u);
}

TEST(Dataset, ShuffleIsSeededAndChangesWithTheEpoch) {
  auto ds = numbers(50).random_shuffle(7);
  auto a = ds.iterator();
  auto b = ds.iterator();
  const auto first = ids_of(a);
  EXPECT_EQ(first, ids_of(b));
  const auto second = ids_of(a);  // epoch 1
  EXPECT_NE(first, second);
  EXPECT_EQ(std::set<int64_t>(second.begin(), second.end()).size(), 50u);
  a.set_epoch(0);
  EXPECT_EQ(ids_of(a), first);
  auto other = numbers(50).random_shuffle(8).iterator();
  EXPECT_NE(ids_of(other), first);
}

TEST(Dataset, LocalShuffleBufferIsSeededAndLosesNothing) {
  auto it = numbers(64).iterator();
  const auto shuffled =
      ids_of(it, {.batch_size = 8, .local_shuffle_buffer_size = 16, .local_shuffle_seed = 3});
  it.set_epoch(0);
  EXPECT_EQ(ids_of(it, {.batch_size = 8, .local_shuffle_buffer_size = 16, .local_shuffle_seed = 3}),
            shuffled);
  std::vector<int64_t> sorted = shuffled;
  std::sort(sorted.begin(), sorted.end());
  std::vector<int64_t> all(64);
  std::iota(all.begin(), all.end(), 0);
  EXPECT_EQ(sorted, all);
  EXPECT_NE(shuffled, all);
}

TEST(Dataset, SplitAndShardGiveEqualDisjointParts) {
  auto parts = numbers(10).split(3);
  ASSERT_EQ(parts.size(), 3u);
  std::set<int64_t> seen;
  for (auto& p : parts) {
    EXPECT_EQ(p.count(), 3);
    auto it = p.iterator();
    for (auto id : ids_of(it)) EXPECT_TRUE(seen.insert(id).second);
  }
  auto shard = numbers(10).random_shuffle(1).shard(1, 4);
  EXPECT_EQ(shard.count(), 2);
  expect_error<UsageError>([] { numbers(4).shard(4, 4); }, "index 4 of 4");
}

TEST(Dataset, TrainTestSplitIsDisjointWholeAndTheSameInEveryEpoch) {
  const auto sorted_ids = [](const Dataset& d, int64_t epoch) {
    auto it = d.iterator();
    it.set_epoch(epoch);
    auto ids = ids_of(it);
    std::sort(ids.begin(), ids.end());
    return ids;
  };
  auto [train, test] = numbers(50).train_test_split(0.2, 7);
  EXPECT_EQ(train.count(), 40);
  EXPECT_EQ(test.count(), 10);
  auto test_ids = sorted_ids(test, 0);
  std::vector<int64_t> all = sorted_ids(train, 0);
  all.insert(all.end(), test_ids.begin(), test_ids.end());
  std::sort(all.begin(), all.end());
  std::vector<int64_t> expected(50);
  std::iota(expected.begin(), expected.end(), int64_t{0});
  EXPECT_EQ(all, expected);  // disjoint, and every row in one part
  // Drawn by the seed alone: not the last rows, and the same in another epoch and after a
  // per-epoch shuffle of the train part.
  EXPECT_NE(test_ids, std::vector<int64_t>(expected.end() - 10, expected.end()));
  EXPECT_EQ(sorted_ids(test, 3), test_ids);
  EXPECT_EQ(sorted_ids(train.random_shuffle(1), 2), sorted_ids(train, 0));
  auto [train2, test2] = numbers(50).train_test_split(0.2, 8);
  EXPECT_NE(sorted_ids(test2, 0), test_ids);
  // Without a seed, Ray's default: the last rows.
  auto last = numbers(50).train_test_split(0.1).second;
  EXPECT_EQ(sorted_ids(last, 0), std::vector<int64_t>(expected.end() - 5, expected.end()));
  // Each part keeps at least one row.
  EXPECT_EQ(numbers(3).train_test_split(0.01, 1).second.count(), 1);
  EXPECT_EQ(numbers(3).train_test_split(0.99, 1).first.count(), 1);
  expect_error<UsageError>([] { numbers(4).train_test_split(1.0, 1); }, "test_size=1");
  expect_error<UsageError>([] { numbers(4).train_test_split(0, 1); }, "between 0 and 1");
}

TEST(Dataset, MaterializeKeepsRowsAndIds) {
  int calls = 0;
  auto ds = numbers(20)
                .map_batches(
                    [&calls](Block b) {
                      ++calls;
                      return b;
                    },
                    {.batch_size = 5})
                .filter([](const Block& b) { return b[kIdColumn] >= 10; });
  auto cached = ds.materialize();
  EXPECT_EQ(calls, 4);
  EXPECT_EQ(cached.count(), 10);
  auto it = cached.iterator();
  EXPECT_EQ(ids_of(it).front(), 10);
  EXPECT_EQ(calls, 4);
}

TEST(Dataset, CsvBecomesFeaturesAndLabelsAndBadValuesAreNamed) {
  auto dir = cohort::testing::temp_dir("csv");
  std::ofstream(dir / "ok.csv") << "a, b,label\n1,2,0\n3,4.5,1\n\n";
  auto ds = Dataset::read_csv(dir / "ok.csv", {.label_column = "label"});
  auto all = ds.take();
  EXPECT_TRUE(
      torch::allclose(all["features"], torch::tensor({1.0f, 2.0f, 3.0f, 4.5f}).view({2, 2})));
  EXPECT_TRUE(torch::equal(all["label"], torch::tensor({0, 1}, torch::kLong)));
  std::ofstream(dir / "bad.csv") << "a,b\n1,2\n3,x\n";
  expect_error<UsageError>([&] { Dataset::read_csv(dir / "bad.csv"); },
                           "bad.csv:3, column 'b': 'x' is not a number");
  expect_error<UsageError>([&] { Dataset::read_csv(dir / "ok.csv", {.label_column = "y"}); },
                           "no column 'y'");
  std::ofstream(dir / "ragged.csv") << "a,label\n1,0\n2\n";
  expect_error<UsageError>(
      [&] { Dataset::read_csv(dir / "ragged.csv", {.label_column = "label"}); },
      "ragged.csv:3 has 1 fields where the header has 2");
  std::ofstream(dir / "fraction.csv") << "a,label\n1,0\n2,1.5\n";
  expect_error<UsageError>(
      [&] { Dataset::read_csv(dir / "fraction.csv", {.label_column = "label"}); },
      "fraction.csv:3, label column 'label': '1.5' is not a whole number");
  std::filesystem::remove_all(dir);
}

TEST(Dataset, ImageFolderLabelsBySubfolderAndBadFilesFollowThePolicy) {
  auto dir = cohort::testing::temp_dir("images");
  for (const std::string cls : {"cat", "dog"}) {
    std::filesystem::create_directories(dir / cls);
    for (int i = 0; i < 3; ++i) {
      cv::Mat image(8, 6, CV_8UC3, cv::Scalar(10 * i, cls == "cat" ? 50 : 200, 0));
      cv::imwrite((dir / cls / (std::to_string(i) + ".png")).string(), image);
    }
  }
  auto ds = Dataset::read_images(dir);
  EXPECT_EQ(ds.class_names(), (std::vector<std::string>{"cat", "dog"}));
  auto all = ds.take();
  ASSERT_EQ(all["image"].sizes(), (std::vector<int64_t>{6, 3, 8, 6}));
  EXPECT_TRUE(torch::equal(all["label"], torch::tensor({0, 0, 0, 1, 1, 1}, torch::kLong)));
  EXPECT_EQ(all["image"][0][1][0][0].item<int>(), 50);  // RGB order: green in channel 1

  expect_error<UsageError>([&] { Dataset::read_images(dir / "cat"); }, "has no class sub-folders");
  std::ofstream(dir / "dog" / "broken.jpg") << "not an image";
  expect_error<RuntimeError>([&] { Dataset::read_images(dir).take(); }, "broken.jpg");
  auto skipping =
      Dataset::read_images(dir, {.height = 4, .width = 4, .on_bad_file = OnError::kSkip});
  auto it = skipping.iterator();
  EXPECT_EQ(ids_of(it).size(), 6u);
  EXPECT_EQ(it.stats().skipped_rows, 1);
  std::filesystem::remove_all(dir);
}

TEST(Preprocessors, NormalizeScalerCropFlipBlurChain) {
  Block b{{{"image", torch::full({2, 3, 4, 4}, 51, torch::kUInt8)},
           {kIdColumn, torch::tensor({5, 6}, torch::kLong)}}};
  auto n = Normalize{.mean = {0.1, 0.2, 0.3}, .std = {0.5, 0.5, 0.5}}(b);
  EXPECT_NEAR(n["image"][0][2][0][0].item<float>(), (0.2 - 0.3) / 0.5, 1e-6);

  auto features =
      Dataset::from_tensors({{"features", torch::tensor({1.0f, 10.0f, 3.0f, 10.0f}).view({2, 2})}});
  StandardScaler scaler;
  scaler.fit(features);
  auto scaled = scaler(features.take());
  EXPECT_TRUE(
      torch::allclose(scaled["features"], torch::tensor({-1.0f, 0.0f, 1.0f, 0.0f}).view({2, 2})));

  Block ramp{{{"image", torch::arange(2 * 16, torch::kFloat).view({2, 1, 4, 4})},
              {kIdColumn, torch::tensor({1, 2}, torch::kLong)}}};
  auto crop = RandomCrop{.height = 2, .width = 2, .seed = 3};
  auto c1 = crop(ramp)["image"];
  EXPECT_EQ(c1.sizes(), (std::vector<int64_t>{2, 1, 2, 2}));
  EXPECT_TRUE(torch::equal(c1, crop(ramp)["image"]));  // same seed, epoch and ids: same crop
  auto flipped = RandomHorizontalFlip{.p = 1.0}(ramp)["image"];
  EXPECT_TRUE(torch::equal(flipped, ramp["image"].flip({3})));
  EXPECT_TRUE(torch::equal(RandomHorizontalFlip{.p = 0.0}(ramp)["image"], ramp["image"]));

  // A blur keeps a constant image, and spreads an impulse symmetrically, preserving its mass.
  EXPECT_TRUE(torch::equal(GaussianBlur{.kernel_size = 5}(b)["image"], b["image"]));
  auto impulse = torch::zeros({1, 1, 9, 9});
  impulse[0][0][4][4] = 1.0f;
  auto blurred =
      GaussianBlur{.kernel_size = 5, .sigma = 1.0}(Block{{{"image", impulse}}})["image"][0][0];
  EXPECT_NEAR(blurred.sum().item<float>(), 1.0f, 1e-5);
  EXPECT_NEAR(blurred[4][3].item<float>(), blurred[3][4].item<float>(), 1e-7);
  EXPECT_GT(blurred[4][4].item<float>(), blurred[4][3].item<float>());
  expect_error<UsageError>([&] { GaussianBlur{.kernel_size = 4}(b); }, "must be odd");

  auto chain = Chain{{GaussianBlur{.kernel_size = 3}, Normalize{}}};
  EXPECT_EQ(chain(b)["image"].scalar_type(), torch::kFloat);
}

// The pipeline used by the offload tests: blur, then a marker of the row id in the pixels.
Dataset blurred_images(int workers, int64_t rows = 48) {
  return Dataset::synthetic_images(rows, {.height = 16, .width = 16, .seed = 4})
      .random_shuffle(2)
      .map_batches(Chain{{GaussianBlur{.kernel_size = 3}, RandomHorizontalFlip{.seed = 1}}},
                   {.name = "blur", .batch_size = 4, .num_workers = workers});
}

TEST(DataOffload, BatchesAreTheSameWithAnyNumberOfWorkers) {
  auto inline_it = blurred_images(0).iterator();
  auto pooled_it = blurred_images(2).iterator();
  for (int epoch = 0; epoch < 2; ++epoch) {
    std::vector<Block> expected;
    for (Block& b : inline_it.iter_batches({.batch_size = 6, .local_shuffle_buffer_size = 8}))
      expected.push_back(b);
    size_t i = 0;
    for (Block& b : pooled_it.iter_batches({.batch_size = 6, .local_shuffle_buffer_size = 8})) {
      ASSERT_LT(i, expected.size());
      EXPECT_TRUE(torch::equal(b[kIdColumn], expected[i][kIdColumn]))
          << "epoch " << epoch << " batch " << i;
      EXPECT_TRUE(torch::equal(b["image"], expected[i]["image"]))
          << "epoch " << epoch << " batch " << i;
      ++i;
    }
    EXPECT_EQ(i, expected.size());
  }
}

// Rows 0-39 through 2 workers; the first to reach row 17 meets `fault` there, once (a marker file
// says it happened). Every row must arrive once, in order, with that one task redone.
void expect_one_task_redone(const std::string& name, void (*fault)(),
                            const ExecutionOptions& execution) {
  auto dir = cohort::testing::temp_dir(name);
  const auto marker = dir / "met";
  auto ds =
      numbers(40)
          .map_batches(
              [marker, fault](Block b) {
                if ((b[kIdColumn] == 17).any().item<bool>() && !std::filesystem::exists(marker)) {
                  std::ofstream(marker).flush();
                  fault();
                }
                return b;
              },
              {.name = name, .batch_size = 4, .num_workers = 2})
          .with_execution(execution);
  auto it = ds.iterator();
  auto ids = ids_of(it, {.batch_size = 4});
  std::vector<int64_t> all(40);
  std::iota(all.begin(), all.end(), 0);
  EXPECT_EQ(ids, all);
  EXPECT_TRUE(std::filesystem::exists(marker));
  EXPECT_EQ(it.stats().tasks_redone, 1);
  std::filesystem::remove_all(dir);
}

TEST(DataOffload, AWorkerThatDiesHasItsTaskRedoneNothingLostOrDuplicated) {
  expect_one_task_redone("offload_death", [] { ::raise(SIGKILL); }, {});
}

// A worker that hangs on a task is killed at the task's deadline and replaced, as one that died.
TEST(DataOffload, AWorkerThatHangsIsKilledAtItsTaskDeadlineAndItsTaskRedone) {
  expect_one_task_redone("offload_hang", [] { ::pause(); },
                         {.task_timeout = std::chrono::seconds(2)});
}

TEST(DataOffload, AThrowingMapNamesTheStageAndBatchOrSkipsIt) {
  auto throwing = [](Block b) {
    if ((b[kIdColumn] == 9).any().item<bool>()) throw std::runtime_error("bad pixel");
    return b;
  };
  for (int workers : {0, 2}) {
    auto failing = numbers(20).map_batches(
        throwing, {.name = "decode", .batch_size = 4, .num_workers = workers});
    auto it = failing.iterator();
    expect_error<RuntimeError>(
        [&] { ids_of(it); },
        "stage 'decode' (#1, map_batches) on a batch of 4 rows (ids 8,9,10,11");
    auto skipping = numbers(20).map_batches(
        throwing,
        {.name = "decode", .batch_size = 4, .num_workers = workers, .on_error = OnError::kSkip});
    auto it2 = skipping.iterator();
    EXPECT_EQ(ids_of(it2).size(), 16u) << workers << " workers";
    EXPECT_EQ(it2.stats().skipped_batches, 1);
  }
}

TEST(DataOffload, WorkersStartTheNextEpochEarlyAndASkippedOneIsDropped) {
  // Each task a worker runs leaves a file named after its epoch and index.
  auto dir = cohort::testing::temp_dir("offload_lookahead");
  auto pipeline = [dir](int workers) {
    return numbers(24).random_shuffle(5).map_batches(
        [dir](Block b) {
          if (!runtime::spawned_role().empty()) {
            std::ofstream(dir / ("epoch" + std::to_string(current_epoch()) + "-row" +
                                 std::to_string(b[kIdColumn][0].item<int64_t>())))
                .flush();
          }
          return b;
        },
        {.name = "mark", .batch_size = 4, .num_workers = workers});
  };
  auto started_epoch1 = [&] {
    for (const auto& entry : std::filesystem::directory_iterator(dir)) {
      if (entry.path().filename().string().rfind("epoch1-", 0) == 0) return true;
    }
    return false;
  };
  {
    auto reference = pipeline(0).iterator();
    auto it = pipeline(2).iterator();
    EXPECT_EQ(ids_of(it, {.batch_size = 4}), ids_of(reference, {.batch_size = 4}));
    // Epoch 0 is consumed and epoch 1 not begun: the workers are already on epoch 1's first tasks.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (!started_epoch1() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    EXPECT_TRUE(started_epoch1());
    // Epoch 1's batches are those the inline pipeline gives, and so are epoch 5's when the
    // consumer jumps there (the early epoch-2 work is dropped).
    EXPECT_EQ(ids_of(it, {.batch_size = 4}), ids_of(reference, {.batch_size = 4}));
    it.set_epoch(5);
    reference.set_epoch(5);
    EXPECT_EQ(ids_of(it, {.batch_size = 4}), ids_of(reference, {.batch_size = 4}));
  }  // the workers end with the iterator
  // A single pass (count, take) starts nothing after it.
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  EXPECT_EQ(pipeline(2).count(), 24);
  EXPECT_FALSE(started_epoch1());
  std::filesystem::remove_all(dir);
}

// A loopback port free now (bound, read and released), for a listener the test makes later.
int free_loopback_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

// What the offload tests' consumers and remote workers share (the workers get it as
// COHORT_JOB_SECRET).
const comm::JobSecret& offload_secret() {
  static const auto secret = comm::JobSecret::from_text("the offload tests' job secret", "test");
  return secret;
}

TEST(DataOffload, ARemoteWorkerConnectsOverTcp) {
  // The remote worker is this test re-executed in the data role, told where to connect.
  const int port = free_loopback_port();
  auto ds =
      blurred_images(0, 24).with_execution({.listen_address = "127.0.0.1:" + std::to_string(port),
                                            .remote_workers = 1,
                                            .secret = offload_secret(),
                                            .worker_start_timeout = std::chrono::seconds(30)});
  int remote = -1;
  if (runtime::spawned_role().empty()) {
    remote = runtime::spawn_self(kDataRole,
                                 {{"COHORT_DATA_ADDRESS", "127.0.0.1:" + std::to_string(port)},
                                  {"COHORT_JOB_SECRET", offload_secret().text()}});
  }
  auto it = ds.iterator();
  auto ids = ids_of(it, {.batch_size = 5});
  EXPECT_EQ(std::set<int64_t>(ids.begin(), ids.end()).size(), 24u);
  auto reference = blurred_images(0, 24).iterator();
  EXPECT_EQ(ids, ids_of(reference, {.batch_size = 5}));
  EXPECT_EQ(it.listen_address(), "127.0.0.1:" + std::to_string(port));
  it = numbers(1).iterator();  // ends the pool: the remote worker is told to stop
  EXPECT_TRUE(cohort::testing::wait_for_exit(remote, std::chrono::seconds(20)));
}

// A connection without the job secret is refused before a byte of it is parsed; connections that
// hold it but send headers of the wrong shape (a string pid: the kind of message ended the
// consumer with a JSON type_error on the pool's thread) are dropped, each named; the real remote
// worker serves the epoch, whose batches are those of an undisturbed run.
TEST(DataOffload, MalformedHeadersDropTheirConnectionAndTheEpochCompletes) {
  const int port = free_loopback_port();
  const std::string address = "127.0.0.1:" + std::to_string(port);
  auto ds =
      blurred_images(0, 24).with_execution({.listen_address = address,
                                            .remote_workers = 1,
                                            .secret = offload_secret(),
                                            .worker_start_timeout = std::chrono::seconds(30)});
  if (!runtime::spawned_role().empty()) {  // the remote worker: serves and ends
    auto it = ds.iterator();
    ids_of(it);
    return;
  }
  bool outsider_refused = false;
  std::thread attacker([&] {
    try {
      ::close(wire::connect_to(address, comm::JobSecret::from_text("another job's secret", "test"),
                               std::chrono::seconds(20)));
    } catch (const comm::SecretRefused&) {
      outsider_refused = true;
    }
    for (const Json& header :
         {Json{{"type", "hello"}, {"pid", "x"}}, Json{{"type", "result"}, {"index", "0"}},
          Json{{"type", "result"}, {"index", 0}, {"payload_bytes", -5}}, Json::array({1, 2}),
          Json{{"type", "result"}}}) {
      const int fd = wire::connect_to(address, offload_secret(), std::chrono::seconds(20));
      wire::send(fd, header);
      char byte;
      ::recv(fd, &byte, 1, 0);  // returns once the consumer closes the connection
      ::close(fd);
    }
  });
  const int remote = runtime::spawn_self(
      kDataRole,
      {{"COHORT_DATA_ADDRESS", address}, {"COHORT_JOB_SECRET", offload_secret().text()}});
  auto it = ds.iterator();
  const auto ids = ids_of(it, {.batch_size = 5});
  attacker.join();
  EXPECT_TRUE(outsider_refused);
  auto reference = blurred_images(0, 24).iterator();
  EXPECT_EQ(ids, ids_of(reference, {.batch_size = 5}));
  it = numbers(1).iterator();  // ends the pool: the remote worker is told to stop
  EXPECT_TRUE(cohort::testing::wait_for_exit(remote, std::chrono::seconds(20)));
}

}  // namespace
}  // namespace cohort::data

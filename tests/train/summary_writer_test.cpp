#include "cohort/train/summary_writer.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>

#include "cohort/error.h"
#include "support/expect.h"

namespace cohort::train {
namespace {

namespace fs = std::filesystem;

class SummaryWriterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("cohort_summary_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_F(SummaryWriterTest, ScalarsHistogramsTextAndHparamsReadBack) {
  fs::path file;
  {
    SummaryWriter writer(dir_);
    file = writer.path();
    writer.add_scalar("loss", 0.5, 1);
    writer.add_scalar("loss", 0.25, 2);
    writer.add_histogram("weights", torch::tensor({1.0, 2.0, 2.0, 4.0, std::nan("")}), 2);
    writer.add_text("config", "lr: 0.1", 0);
    writer.add_hparams_session_start({{"lr", 0.1}, {"optimizer", "adam"}});
    writer.add_hparams_session_end(SessionStatus::kSuccess);
  }
  EXPECT_EQ(event_files(dir_), std::vector<fs::path>{file});
  const auto events = read_events(file);
  ASSERT_EQ(events.size(), 7u);
  EXPECT_EQ(events[0].kind, SummaryEvent::Kind::kFileVersion);
  EXPECT_EQ(events[0].tag, "brain.Event:2");
  EXPECT_EQ(events[1].kind, SummaryEvent::Kind::kScalar);
  EXPECT_EQ(events[1].tag, "loss");
  EXPECT_EQ(events[1].step, 1);
  EXPECT_FLOAT_EQ(events[1].scalar, 0.5);
  EXPECT_EQ(events[2].step, 2);
  EXPECT_FLOAT_EQ(events[2].scalar, 0.25);
  EXPECT_GT(events[2].wall_time, 1.6e9);

  const auto& h = events[3].histogram;
  EXPECT_EQ(events[3].kind, SummaryEvent::Kind::kHistogram);
  EXPECT_EQ(h.num, 4);  // the nan is left out
  EXPECT_EQ(h.min, 1);
  EXPECT_EQ(h.max, 4);
  EXPECT_EQ(h.sum, 9);
  EXPECT_EQ(h.sum_squares, 25);
  ASSERT_EQ(h.bucket.size(), 30u);
  EXPECT_EQ(h.bucket_limit.back(), 4);
  double counted = 0;
  for (double c : h.bucket) counted += c;
  EXPECT_EQ(counted, 4);

  EXPECT_EQ(events[4].kind, SummaryEvent::Kind::kText);
  EXPECT_EQ(events[4].tag, "config");
  EXPECT_EQ(events[4].text, "lr: 0.1");
  EXPECT_EQ(events[5].plugin, "hparams");
  EXPECT_EQ(events[5].tag, "_hparams_/session_start_info");
  EXPECT_NE(events[5].plugin_content.find("adam"), std::string::npos);
  EXPECT_EQ(events[6].tag, "_hparams_/session_end_info");
}

TEST_F(SummaryWriterTest, AConstantTensorIsOneBucket) {
  const auto h = Histogram::of(torch::full({5}, 3.0));
  EXPECT_EQ(h.bucket_limit, std::vector<double>{3});
  EXPECT_EQ(h.bucket, std::vector<double>{5});
  EXPECT_EQ(Histogram::of(torch::empty({0})).num, 0);
}

TEST_F(SummaryWriterTest, ACorruptOrCutFileIsNamedWithTheRecordOffset) {
  fs::path file;
  {
    SummaryWriter writer(dir_);
    file = writer.path();
    writer.add_scalar("loss", 0.5, 1);
  }
  const auto size = fs::file_size(file);
  std::string bytes(size, '\0');
  {
    std::ifstream in(file, std::ios::binary);
    in.read(bytes.data(), static_cast<std::streamsize>(size));
  }
  const auto write = [&](const std::string& content) {
    std::ofstream out(file, std::ios::binary | std::ios::trunc);
    out << content;
  };
  // The first record (the file version) is intact; the second starts after it.
  const auto first_record = read_events(file).size();
  ASSERT_EQ(first_record, 2u);

  std::string flipped = bytes;
  flipped[size - 6] ^= 0x20;  // inside the scalar's bytes
  write(flipped);
  try {
    read_events(file);
    ADD_FAILURE() << "a flipped bit was not noticed";
  } catch (const UsageError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(file.string()), std::string::npos) << message;
    EXPECT_NE(message.find("the record at byte 40 has bytes that do not match their CRC"),
              std::string::npos)
        << message;
  }
  write(bytes.substr(0, size - 3));
  testing::expect_error<UsageError>([&] { read_events(file); }, "is cut short");
  write(bytes.substr(0, size - 20));
  testing::expect_error<UsageError>([&] { read_events(file); }, "at byte");
}

TEST_F(SummaryWriterTest, AnUnwritableFolderIsAUsageError) {
  fs::create_directories(dir_);
  std::ofstream(dir_ / "file") << "x";
  testing::expect_error<UsageError>([&] { SummaryWriter writer(dir_ / "file" / "tb"); },
                                    "is not writable");
}

}  // namespace
}  // namespace cohort::train

#include "cohort/data/idx.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>

#include "cohort/error.h"
#include "support/expect.h"
#include "support/tiny_mnist.h"

namespace cohort::data {
namespace {

class IdxTest : public ::testing::Test {
 protected:
  std::filesystem::path dir = cohort::testing::temp_dir("idx");
  void TearDown() override { std::filesystem::remove_all(dir); }

  void write_bytes(const std::filesystem::path& path, const std::string& bytes) {
    std::ofstream out(path, std::ios::binary);
    out << bytes;
  }
  std::string read_bytes(const std::filesystem::path& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
};

template <typename F>
void expect_usage_error(F&& f, const std::string& fragment) {
  cohort::testing::expect_error<UsageError>(std::forward<F>(f), fragment);
}

TEST_F(IdxTest, RoundTripsPlainAndGzip) {
  auto tensor =
      torch::arange(0, 2 * 3 * 4, torch::kLong).remainder(256).to(torch::kUInt8).view({2, 3, 4});
  for (const char* name : {"a-idx3-ubyte", "a-idx3-ubyte.gz"}) {
    write_idx(dir / name, tensor);
    auto back = read_idx(dir / name);
    EXPECT_EQ(back.sizes(), tensor.sizes()) << name;
    EXPECT_TRUE(torch::equal(back, tensor)) << name;
    EXPECT_EQ(inspect_idx(dir / name).shape, (std::vector<int64_t>{2, 3, 4})) << name;
  }
  // The gzip file really is compressed, the plain one really is plain.
  EXPECT_EQ(read_bytes(dir / "a-idx3-ubyte").size(), 4u + 3 * 4 + 24);
  EXPECT_EQ(static_cast<unsigned char>(read_bytes(dir / "a-idx3-ubyte.gz")[0]), 0x1f);
}

TEST_F(IdxTest, ReadsTheHeaderBigEndian) {
  std::string bytes = {0, 0, 8, 1, 0, 0, 1, 2};  // 1-D, 258 elements
  bytes += std::string(258, '\x07');
  write_bytes(dir / "labels", bytes);
  auto t = read_idx(dir / "labels");
  ASSERT_EQ(t.dim(), 1);
  EXPECT_EQ(t.size(0), 258);
  EXPECT_EQ(t[257].item<uint8_t>(), 7);
}

TEST_F(IdxTest, TruncatedPlainFileIsNamed) {
  write_idx(dir / "x", torch::zeros({10, 5}, torch::kUInt8));
  auto bytes = read_bytes(dir / "x");
  write_bytes(dir / "x", bytes.substr(0, bytes.size() - 7));
  expect_usage_error([&] { read_idx(dir / "x"); },
                     "is truncated: header announces 50 data bytes, file has 43");
  expect_usage_error([&] { inspect_idx(dir / "x"); }, "truncated");
}

TEST_F(IdxTest, TruncatedGzipFileIsNamed) {
  // A whole gzip stream whose content is shorter than the header says.
  std::string bytes = {0, 0, 8, 2, 0, 0, 0, 10, 0, 0, 0, 5};
  bytes += std::string(20, '\x01');
  write_bytes(dir / "raw", bytes);
  const std::string gzip =
      "gzip -c " + (dir / "raw").string() + " > " + (dir / "short.gz").string();
  ASSERT_EQ(std::system(gzip.c_str()), 0);
  expect_usage_error([&] { read_idx(dir / "short.gz"); }, "truncated");
  expect_usage_error([&] { inspect_idx(dir / "short.gz"); }, "truncated");
  // A gzip stream cut in the middle.
  write_idx(dir / "whole.gz", torch::randint(0, 255, {200, 28, 28}).to(torch::kUInt8));
  auto gz = read_bytes(dir / "whole.gz");
  write_bytes(dir / "cut.gz", gz.substr(0, gz.size() / 2));
  EXPECT_THROW(read_idx(dir / "cut.gz"), UsageError);
  EXPECT_THROW(inspect_idx(dir / "cut.gz"), UsageError);
}

TEST_F(IdxTest, WrongMagicIsRejected) {
  write_bytes(dir / "bad", std::string("\x12\x34\x08\x01\x00\x00\x00\x01\x00", 9));
  expect_usage_error([&] { read_idx(dir / "bad"); }, "wrong magic number");
  write_bytes(dir / "float", std::string("\x00\x00\x0d\x01\x00\x00\x00\x01\x00\x00\x00\x00", 12));
  expect_usage_error([&] { read_idx(dir / "float"); }, "only unsigned bytes");
  write_bytes(dir / "empty", "");
  expect_usage_error([&] { read_idx(dir / "empty"); }, "no 4-byte header");
}

TEST_F(IdxTest, DimensionsPastTheCapAreRefusedBeforeAnyAllocation) {
  // Four dimensions of 2^32 - 1: their product overflows 64 bits; and one past the cap.
  write_bytes(dir / "huge", std::string("\x00\x00\x08\x04", 4) + std::string(16, '\xff'));
  const std::string huge =
      "announces dimensions [4294967295, 4294967295, 4294967295, 4294967295], over the cap of "
      "68719476736 data bytes (kMaxIdxBytes)";
  expect_usage_error([&] { read_idx(dir / "huge"); }, huge);
  expect_usage_error([&] { inspect_idx(dir / "huge"); }, huge);
  write_bytes(dir / "past", std::string("\x00\x00\x08\x02\x00\x01\x00\x00\x00\x10\x00\x01", 12));
  expect_usage_error([&] { read_idx(dir / "past"); }, "announces dimensions [65536, 1048577]");
}

TEST_F(IdxTest, TrailingBytesAreRejected) {
  write_idx(dir / "x", torch::zeros({4}, torch::kUInt8));
  write_bytes(dir / "x", read_bytes(dir / "x") + "junk");
  expect_usage_error([&] { read_idx(dir / "x"); }, "after its data");
  expect_usage_error([&] { inspect_idx(dir / "x"); }, "after its data");
}

TEST_F(IdxTest, MissingFileIsNamed) {
  expect_usage_error([&] { read_idx(dir / "nope"); }, "does not exist");
}

}  // namespace
}  // namespace cohort::data

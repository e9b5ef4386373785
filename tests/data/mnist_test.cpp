#include "cohort/data/mnist.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "cohort/data/idx.h"
#include "cohort/error.h"
#include "support/expect.h"
#include "support/tiny_mnist.h"

namespace cohort::data {
namespace {

class MnistTest : public ::testing::Test {
 protected:
  std::filesystem::path dir = cohort::testing::temp_dir("mnist");
  void TearDown() override { std::filesystem::remove_all(dir); }
};

TEST_F(MnistTest, LoadsAndNormalises) {
  cohort::testing::write_tiny_mnist(dir, 64, 16, /*gzip=*/false);
  check_mnist_dir(dir);
  auto train = load_mnist(dir, Split::kTrain, {.mean = 0.5, .std = 0.5});
  ASSERT_EQ(train.size(), 64);
  EXPECT_EQ(train.inputs.sizes(), (std::vector<int64_t>{64, 1, 28, 28}));
  EXPECT_EQ(train.targets.scalar_type(), torch::kLong);
  auto batch = train.get_batch(torch::arange(4, torch::kLong));
  EXPECT_EQ(batch.data.scalar_type(), torch::kFloat);
  // Pixel p becomes (p/255 - 0.5)/0.5, i.e. within [-1, 1].
  auto expected = train.inputs.narrow(0, 0, 4).to(torch::kFloat).div(255).sub(0.5).div(0.5);
  EXPECT_TRUE(torch::allclose(batch.data, expected, 1e-5, 1e-6));
  EXPECT_EQ(load_mnist(dir, Split::kTest).size(), 16);
}

TEST_F(MnistTest, MissingDirectoryAndFilesAreNamed) {
  cohort::testing::expect_error<UsageError>([&] { check_mnist_dir(dir / "absent"); },
                                            "does not exist");
  cohort::testing::write_tiny_mnist(dir, 32, 8);
  std::filesystem::remove(dir / "t10k-labels-idx1-ubyte.gz");
  cohort::testing::expect_error<UsageError>([&] { check_mnist_dir(dir); },
                                            "t10k-labels-idx1-ubyte");
}

TEST_F(MnistTest, ImagesAndLabelsMustAgree) {
  cohort::testing::write_tiny_mnist(dir, 32, 8);
  write_idx(dir / "train-labels-idx1-ubyte.gz", torch::zeros({31}, torch::kUInt8));
  cohort::testing::expect_error<UsageError>([&] { check_mnist_dir(dir); },
                                            "32 images but 31 labels");
}

TEST(FashionMnist, TheDebianPackageIsWhole) {
  const auto dir = default_fashion_mnist_dir();
  if (!std::filesystem::exists(dir)) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  check_mnist_dir(dir);
  auto test = load_mnist(dir, Split::kTest);
  EXPECT_EQ(test.size(), 10000);
  EXPECT_EQ(test.targets.max().item<int64_t>(), 9);
}

}  // namespace
}  // namespace cohort::data

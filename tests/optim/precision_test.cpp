#include "cohort/optim/precision.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "cohort/data/mnist.h"
#include "cohort/error.h"
#include "cohort/models/zoo.h"
#include "cohort/optim/flat_optimizer.h"
#include "support/expect.h"

namespace cohort {
namespace {

TEST(Precision, NamesParseAndBadOnesAreListed) {
  EXPECT_EQ(optim::precision_from_string("bf16"), optim::Precision::kBf16);
  EXPECT_EQ(optim::precision_from_string("float16"), optim::Precision::kFp16);
  EXPECT_EQ(optim::to_string(optim::Precision::kFp32), "fp32");
  testing::expect_error<UsageError>([] { optim::precision_from_string("fp8"); },
                                    "unknown precision 'fp8': choose fp32, bf16 or fp16");
}

TEST(Precision, Fp16OnACpuNamesBf16AsTheFix) {
  testing::expect_error<UsageError>(
      [] { optim::check_precision_supported(optim::Precision::kFp16, torch::Device(torch::kCPU)); },
      "Use bf16 instead");
  testing::expect_error<UsageError>(
      [] { optim::AutocastGuard guard(optim::Precision::kFp16, torch::Device(torch::kCPU)); },
      "precision fp16 needs a GPU");
  optim::check_precision_supported(optim::Precision::kBf16, torch::Device(torch::kCPU));
}

TEST(Precision, Bf16AutocastOnCpuRunsMatmulsInBf16AndNests) {
  const auto a = torch::randn({4, 4});
  {
    optim::AutocastGuard outer(optim::Precision::kBf16, torch::Device(torch::kCPU));
    EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kBFloat16);
    {
      optim::AutocastGuard inner(optim::Precision::kBf16, torch::Device(torch::kCPU));
      EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kBFloat16);
    }
    EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kBFloat16) << "the inner guard ended it";
    optim::AutocastGuard none(optim::Precision::kFp32, torch::Device(torch::kCPU));
    EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kBFloat16) << "fp32 guards change nothing";
  }
  EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kFloat);
}

// Accuracy on the first 2000 test images after one epoch over 6000 training images.
double train_cnn(optim::Precision precision) {
  const auto dir = data::default_fashion_mnist_dir();
  const auto train = data::load_mnist(dir, data::Split::kTrain);
  const auto test = data::load_mnist(dir, data::Split::kTest);
  torch::manual_seed(0);
  auto model = models::create_model("cnn");
  optim::FlatSGD optimizer(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  const torch::Device cpu(torch::kCPU);
  for (int64_t start = 0; start < 6000; start += 64) {
    const auto batch = train.get_batch(torch::arange(start, std::min<int64_t>(start + 64, 6000)));
    optimizer.zero_grad();
    torch::Tensor loss;
    {
      optim::AutocastGuard autocast(precision, cpu);
      loss = torch::nn::functional::cross_entropy(model->forward(batch.data), batch.target);
    }
    loss.backward();
    optimizer.step();
  }
  torch::NoGradGuard no_grad;
  model->eval();
  const auto batch = test.get_batch(torch::arange(0, 2000));
  optim::AutocastGuard autocast(precision, cpu);
  return model->forward(batch.data)
      .argmax(1)
      .eq(batch.target)
      .to(torch::kFloat)
      .mean()
      .item<double>();
}

TEST(Precision, Bf16TrainingOfTheCnnLearnsAsFp32Does) {
  if (!std::filesystem::exists(data::default_fashion_mnist_dir()))
    GTEST_SKIP() << "no Fashion-MNIST at " << data::default_fashion_mnist_dir()
                 << " (scripts/setup.sh installs dataset-fashion-mnist)";
  const double fp32 = train_cnn(optim::Precision::kFp32);
  const double bf16 = train_cnn(optim::Precision::kBf16);
  std::cout << "one epoch over 6000 images: fp32 accuracy " << fp32 << ", bf16 " << bf16
            << std::endl;
  EXPECT_GT(fp32, 0.6);
  EXPECT_NEAR(bf16, fp32, 0.01);
}

}  // namespace
}  // namespace cohort

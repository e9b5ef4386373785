#include "cohort/models/zoo.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "cohort/error.h"
#include "support/expect.h"

namespace cohort::models {
namespace {

int64_t count_parameters(const ImageClassifier& m) {
  int64_t n = 0;
  for (const auto& p : m->parameters()) n += p.numel();
  return n;
}

TEST(Zoo, SeedArchitecturesHaveTheirParameterCounts) {
  // Seed 000's MLP and CNN, seed 002's resnet18 with a 1-channel stem and 10 classes.
  EXPECT_EQ(count_parameters(create_model("mlp")), 784 * 128 + 128 + 128 * 64 + 64 + 64 * 10 + 10);
  EXPECT_EQ(count_parameters(create_model("cnn")),
            (32 * 9 + 32) + (64 * 32 * 9 + 64) + (64 * 7 * 7 * 128 + 128) + (128 * 10 + 10));
  // torchvision's resnet18 has 11,689,512 parameters with 3 input channels and 1000 classes.
  EXPECT_EQ(count_parameters(create_model("resnet18")),
            11'689'512 - 64 * 2 * 49 - (512 * 990 + 990));
}

TEST(Zoo, EveryModelClassifiesABatch) {
  for (const auto& name : model_names()) {
    auto model = create_model(name);
    auto out = model->forward(torch::randn({3, 1, 28, 28}));
    EXPECT_EQ(out.sizes(), (std::vector<int64_t>{3, 10})) << name;
    out.sum().backward();
    for (const auto& p : model->parameters()) EXPECT_TRUE(p.grad().defined()) << name;
  }
}

TEST(Zoo, VitIsConfigurable) {
  auto vit = create_model("vit", {.num_classes = 5,
                                  .in_channels = 3,
                                  .image_size = 32,
                                  .patch_size = 8,
                                  .depth = 2,
                                  .width = 64,
                                  .heads = 4});
  EXPECT_EQ(vit->forward(torch::randn({2, 3, 32, 32})).sizes(), (std::vector<int64_t>{2, 5}));
  EXPECT_THROW(create_model("vit", {.image_size = 30, .patch_size = 7}), UsageError);
  EXPECT_THROW(create_model("vit", {.width = 100, .heads = 3}), UsageError);
}

TEST(Zoo, UnknownNameListsTheZoo) {
  cohort::testing::expect_error<UsageError>([] { create_model("alexnet"); },
                                            "mlp, cnn, resnet18, vit");
}

}  // namespace
}  // namespace cohort::models

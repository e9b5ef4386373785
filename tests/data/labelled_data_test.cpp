#include "cohort/data/labelled_data.h"

#include <gtest/gtest.h>

#include <fstream>

#include <torch/torch.h>

#include "cohort/data/mnist.h"
#include "cohort/error.h"
#include "support/expect.h"
#include "support/tiny_mnist.h"

namespace cohort::data {
namespace {

using cohort::testing::expect_error;

TEST(LabelledData, AnImageFolderHoldsOutASeededTestSplitAndNormalisesEveryChannel) {
  auto dir = cohort::testing::write_tiny_image_folder(cohort::testing::temp_dir("labelled_images"),
                                                      3, 20, 12);
  auto data = open_labelled_data("images:" + dir.string(), {.image_size = 8, .test_size = 0.25});
  EXPECT_EQ(data.kind, LabelledData::Kind::kImages);
  EXPECT_EQ(data.class_names, (std::vector<std::string>{"class0", "class1", "class2"}));
  EXPECT_EQ(data.num_classes, 3);
  EXPECT_EQ(data.channels, 3);  // decoded as colour unless asked for grayscale
  EXPECT_EQ(data.image_size, 8);
  EXPECT_EQ(data.train.num_source_rows(), 45);
  EXPECT_EQ(data.test.num_source_rows(), 15);
  auto test = materialize_labelled(data.test, data.normalize);
  ASSERT_EQ(test.inputs.sizes(), (std::vector<int64_t>{15, 3, 8, 8}));
  EXPECT_EQ(test.inputs.scalar_type(), torch::kFloat);
  EXPECT_GE(test.inputs.min().item<float>(), -1.0f);  // (x / 255 - 0.5) / 0.5
  EXPECT_LE(test.inputs.max().item<float>(), 1.0f);
  // The held-out rows come from every class, not the last folder only.
  EXPECT_GT(std::get<0>(at::_unique(test.targets)).numel(), 1);
  EXPECT_NE(data.describe().find("45 train and 15 test rows, 3 classes, 3x8x8"), std::string::npos);

  auto gray = open_labelled_data("images:" + dir.string(), {.image_size = 8, .grayscale = true});
  EXPECT_EQ(gray.channels, 1);
}

TEST(LabelledData, MnistFilesAreTheirOwnSplitsNormalisedAsLoadMnistNormalises) {
  const auto dir =
      cohort::testing::write_tiny_mnist(cohort::testing::temp_dir("labelled_mnist"), 64, 16);
  const auto data = open_labelled_data("mnist:" + dir.string());
  EXPECT_EQ(data.kind, LabelledData::Kind::kMnist);
  EXPECT_EQ(data.num_classes, 10);
  EXPECT_EQ(data.channels, 1);
  EXPECT_EQ(data.image_size, 28);
  // Counted from the files' headers, before anything is loaded.
  EXPECT_EQ(data.train.num_source_rows(), 64);
  EXPECT_EQ(data.test.num_source_rows(), 16);
  EXPECT_NE(data.describe().find("mnist " + dir.string() +
                                 ": 64 train and 16 test rows, 10 "
                                 "classes, 1x28x28 (0, 1, 2"),
            std::string::npos)
      << data.describe();
  // The test split through `normalize`: the pixels and labels of load_mnist, to float rounding.
  const auto test = materialize_labelled(data.test, data.normalize);
  const auto loaded = load_mnist(dir, Split::kTest);
  ASSERT_EQ(test.inputs.sizes(), (std::vector<int64_t>{16, 1, 28, 28}));
  EXPECT_TRUE(torch::allclose(test.inputs, loaded.transform(loaded.inputs), 1e-5, 1e-5));
  EXPECT_TRUE(torch::equal(test.targets, loaded.targets));

  expect_error<UsageError>([&] { open_labelled_data("mnist:" + (dir / "none").string()); },
                           "does not exist: install dataset-fashion-mnist or pass --data-dir");
  expect_error<UsageError>([&] { open_labelled_data("mnist:" + dir.string(), {.image_size = 32}); },
                           "has 28x28 images, which are not resized (image size 32)");
  std::filesystem::remove(dir / "t10k-labels-idx1-ubyte.gz");
  expect_error<UsageError>([&] { open_labelled_data("mnist:" + dir.string()); },
                           "has no t10k-labels-idx1-ubyte");
  expect_error<UsageError>([] { open_labelled_data("mnist:"); }, "names no folder");
}

TEST(LabelledData, TrainAndTestFoldersAreTheSplitsAndTheirClassesMustAgree) {
  auto dir = cohort::testing::write_tiny_image_folder(cohort::testing::temp_dir("labelled_split"),
                                                      2, 8, 8, true);
  auto data = open_labelled_data("images:" + dir.string(), {.image_size = 8});
  EXPECT_EQ(data.train.num_source_rows(), 16);
  EXPECT_EQ(data.test.num_source_rows(), 4);
  std::filesystem::rename(dir / "test" / "class1", dir / "test" / "other");
  expect_error<UsageError>([&] { open_labelled_data("images:" + dir.string()); },
                           "the classes of train/ (class0, class1) and of test/ (class0, other) "
                           "differ");
}

TEST(LabelledData, ACsvIsStandardisedFeaturesAsAVectorImage) {
  auto file = cohort::testing::write_tiny_csv(
      cohort::testing::temp_dir("labelled_csv") / "rows.csv", 200, 5, 4);
  auto data = open_labelled_data("csv:" + file.string(),
                                 {.label_column = "label", .test_size = 0.1, .seed = 3});
  EXPECT_EQ(data.kind, LabelledData::Kind::kCsv);
  EXPECT_EQ(data.num_classes, 4);
  EXPECT_EQ(data.channels, 5);
  EXPECT_EQ(data.image_size, 1);
  EXPECT_EQ(data.train.num_source_rows(), 180);
  EXPECT_EQ(data.test.num_source_rows(), 20);
  auto train = materialize_labelled(data.train, data.normalize);
  ASSERT_EQ(train.inputs.sizes(), (std::vector<int64_t>{180, 5, 1, 1}));
  // Standardised on the train split: mean 0 and deviation 1 in every feature, the column
  // written 100 times larger too.
  auto features = train.inputs.flatten(1);
  EXPECT_LT(features.mean(0).abs().max().item<float>(), 1e-4);
  EXPECT_NEAR(features.std(0, false).min().item<float>(), 1.0, 1e-3);
  EXPECT_NEAR(features.std(0, false).max().item<float>(), 1.0, 1e-3);
}

// A file's bytes as a language model's rows: each row's targets are its tokens shifted by one,
// and the text's end is the test split.
TEST(LabelledData, ATextIsRowsOfBytesAndTheBytesThatFollow) {
  const auto file = cohort::testing::temp_dir("labelled_text") / "book.txt";
  std::string text;
  for (int i = 0; i < 1000; ++i) text += static_cast<char>('a' + (i * 7) % 26);
  std::ofstream(file, std::ios::binary) << text;
  auto data = open_labelled_data("text:" + file.string(), {.context = 16, .test_size = 0.1});
  EXPECT_EQ(data.kind, LabelledData::Kind::kText);
  EXPECT_EQ(data.num_classes, 256);
  EXPECT_EQ(data.context, 16);
  // (1000 - 1) / 16 = 62 rows: 6 held out.
  EXPECT_EQ(data.train.num_source_rows(), 56);
  EXPECT_EQ(data.test.num_source_rows(), 6);
  const auto train =
      materialize_labelled(data.train, data.normalize, data.input_column, data.target_column);
  const auto test =
      materialize_labelled(data.test, data.normalize, data.input_column, data.target_column);
  ASSERT_EQ(train.inputs.sizes(), (std::vector<int64_t>{56, 16}));
  EXPECT_EQ(train.inputs.scalar_type(), torch::kLong);
  for (int64_t row : {0, 37}) {
    for (int64_t t = 0; t < 16; ++t) {
      const auto at = static_cast<size_t>(row * 16 + t);
      EXPECT_EQ(train.inputs[row][t].item<int64_t>(), static_cast<unsigned char>(text[at]));
      EXPECT_EQ(train.targets[row][t].item<int64_t>(), static_cast<unsigned char>(text[at + 1]));
    }
  }
  EXPECT_EQ(test.inputs[5][15].item<int64_t>(), static_cast<unsigned char>(text[61 * 16 + 15]));
  EXPECT_EQ(test.targets[5][15].item<int64_t>(), static_cast<unsigned char>(text[62 * 16]));
  // Random tokens: seeded, the same rows for the same seed.
  const auto a = open_labelled_data("random-tokens:40", {.context = 8, .seed = 4});
  const auto b = open_labelled_data("random-tokens:40", {.context = 8, .seed = 4});
  EXPECT_EQ(a.train.num_source_rows() + a.test.num_source_rows(), 40);
  EXPECT_TRUE(torch::equal(a.train.take()["tokens"], b.train.take()["tokens"]));

  expect_error<UsageError>([&] { open_labelled_data("text:" + file.string(), {.context = 600}); },
                           "has 1000 bytes, too few for 2 rows of 600 tokens");
  expect_error<UsageError>([&] { open_labelled_data("text:/no/such/file"); },
                           "cannot read /no/such/file");
  expect_error<UsageError>([&] { open_labelled_data("random-tokens:many"); },
                           "give the rows of random tokens as a number >= 2");
  expect_error<UsageError>([] { open_labelled_data("text:"); }, "names no file");
}

TEST(LabelledData, BadInputIsNamedWithTheFix) {
  auto dir = cohort::testing::temp_dir("labelled_bad");
  expect_error<UsageError>([] { open_labelled_data("parquet:x"); },
                           "unknown scheme 'parquet': use images:DIR");
  expect_error<UsageError>([] { open_labelled_data("some/dir"); }, "unknown scheme 'some/dir'");
  expect_error<UsageError>([] { open_labelled_data("images:"); }, "names no folder");
  expect_error<UsageError>([&] { open_labelled_data("images:" + (dir / "none").string()); },
                           "is not a directory");
  std::filesystem::create_directories(dir / "flat");
  std::ofstream(dir / "flat" / "a.pgm") << "P5\n1 1\n255\n";
  expect_error<UsageError>([&] { open_labelled_data("images:" + (dir / "flat").string()); },
                           "has no class sub-folders");
  cohort::testing::write_tiny_image_folder(dir / "one", 1, 4, 8);
  expect_error<UsageError>([&] { open_labelled_data("images:" + (dir / "one").string()); },
                           "has 1 class folder (class0): a classifier needs at least 2");

  const auto csv = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir / name) << text;
    return "csv:" + (dir / name).string();
  };
  const auto ok = csv("ok.csv", "a,label\n1,0\n2,1\n3,0\n");
  expect_error<UsageError>([&] { open_labelled_data(ok); }, "name its class column");
  expect_error<UsageError>([&] { open_labelled_data(ok, {.label_column = "y"}); },
                           "has no column 'y' (it has a, label)");
  expect_error<UsageError>(
      [&] { open_labelled_data(csv("empty.csv", "a,label\n"), {.label_column = "label"}); },
      "has a header but no data rows");
  expect_error<UsageError>(
      [&] { open_labelled_data(csv("nothing.csv", ""), {.label_column = "label"}); },
      "is empty (it needs a header line)");
  expect_error<UsageError>(
      [&] {
        open_labelled_data(csv("ragged.csv", "a,b,label\n1,2,0\n1,1\n"), {.label_column = "label"});
      },
      "ragged.csv:3 has 2 fields where the header has 3");
  expect_error<UsageError>(
      [&] {
        open_labelled_data(csv("negative.csv", "a,label\n1,0\n2,-1\n"), {.label_column = "label"});
      },
      "holds -1: class labels are whole numbers from 0");
  expect_error<UsageError>(
      [&] {
        open_labelled_data(csv("oneclass.csv", "a,label\n1,0\n2,0\n"), {.label_column = "label"});
      },
      "holds one class (0)");
  expect_error<UsageError>(
      [&] { open_labelled_data(csv("onlylabel.csv", "label\n0\n1\n"), {.label_column = "label"}); },
      "has only its class column 'label'");
  expect_error<UsageError>(
      [&] { open_labelled_data(csv("onerow.csv", "a,label\n1,1\n"), {.label_column = "label"}); },
      "has 1 row(s): holding out a test split needs at least 2");
  expect_error<UsageError>(
      [&] { open_labelled_data(ok, {.label_column = "label", .test_size = 1}); },
      "test size 1.000000 must be a fraction between 0 and 1");
}

}  // namespace
}  // namespace cohort::data

// The data's flags for a user's own program (cli::DataOptions, add_data_options): what they name,
// the Trainer's dataset and the test set they give, a bad value named by its flag, and the same
// options through JSON (the workers' copy).
#include "cohort/cli/data_options.h"

#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "cohort/data/data_iterator.h"
#include "cohort/data/mnist.h"
#include "cohort/error.h"
#include "support/expect.h"
#include "support/parse_flags.h"
#include "support/tiny_mnist.h"

namespace cohort::cli {
namespace {

DataOptions data_flags(std::vector<std::string> args) {
  CLI::App app("test");
  DataOptions options;
  add_data_options(&app, options);
  cohort::testing::parse_flags(app, std::move(args));
  return options;
}

TEST(DataOptions, TheFlagsNameTheDataAsOpenLabelledDataReadsIt) {
  EXPECT_EQ(data_flags({}).spec(), "mnist:" + data::default_fashion_mnist_dir().string());
  EXPECT_EQ(data_flags({"--data-dir", "/some/idx"}).spec(), "mnist:/some/idx");
  EXPECT_EQ(data_flags({"--dataset", "mnist", "--data-dir", "/m"}).spec(), "mnist:/m");
  const auto rows = cohort::testing::write_tiny_csv(
      cohort::testing::temp_dir("data_options_csv") / "rows.csv", 60, 3, 2);
  const auto csv = data_flags({"--data", "csv:" + rows.string(), "--label", "label"});
  EXPECT_EQ(csv.spec(), "csv:" + rows.string());
  EXPECT_FALSE(csv.is_text());
  const auto csv_data = csv.open(0);
  EXPECT_EQ(std::make_pair(csv_data.input_column, csv_data.target_column),
            std::make_pair(std::string("image"), std::string("label")));
  const auto tokens = data_flags({"--data", "random-tokens:64"});
  EXPECT_TRUE(tokens.is_text());
  const auto token_data = tokens.open(0, /*context=*/8);
  EXPECT_EQ(std::make_pair(token_data.input_column, token_data.target_column),
            std::make_pair(std::string("tokens"), std::string("next_tokens")));
}

TEST(DataOptions, MnistFilesGiveTheTrainersShuffledDatasetAndTheTestSetTheFlagsLimit) {
  const auto dir =
      cohort::testing::write_tiny_mnist(cohort::testing::temp_dir("data_options"), 96, 32);
  const auto options = data_flags({"--data-dir", dir.string(), "--train-examples", "40",
                                   "--test-examples", "12", "--data-workers", "0"});
  const auto data = options.open(/*seed=*/5);
  EXPECT_EQ(data.kind, data::LabelledData::Kind::kMnist);
  EXPECT_EQ(options.train_rows(data), 40);
  // "train": the first 40 rows, in an order of the seed, normalised.
  const auto datasets = options.datasets(data, /*seed=*/5);
  ASSERT_EQ(datasets.count("train"), 1u);
  const auto rows = datasets.at("train").take();
  EXPECT_EQ(rows.num_rows(), 40);
  EXPECT_EQ(rows["image"].scalar_type(), torch::kFloat);
  const auto first = data.train.limit(40).take()["label"];
  EXPECT_FALSE(torch::equal(rows["label"], first));  // shuffled
  EXPECT_TRUE(torch::equal(std::get<0>(rows["label"].sort()), std::get<0>(first.sort())));
  // The test set: the first 12 test rows, as load_mnist gives them (to float rounding).
  const auto test = options.test_set(data);
  const auto loaded = data::load_mnist(dir, data::Split::kTest);
  ASSERT_EQ(test.size(), 12);
  EXPECT_TRUE(torch::equal(test.targets, loaded.targets.narrow(0, 0, 12)));
  EXPECT_TRUE(
      torch::allclose(test.inputs, loaded.transform(loaded.inputs.narrow(0, 0, 12)), 1e-5, 1e-5));
  // Without --test-examples, every test row.
  EXPECT_EQ(data_flags({"--data-dir", dir.string()}).test_set(data).size(), 32);
}

TEST(DataOptions, ABadValueIsNamedByItsFlagBeforeAnythingIsRead) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--dataset", "cifar"}, "unknown --dataset 'cifar': choose fashion-mnist or mnist"},
      {{"--dataset", "mnist"}, "--dataset mnist has no default location: pass --data-dir"},
      {{"--data", "images:/x", "--label", "y"},
       "--label y names a CSV's class column: use it with --data csv:FILE"},
      {{"--data", "csv:/x.csv", "--data-dir", "/d"}, "both name the data: give one"},
      {{"--image-size", "32"}, "MNIST-format data has 28x28 images and its own test split"},
      {{"--data", "mnist:/d", "--test-size", "0.2"}, "MNIST-format data has 28x28 images"},
      {{"--train-examples", "-1"}, "--train-examples must be >= 0 (0: all)"},
      {{"--test-examples", "-3"}, "--test-examples -3 must be >= 0 (0: all)"},
      {{"--data-workers", "-2"}, "--data-workers must be >= 0, or -1 for one per free CPU"},
      {{"--data", "parquet:/x"}, "unknown scheme 'parquet'"},
      {{"--data-dir", "/no/such/idx"}, "/no/such/idx does not exist"},
  };
  for (const auto& [args, message] : cases) {
    SCOPED_TRACE(args.front());
    const auto options = data_flags(args);
    cohort::testing::expect_error<UsageError>([&] { options.open(0); }, message);
  }
}

TEST(DataOptions, TheSameOptionsComeBackFromJson) {
  const auto options = data_flags({"--data", "images:/pics", "--image-size", "32", "--test-size",
                                   "0.25", "--train-examples", "100", "--data-workers", "-1"});
  const auto read = Json(options).get<DataOptions>();
  EXPECT_EQ(Json(read), Json(options));
  EXPECT_EQ(read.data, "images:/pics");
  EXPECT_EQ(read.image_size, 32);
  EXPECT_EQ(read.test_size, 0.25);
  EXPECT_EQ(read.train_examples, 100);
  EXPECT_EQ(read.data_workers, -1);
  // A missing key keeps its default; a value of the wrong type names its key.
  EXPECT_EQ(Json::object().get<DataOptions>().dataset, "fashion-mnist");
  cohort::testing::expect_error<UsageError>(
      [] {
        Json{{"image_size", "big"}}.get<DataOptions>();
      },
      "image_size");
}

}  // namespace
}  // namespace cohort::cli

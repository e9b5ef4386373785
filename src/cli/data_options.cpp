#include "cohort/cli/data_options.h"

#include "cohort/data/mnist.h"
#include "cohort/error.h"

namespace cohort::cli {
namespace {

bool starts_with(const std::string& text, const char* prefix) { return text.rfind(prefix, 0) == 0; }

// The flags' own checks, before anything is read.
void check_flags(const DataOptions& o) {
  if (o.dataset != "fashion-mnist" && o.dataset != "mnist") {
    throw UsageError("unknown --dataset '" + o.dataset + "': choose fashion-mnist or mnist");
  }
  if (!o.label.empty() && !starts_with(o.data, "csv:")) {
    throw UsageError("--label " + o.label +
                     " names a CSV's class column: use it with --data csv:FILE");
  }
  if (!o.data.empty() && !o.data_dir.empty()) {
    throw UsageError("--data " + o.data + " and --data-dir " + o.data_dir +
                     " both name the data: give one (--data-dir is for MNIST-format files)");
  }
  if ((o.data.empty() || starts_with(o.data, "mnist:")) &&
      (o.image_size != DataOptions{}.image_size || o.test_size != DataOptions{}.test_size)) {
    throw UsageError(
        "--image-size and --test-size shape the data of --data images:DIR or csv:FILE; "
        "MNIST-format data has 28x28 images and its own test split");
  }
  if (o.train_examples < 0) throw UsageError("--train-examples must be >= 0 (0: all)");
  if (o.test_examples < 0) {
    throw UsageError("--test-examples " + std::to_string(o.test_examples) +
                     " must be >= 0 (0: all)");
  }
  if (o.data_workers < -1)
    throw UsageError("--data-workers must be >= 0, or -1 for one per free CPU");
}

}  // namespace

std::string DataOptions::spec() const {
  check_flags(*this);
  if (!data.empty()) return data;
  if (!data_dir.empty()) return "mnist:" + data_dir;
  if (dataset == "fashion-mnist") return "mnist:" + data::default_fashion_mnist_dir().string();
  throw UsageError("--dataset " + dataset + " has no default location: pass --data-dir");
}

bool DataOptions::is_text() const {
  return starts_with(data, "text:") || starts_with(data, "random-tokens:");
}

data::LabelledData DataOptions::open(uint64_t seed, int64_t context) const {
  return data::open_labelled_data(spec(), {.label_column = label,
                                           .image_size = image_size,
                                           .context = context,
                                           .test_size = test_size,
                                           .seed = seed});
}

int64_t DataOptions::train_rows(const data::LabelledData& data) const {
  const int64_t rows = data.train.num_source_rows();
  return train_examples > 0 ? std::min(rows, train_examples) : rows;
}

std::map<std::string, data::Dataset> DataOptions::datasets(const data::LabelledData& data,
                                                           uint64_t seed) const {
  auto train = data.train;
  if (train_examples > 0) train = train.limit(train_examples);
  return {{"train", train.random_shuffle(seed).map_batches(
                        data.normalize,
                        {.name = "normalize", .batch_size = 256, .num_workers = data_workers})}};
}

data::TensorDataset DataOptions::test_set(const data::LabelledData& data) const {
  auto test = data.test;
  if (test_examples > 0) test = test.limit(test_examples);
  return data::materialize_labelled(test, data.normalize, data.input_column, data.target_column);
}

void to_json(Json& j, const DataOptions& o) {
  j = Json{{"dataset", o.dataset},
           {"data_dir", o.data_dir},
           {"data", o.data},
           {"label", o.label},
           {"image_size", o.image_size},
           {"test_size", o.test_size},
           {"train_examples", o.train_examples},
           {"test_examples", o.test_examples},
           {"data_workers", o.data_workers}};
}

void from_json(const Json& j, DataOptions& o) {
  const DataOptions d;
  o.dataset = json_field(j, "dataset", d.dataset);
  o.data_dir = json_field(j, "data_dir", d.data_dir);
  o.data = json_field(j, "data", d.data);
  o.label = json_field(j, "label", d.label);
  o.image_size = json_field(j, "image_size", d.image_size);
  o.test_size = json_field(j, "test_size", d.test_size);
  o.train_examples = json_field(j, "train_examples", d.train_examples);
  o.test_examples = json_field(j, "test_examples", d.test_examples);
  o.data_workers = json_field(j, "data_workers", d.data_workers);
}

void add_data_options(CLI::App* cmd, DataOptions& o) {
  const auto group = "Model and data";
  cmd->add_option("--dataset", o.dataset, "fashion-mnist or mnist")
      ->capture_default_str()
      ->group(group);
  cmd->add_option("--data-dir", o.data_dir,
                  "folder with the four IDX files (default for fashion-mnist: " +
                      data::default_fashion_mnist_dir().string() + ")")
      ->group(group);
  cmd->add_option("--data", o.data,
                  "your own data instead: images:DIR (a sub-folder per class, or train/ and "
                  "test/ folders of them), csv:FILE (numbers, a header line; with --label), "
                  "mnist:DIR (MNIST-format files); for a language model text:FILE (its bytes as "
                  "tokens, the last --test-size held out) or random-tokens:ROWS")
      ->group(group);
  cmd->add_option("--label", o.label, "with --data csv:FILE: the class column (0, 1, ...)")
      ->group(group);
  cmd->add_option("--image-size", o.image_size,
                  "with --data images:DIR: each image resized to this square")
      ->capture_default_str()
      ->group(group);
  cmd->add_option("--test-size", o.test_size,
                  "with --data: the fraction held out for evaluation where the data has no "
                  "test split (seeded by --seed)")
      ->capture_default_str()
      ->group(group);
  cmd->add_option("--train-examples", o.train_examples,
                  "train on the first N examples only (0: all)")
      ->capture_default_str()
      ->group(group);
  cmd->add_option("--test-examples", o.test_examples,
                  "evaluate on the first N test examples only (0: all)")
      ->capture_default_str()
      ->group(group);
  cmd->add_option(
         "--data-workers", o.data_workers,
         "preprocessing processes per worker for the training data (0: the worker's own prefetch "
         "thread; -1: one per CPU the workers leave free)")
      ->capture_default_str()
      ->group(group);
}

}  // namespace cohort::cli

#include "cohort/data/labelled_data.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <utility>

#include "cohort/data/block.h"
#include "cohort/data/mnist.h"
#include "cohort/data/preprocessors.h"
#include "cohort/data/tensor_dataset.h"
#include "cohort/error.h"

namespace cohort::data {

namespace {

constexpr const char* kSchemes =
    "use images:DIR (one sub-folder per class), csv:FILE with its class column named, text:FILE, "
    "random-tokens:ROWS or mnist:DIR (MNIST-format IDX files)";

std::string join_class_names(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

// Holds `test_size` of `all` out as the test split; names the data when it has too few rows.
void hold_out(LabelledData& data, const Dataset& all, const std::string& spec,
              const LabelledDataOptions& options) {
  const int64_t rows = all.num_source_rows();
  if (rows < 2) {
    throw UsageError("data " + spec + " has " + std::to_string(rows) +
                     " row(s): holding out a test split needs at least 2 (add rows" +
                     (data.kind == LabelledData::Kind::kImages
                          ? std::string(", or give train/ and test/ folders of classes)")
                          : std::string(")")));
  }
  std::tie(data.train, data.test) = all.train_test_split(options.test_size, options.seed);
}

void open_images(LabelledData& data, const std::string& spec, const LabelledDataOptions& options) {
  if (options.image_size < 1) {
    throw UsageError("data " + spec + ": image size " + std::to_string(options.image_size) +
                     " must be >= 1 (each image is resized to image_size x image_size)");
  }
  if (!std::filesystem::is_directory(data.path)) {
    throw UsageError("data " + spec + ": " + data.path.string() +
                     " is not a directory (it must hold one sub-folder of images per class, or "
                     "train/ and test/ folders of them)");
  }
  const ImageFolderOptions read{
      .height = options.image_size, .width = options.image_size, .grayscale = options.grayscale};
  const auto train_dir = data.path / "train";
  const auto test_dir = data.path / "test";
  if (std::filesystem::is_directory(train_dir) && std::filesystem::is_directory(test_dir)) {
    data.train = Dataset::read_images(train_dir, read);
    data.test = Dataset::read_images(test_dir, read);
    if (data.test.class_names() != data.train.class_names()) {
      throw UsageError("data " + spec + ": the classes of train/ (" +
                       join_class_names(data.train.class_names()) + ") and of test/ (" +
                       join_class_names(data.test.class_names()) +
                       ") differ: give both the same class sub-folders");
    }
  } else {
    hold_out(data, Dataset::read_images(data.path, read), spec, options);
  }
  data.class_names = data.train.class_names();
  data.num_classes = static_cast<int64_t>(data.class_names.size());
  if (data.num_classes < 2) {
    throw UsageError("data " + spec + " has " + std::to_string(data.num_classes) +
                     " class folder (" + join_class_names(data.class_names) +
                     "): a classifier needs at least 2 sub-folders, one per class");
  }
  // The channels of the decoded images (1 for grayscale files unless converted, else 3).
  data.channels = data.train.limit(1).take()["image"].size(1);
  data.image_size = options.image_size;
  const std::vector<double> half(static_cast<size_t>(data.channels), 0.5);
  data.normalize = Normalize{.mean = half, .std = half};
}

void open_csv(LabelledData& data, const std::string& spec, const LabelledDataOptions& options) {
  if (options.label_column.empty()) {
    throw UsageError("data " + spec +
                     ": name its class column (cohort train --label COLUMN; "
                     "LabelledDataOptions::label_column)");
  }
  auto all = Dataset::read_csv(data.path, {.label_column = options.label_column});
  const Block rows = all.take();
  if (rows.num_rows() == 0) {
    throw UsageError("data " + spec + " has a header but no data rows: add rows of numbers");
  }
  const auto& labels = rows["label"];
  const int64_t lowest = labels.min().item<int64_t>();
  if (lowest < 0) {
    throw UsageError("data " + spec + ": column '" + options.label_column + "' holds " +
                     std::to_string(lowest) + ": class labels are whole numbers from 0");
  }
  data.num_classes = labels.max().item<int64_t>() + 1;
  if (data.num_classes < 2) {
    throw UsageError("data " + spec + ": column '" + options.label_column +
                     "' holds one class (0): a classifier needs labels of at least 2 classes");
  }
  for (int64_t c = 0; c < data.num_classes; ++c) data.class_names.push_back(std::to_string(c));
  data.channels = rows["features"].size(1);
  if (data.channels == 0) {
    throw UsageError("data " + spec + " has only its class column '" + options.label_column +
                     "': add feature columns");
  }
  data.image_size = 1;
  hold_out(data, all, spec, options);
  // Standardised with the train split's statistics, then shaped as a [features, 1, 1] image.
  StandardScaler scaler("features");
  scaler.fit(data.train);
  data.normalize = [scaler](Block block) {
    block = scaler(std::move(block));
    auto features = block["features"];
    block.columns.erase("features");
    block.columns["image"] = features.reshape({features.size(0), features.size(1), 1, 1});
    return block;
  };
}

// MNIST-format files: their own splits, 10 classes, pixels scaled to [0, 1] and normalised with
// Fashion-MNIST's statistics (data::MnistOptions).
void open_mnist(LabelledData& data, const std::string& spec, const LabelledDataOptions& options) {
  // A missing folder or file is named by check_mnist_dir, with the fix.
  const auto train = mnist_shape(data.path, Split::kTrain);
  const auto test = mnist_shape(data.path, Split::kTest);
  if (train[1] != train[2] || test[1] != train[1] || test[2] != train[2]) {
    throw UsageError("data " + spec + ": its images are " + std::to_string(train[1]) + "x" +
                     std::to_string(train[2]) + " (train) and " + std::to_string(test[1]) + "x" +
                     std::to_string(test[2]) +
                     " (test): the models read square images of one size in both splits");
  }
  if (options.image_size != LabelledDataOptions{}.image_size && options.image_size != train[1]) {
    throw UsageError("data " + spec + " has " + std::to_string(train[1]) + "x" +
                     std::to_string(train[1]) + " images, which are not resized (image size " +
                     std::to_string(options.image_size) + "): give none, or images:DIR");
  }
  data.train = Dataset::from_mnist(data.path, Split::kTrain);
  data.test = Dataset::from_mnist(data.path, Split::kTest);
  data.num_classes = 10;
  for (int64_t c = 0; c < data.num_classes; ++c) data.class_names.push_back(std::to_string(c));
  data.channels = 1;
  data.image_size = train[1];
  const MnistOptions stats;
  data.normalize = Normalize{.mean = {stats.mean}, .std = {stats.std}};
}

// Bytes as tokens: row i is bytes [i T, (i + 1) T) and its targets the bytes one further on.
void open_text(LabelledData& data, const std::string& spec, bool random,
               const LabelledDataOptions& options) {
  const int64_t context = options.context;
  if (context < 1) {
    throw UsageError("data " + spec + ": a context of " + std::to_string(context) +
                     " tokens: give rows of at least 1 token (--context)");
  }
  at::Tensor bytes;
  if (random) {
    int64_t rows = 0;
    try {
      size_t used = 0;
      rows = std::stoll(data.path.string(), &used);
      if (used != data.path.string().size()) rows = 0;
    } catch (const std::logic_error&) {
      rows = 0;
    }
    if (rows < 2) {
      throw UsageError("data " + spec +
                       ": give the rows of random tokens as a number >= 2 (e.g. "
                       "random-tokens:4096)");
    }
    at::Generator generator = at::detail::createCPUGenerator(options.seed);
    bytes = at::randint(0, 256, {rows * context + 1}, generator, at::kByte);
    data.path = "(" + std::to_string(rows) + " rows of random tokens)";
  } else {
    std::ifstream in(data.path, std::ios::binary);
    if (!in) {
      throw UsageError("data " + spec + ": cannot read " + data.path.string() +
                       ": name a file of text (any bytes)");
    }
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    bytes = at::empty({static_cast<int64_t>(text.size())}, at::kByte);
    if (!text.empty()) std::memcpy(bytes.data_ptr(), text.data(), text.size());
  }
  const int64_t rows = std::max<int64_t>(bytes.numel() - 1, 0) / context;
  if (rows < 2) {
    throw UsageError("data " + spec + " has " + std::to_string(bytes.numel()) +
                     " bytes, too few for 2 rows of " + std::to_string(context) +
                     " tokens and the token after them: use a longer file or a shorter --context");
  }
  const auto inputs = bytes.narrow(0, 0, rows * context).view({rows, context});
  const auto targets = bytes.narrow(0, 1, rows * context).view({rows, context});
  // The text's end is the test split (a held-out passage, not rows scattered through it).
  const int64_t test_rows =
      std::clamp<int64_t>(std::llround(options.test_size * static_cast<double>(rows)), 1, rows - 1);
  const int64_t train_rows = rows - test_rows;
  data.train = Dataset::from_tensors({{"tokens", inputs.narrow(0, 0, train_rows).clone()},
                                      {"next_tokens", targets.narrow(0, 0, train_rows).clone()}});
  data.test =
      Dataset::from_tensors({{"tokens", inputs.narrow(0, train_rows, test_rows).clone()},
                             {"next_tokens", targets.narrow(0, train_rows, test_rows).clone()}});
  data.num_classes = 256;
  data.context = context;
  data.channels = 1;
  data.image_size = 1;
  data.input_column = "tokens";
  data.target_column = "next_tokens";
  data.normalize = [](Block block) {
    for (const char* column : {"tokens", "next_tokens"})
      block[column] = block[column].to(at::kLong);
    return block;
  };
}

}  // namespace

std::string LabelledData::describe() const {
  if (kind == Kind::kText) {
    return "text " + path.string() + ": " + std::to_string(train.num_source_rows()) +
           " train and " + std::to_string(test.num_source_rows()) + " test rows of " +
           std::to_string(context) + " tokens, a vocabulary of " + std::to_string(num_classes);
  }
  const char* scheme = kind == Kind::kImages ? "images " : kind == Kind::kCsv ? "csv " : "mnist ";
  std::string classes;
  for (size_t c = 0; c < class_names.size() && c < 10; ++c)
    classes += (c ? ", " : "") + class_names[c];
  if (class_names.size() > 10) classes += ", ...";
  return scheme + path.string() + ": " + std::to_string(train.num_source_rows()) + " train and " +
         std::to_string(test.num_source_rows()) + " test rows, " + std::to_string(num_classes) +
         " classes, " + std::to_string(channels) + "x" + std::to_string(image_size) + "x" +
         std::to_string(image_size) + " (" + classes + ")";
}

LabelledData open_labelled_data(const std::string& spec, const LabelledDataOptions& options) {
  const auto colon = spec.find(':');
  const std::string scheme = colon == std::string::npos ? spec : spec.substr(0, colon);
  if (colon == std::string::npos || (scheme != "images" && scheme != "csv" && scheme != "text" &&
                                     scheme != "random-tokens" && scheme != "mnist")) {
    throw UsageError("data '" + spec + "': unknown scheme '" + scheme + "': " + kSchemes);
  }
  if (colon + 1 == spec.size()) {
    throw UsageError("data '" + spec + "' names no " +
                     (scheme == "images" || scheme == "mnist" ? "folder"
                      : scheme == "random-tokens"             ? "row count"
                                                              : "file") +
                     ": " + kSchemes);
  }
  if (!(options.test_size > 0 && options.test_size < 1)) {
    throw UsageError("data " + spec + ": test size " + std::to_string(options.test_size) +
                     " must be a fraction between 0 and 1 (e.g. 0.1)");
  }
  LabelledData data;
  data.path = spec.substr(colon + 1);
  if (scheme == "text" || scheme == "random-tokens") {
    data.kind = LabelledData::Kind::kText;
    open_text(data, spec, scheme == "random-tokens", options);
  } else if (scheme == "images") {
    data.kind = LabelledData::Kind::kImages;
    open_images(data, spec, options);
  } else if (scheme == "mnist") {
    data.kind = LabelledData::Kind::kMnist;
    open_mnist(data, spec, options);
  } else {
    data.kind = LabelledData::Kind::kCsv;
    open_csv(data, spec, options);
  }
  return data;
}

TensorDataset materialize_labelled(const Dataset& dataset, const BatchFn& normalize,
                                   const std::string& input_column,
                                   const std::string& target_column) {
  Block rows = normalize(dataset.take());
  return TensorDataset{.inputs = rows[input_column], .targets = rows[target_column]};
}

}  // namespace cohort::data

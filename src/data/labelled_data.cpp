#include "cohort/data/labelled_data.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <utility>

#include "cohort/data/block.h"
#include "cohort/data/preprocessors.h"
#include "cohort/data/tensor_dataset.h"
#include "cohort/error.h"

namespace cohort::data {

namespace {

constexpr const char* kSchemes =
    "use images:DIR (one sub-folder per class) or csv:FILE with its class column named";

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

}  // namespace

std::string LabelledData::describe() const {
  return std::string(kind == Kind::kImages ? "images " : "csv ") + path.string() + ": " +
         std::to_string(train.num_source_rows()) + " train and " +
         std::to_string(test.num_source_rows()) + " test rows, " + std::to_string(num_classes) +
         " classes, " + std::to_string(channels) + "x" + std::to_string(image_size) + "x" +
         std::to_string(image_size);
}

LabelledData open_labelled_data(const std::string& spec, const LabelledDataOptions& options) {
  const auto colon = spec.find(':');
  const std::string scheme = colon == std::string::npos ? spec : spec.substr(0, colon);
  if (colon == std::string::npos || (scheme != "images" && scheme != "csv")) {
    throw UsageError("data '" + spec + "': unknown scheme '" + scheme + "': " + kSchemes);
  }
  if (colon + 1 == spec.size()) {
    throw UsageError("data '" + spec + "' names no " + (scheme == "csv" ? "file" : "folder") +
                     ": " + kSchemes);
  }
  if (!(options.test_size > 0 && options.test_size < 1)) {
    throw UsageError("data " + spec + ": test size " + std::to_string(options.test_size) +
                     " must be a fraction between 0 and 1 (e.g. 0.1)");
  }
  LabelledData data;
  data.path = spec.substr(colon + 1);
  if (scheme == "images") {
    data.kind = LabelledData::Kind::kImages;
    open_images(data, spec, options);
  } else {
    data.kind = LabelledData::Kind::kCsv;
    open_csv(data, spec, options);
  }
  return data;
}

TensorDataset materialize_labelled(const Dataset& dataset, const BatchFn& normalize) {
  Block rows = normalize(dataset.take());
  return TensorDataset{.inputs = rows["image"], .targets = rows["label"]};
}

}  // namespace cohort::data

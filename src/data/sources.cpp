#include "data/sources.h"

#include <torch/types.h>
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <sstream>

#ifdef COHORT_WITH_OPENCV
#include <opencv2/imgcodecs.hpp>
#include <opencv2/imgproc.hpp>
#endif

#include "cohort/error.h"

namespace cohort::data {

namespace {

at::Tensor ids_tensor(const std::vector<int64_t>& rows) {
  return torch::tensor(rows, torch::kLong);
}

class TensorSource : public Source {
 public:
  TensorSource(std::map<std::string, at::Tensor> columns, std::string description)
      : description_(std::move(description)) {
    int64_t rows = -1;
    std::string first;
    for (auto& [name, column] : columns) {
      if (!column.defined() || column.dim() == 0) {
        throw UsageError("from_tensors: column '" + name +
                         "' must be a tensor with a first (row) dimension");
      }
      if (rows < 0) {
        rows = column.size(0);
        first = name;
      } else if (column.size(0) != rows) {
        throw UsageError("from_tensors: column '" + name + "' has " +
                         std::to_string(column.size(0)) + " rows but '" + first + "' has " +
                         std::to_string(rows));
      }
      columns_[name] = column.contiguous();
    }
    rows_ = std::max<int64_t>(rows, 0);
  }
  int64_t size() const override { return rows_; }
  Block read(const std::vector<int64_t>& rows, int64_t&) const override {
    auto index = ids_tensor(rows);
    Block block;
    for (const auto& [name, column] : columns_) block.columns[name] = column.index_select(0, index);
    if (!block.has(kIdColumn)) block.columns[kIdColumn] = index;
    return block;
  }
  std::string describe() const override {
    std::string cols;
    for (const auto& [name, column] : columns_) cols += (cols.empty() ? "" : ",") + name;
    return description_ + "[" + std::to_string(rows_) + " rows: " + cols + "]";
  }

 private:
  std::map<std::string, at::Tensor> columns_;
  int64_t rows_ = 0;
  std::string description_;
};

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

class SyntheticImageSource : public Source {
 public:
  SyntheticImageSource(int64_t rows, SyntheticImageOptions options)
      : rows_(rows), options_(options) {
    if (rows < 0)
      throw UsageError("synthetic_images: rows=" + std::to_string(rows) + " must be >= 0");
    if (options.height < 1 || options.width < 1 || options.channels < 1 ||
        options.num_classes < 1) {
      throw UsageError("synthetic_images: height, width, channels and num_classes must be >= 1");
    }
  }
  int64_t size() const override { return rows_; }
  Block read(const std::vector<int64_t>& rows, int64_t&) const override {
    const auto n = static_cast<int64_t>(rows.size());
    auto images =
        torch::empty({n, options_.channels, options_.height, options_.width}, torch::kUInt8);
    auto labels = torch::empty({n}, torch::kLong);
    const int64_t pixels = options_.channels * options_.height * options_.width;
    auto* out = images.data_ptr<uint8_t>();
    auto* label = labels.data_ptr<int64_t>();
    for (int64_t r = 0; r < n; ++r) {
      uint64_t state = options_.seed * 0xD1B54A32D192ED03ULL +
                       static_cast<uint64_t>(rows[static_cast<size_t>(r)]);
      label[r] =
          static_cast<int64_t>(splitmix64(state) % static_cast<uint64_t>(options_.num_classes));
      uint8_t* px = out + r * pixels;
      int64_t i = 0;
      for (; i + 8 <= pixels; i += 8) {
        const uint64_t v = splitmix64(state);
        std::memcpy(px + i, &v, 8);
      }
      if (i < pixels) {
        const uint64_t v = splitmix64(state);
        std::memcpy(px + i, &v, static_cast<size_t>(pixels - i));
      }
    }
    return Block{{{"image", images}, {"label", labels}, {kIdColumn, ids_tensor(rows)}}};
  }
  std::string describe() const override {
    return "synthetic_images[" + std::to_string(rows_) + " rows, " +
           std::to_string(options_.channels) + "x" + std::to_string(options_.height) + "x" +
           std::to_string(options_.width) + ", " + std::to_string(options_.num_classes) +
           " classes, seed " + std::to_string(options_.seed) + "]";
  }

 private:
  int64_t rows_;
  SyntheticImageOptions options_;
};

std::vector<std::string> split_line(const std::string& line, char delimiter) {
  std::vector<std::string> fields;
  std::string field;
  std::istringstream in(line);
  while (std::getline(in, field, delimiter)) fields.push_back(field);
  if (!line.empty() && line.back() == delimiter) fields.emplace_back();
  return fields;
}

std::string trim(std::string s) {
  const auto not_space = [](unsigned char c) { return !std::isspace(c); };
  s.erase(s.begin(), std::find_if(s.begin(), s.end(), not_space));
  s.erase(std::find_if(s.rbegin(), s.rend(), not_space).base(), s.end());
  return s;
}

class ImageFolderSource : public Source {
 public:
  ImageFolderSource(const std::filesystem::path& dir, ImageFolderOptions options)
      : dir_(dir), options_(options) {
    if (!std::filesystem::is_directory(dir)) {
      throw UsageError("read_images: " + dir.string() +
                       " is not a directory (it must hold one sub-folder per class)");
    }
    if ((options.height > 0) != (options.width > 0)) {
      throw UsageError("read_images: give both height and width to resize, or neither");
    }
    for (const auto& entry : std::filesystem::directory_iterator(dir)) {
      if (entry.is_directory() && entry.path().filename().string()[0] != '.') {
        classes_.push_back(entry.path().filename().string());
      }
    }
    std::sort(classes_.begin(), classes_.end());
    if (classes_.empty()) {
      throw UsageError("read_images: " + dir.string() +
                       " has no class sub-folders (expected <dir>/<class name>/<image file>)");
    }
    for (size_t label = 0; label < classes_.size(); ++label) {
      std::vector<std::filesystem::path> files;
      for (const auto& entry :
           std::filesystem::recursive_directory_iterator(dir / classes_[label])) {
        if (entry.is_regular_file() && entry.path().filename().string()[0] != '.')
          files.push_back(entry.path());
      }
      std::sort(files.begin(), files.end());
      for (auto& f : files) items_.emplace_back(std::move(f), static_cast<int64_t>(label));
    }
    if (items_.empty()) {
      throw UsageError("read_images: no image files under the sub-folders of " + dir.string() +
                       " (expected <dir>/<class name>/<image file>)");
    }
  }
  int64_t size() const override { return static_cast<int64_t>(items_.size()); }
  bool may_skip() const override { return options_.on_bad_file == OnError::kSkip; }
  const std::vector<std::string>& class_names() const override { return classes_; }

  Block read(const std::vector<int64_t>& rows, int64_t& skipped) const override {
#ifndef COHORT_WITH_OPENCV
    (void)skipped;
    throw UsageError(
        "read_images: decoding " +
        (rows.empty() ? dir_ : items_[static_cast<size_t>(rows.front())].first).string() +
        " needs OpenCV, and this cohort was built without it: rebuild with "
        "COHORT_WITH_OPENCV=ON and OpenCV's core, imgproc and imgcodecs");
#else
    std::vector<at::Tensor> images;
    std::vector<int64_t> labels;
    std::vector<int64_t> ids;
    for (int64_t row : rows) {
      const auto& [path, label] = items_[static_cast<size_t>(row)];
      cv::Mat image =
          cv::imread(path.string(), options_.grayscale ? cv::IMREAD_GRAYSCALE : cv::IMREAD_COLOR);
      if (image.empty()) {
        if (options_.on_bad_file == OnError::kSkip) {
          ++skipped;
          continue;
        }
        throw UsageError(
            "cannot decode image " + path.string() +
            " (unreadable, corrupt or not an image): remove or replace it, or read with "
            "on_bad_file = OnError::kSkip to skip such files");
      }
      if (options_.height > 0) {
        cv::resize(image, image,
                   cv::Size(static_cast<int>(options_.width), static_cast<int>(options_.height)), 0,
                   0, cv::INTER_AREA);
      }
      if (image.channels() == 3) cv::cvtColor(image, image, cv::COLOR_BGR2RGB);
      auto hwc =
          torch::from_blob(image.data, {image.rows, image.cols, image.channels()}, torch::kUInt8);
      // A copy, always: a one-channel image's [1, H, W] permutation is already contiguous, and
      // contiguous() would return a view of the cv::Mat freed at the end of this iteration.
      auto chw = hwc.permute({2, 0, 1}).clone(at::MemoryFormat::Contiguous);
      if (!images.empty() && chw.sizes() != images.front().sizes()) {
        throw UsageError("image " + path.string() + " is " + std::to_string(image.cols) + "x" +
                         std::to_string(image.rows) + " while earlier ones are " +
                         std::to_string(images.front().size(2)) + "x" +
                         std::to_string(images.front().size(1)) +
                         ": give read_images a height and width to resize every image to");
      }
      images.push_back(chw);
      labels.push_back(label);
      ids.push_back(row);
    }
    if (images.empty()) {
      const int64_t c = options_.grayscale ? 1 : 3;
      return Block{{{"image", torch::empty({0, c, std::max<int64_t>(options_.height, 1),
                                            std::max<int64_t>(options_.width, 1)},
                                           torch::kUInt8)},
                    {"label", torch::empty({0}, torch::kLong)},
                    {kIdColumn, torch::empty({0}, torch::kLong)}}};
    }
    return Block{{{"image", torch::stack(images)},
                  {"label", torch::tensor(labels, torch::kLong)},
                  {kIdColumn, ids_tensor(ids)}}};
#endif
  }
  std::string describe() const override {
    return "read_images[" + dir_.string() + ", " + std::to_string(items_.size()) + " files, " +
           std::to_string(classes_.size()) + " classes, " + std::to_string(options_.height) + "x" +
           std::to_string(options_.width) + (options_.grayscale ? " gray" : "") + "]";
  }

 private:
  std::filesystem::path dir_;
  ImageFolderOptions options_;
  std::vector<std::string> classes_;
  std::vector<std::pair<std::filesystem::path, int64_t>> items_;
};

class LazySource : public Source {
 public:
  LazySource(std::function<std::shared_ptr<const Source>()> make, std::string description,
             int64_t rows)
      : make_(std::move(make)), description_(std::move(description)), rows_(rows) {}
  int64_t size() const override { return rows_ >= 0 ? rows_ : get().size(); }
  Block read(const std::vector<int64_t>& rows, int64_t& skipped) const override {
    return get().read(rows, skipped);
  }
  std::string describe() const override { return description_; }
  const std::vector<std::string>& class_names() const override { return get().class_names(); }

 private:
  const Source& get() const {
    std::call_once(once_, [this] { source_ = make_(); });
    return *source_;
  }
  std::function<std::shared_ptr<const Source>()> make_;
  std::string description_;
  int64_t rows_;
  mutable std::once_flag once_;
  mutable std::shared_ptr<const Source> source_;
};

}  // namespace

std::shared_ptr<const Source> make_lazy_source(std::function<std::shared_ptr<const Source>()> make,
                                               std::string description, int64_t rows) {
  return std::make_shared<LazySource>(std::move(make), std::move(description), rows);
}

std::shared_ptr<const Source> make_tensor_source(std::map<std::string, at::Tensor> columns,
                                                 std::string description) {
  return std::make_shared<TensorSource>(std::move(columns), std::move(description));
}

std::shared_ptr<const Source> make_synthetic_image_source(int64_t rows,
                                                          const SyntheticImageOptions& options) {
  return std::make_shared<SyntheticImageSource>(rows, options);
}

std::shared_ptr<const Source> make_csv_source(const std::filesystem::path& path,
                                              const CsvOptions& options) {
  std::ifstream in(path);
  if (!in) throw UsageError("read_csv: cannot open " + path.string());
  std::string line;
  if (!std::getline(in, line))
    throw UsageError("read_csv: " + path.string() + " is empty (it needs a header line)");
  std::vector<std::string> header;
  for (auto& h : split_line(line, options.delimiter)) header.push_back(trim(h));
  int label = -1;
  if (!options.label_column.empty()) {
    const auto it = std::find(header.begin(), header.end(), options.label_column);
    if (it == header.end()) {
      std::string names;
      for (const auto& h : header) names += (names.empty() ? "" : ", ") + h;
      throw UsageError("read_csv: " + path.string() + " has no column '" + options.label_column +
                       "' (it has " + names + ")");
    }
    label = static_cast<int>(it - header.begin());
  }
  std::vector<float> features;
  std::vector<int64_t> labels;
  int64_t rows = 0;
  for (int64_t number = 2; std::getline(in, line); ++number) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (trim(line).empty()) continue;
    auto fields = split_line(line, options.delimiter);
    if (fields.size() != header.size()) {
      throw UsageError("read_csv: " + path.string() + ":" + std::to_string(number) + " has " +
                       std::to_string(fields.size()) + " fields where the header has " +
                       std::to_string(header.size()));
    }
    for (size_t c = 0; c < fields.size(); ++c) {
      const std::string text = trim(fields[c]);
      char* end = nullptr;
      errno = 0;
      const double value = std::strtod(text.c_str(), &end);
      if (text.empty() || end != text.c_str() + text.size() || errno == ERANGE) {
        throw UsageError("read_csv: " + path.string() + ":" + std::to_string(number) +
                         ", column '" + header[c] + "': '" + text + "' is not a number");
      }
      if (static_cast<int>(c) == label) {
        if (value != std::floor(value) || std::abs(value) > 9.0e15) {
          throw UsageError("read_csv: " + path.string() + ":" + std::to_string(number) +
                           ", label column '" + header[c] + "': '" + text +
                           "' is not a whole number (labels are class numbers)");
        }
        labels.push_back(static_cast<int64_t>(value));
      } else {
        features.push_back(static_cast<float>(value));
      }
    }
    ++rows;
  }
  const auto width = static_cast<int64_t>(header.size()) - (label >= 0 ? 1 : 0);
  std::map<std::string, at::Tensor> columns{
      {"features", torch::tensor(features, torch::kFloat).reshape({rows, width})}};
  if (label >= 0) columns["label"] = torch::tensor(labels, torch::kLong);
  return make_tensor_source(std::move(columns), "csv:" + path.string());
}

std::shared_ptr<const Source> make_image_folder_source(const std::filesystem::path& dir,
                                                       const ImageFolderOptions& options) {
  return std::make_shared<ImageFolderSource>(dir, options);
}

}  // namespace cohort::data

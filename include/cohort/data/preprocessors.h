#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "cohort/data/dataset.h"

namespace cohort::data {

// Preprocessors for map_batches: each is a function object Block -> Block that changes one
// column ("image" unless told otherwise) and keeps the others. Random ones draw from
// (seed, epoch, row id), so a row gets the same crop in a given epoch whichever worker runs it.

/// uint8 pixels (or any numbers) to float32: (x * scale - mean[c]) / std[c] per channel (dim 1).
struct Normalize {
  std::vector<double> mean;
  std::vector<double> std;
  double scale = 1.0 / 255.0;
  std::string column = "image";
  Block operator()(Block block) const;
};

/// Per-feature standardisation of a [rows, features] column, with statistics fit on a dataset.
class StandardScaler {
 public:
  explicit StandardScaler(std::string column = "features") : column_(std::move(column)) {}
  /// Streams `dataset` once; throws UsageError when it has no rows or no such column.
  StandardScaler& fit(const Dataset& dataset);
  Block operator()(Block block) const;
  const at::Tensor& mean() const { return mean_; }
  const at::Tensor& std() const { return std_; }

 private:
  std::string column_;
  at::Tensor mean_;
  at::Tensor std_;
};

/// A height x width window at a random place of each [C, H, W] image, after zero padding.
struct RandomCrop {
  int64_t height = 0;
  int64_t width = 0;
  int64_t padding = 0;
  uint64_t seed = 0;
  std::string column = "image";
  Block operator()(Block block) const;
};

/// Mirrors each image left-right with probability p.
struct RandomHorizontalFlip {
  double p = 0.5;
  uint64_t seed = 0;
  std::string column = "image";
  Block operator()(Block block) const;
};

/// OpenCV's GaussianBlur over each channel of each [C, H, W] image (uint8 or float32), borders
/// reflected; sigma 0 derives it from the kernel size (0.3 * ((k - 1) / 2 - 1) + 0.8).
struct GaussianBlur {
  int kernel_size = 11;
  double sigma = 0;
  std::string column = "image";
  Block operator()(Block block) const;
};

/// Runs its steps in order.
struct Chain {
  std::vector<BatchFn> steps;
  Block operator()(Block block) const;
};

}  // namespace cohort::data

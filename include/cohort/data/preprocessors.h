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
  std::vector<double> mean;      ///< per channel
  std::vector<double> std;       ///< per channel
  double scale = 1.0 / 255.0;    ///< applied before the mean and std
  std::string column = "image";  ///< the column it changes
  /// The block with the column normalised.
  Block operator()(Block block) const;
};

/// Per-feature standardisation of a [rows, features] column, with statistics fit on a dataset.
class StandardScaler {
 public:
  /// A scaler of `column`; fit() it before use.
  explicit StandardScaler(std::string column = "features") : column_(std::move(column)) {}
  /// Streams `dataset` once; throws UsageError when it has no rows or no such column.
  StandardScaler& fit(const Dataset& dataset);
  /// The block with the column standardised; UsageError before fit().
  Block operator()(Block block) const;
  /// Per-feature means (after fit()).
  const at::Tensor& mean() const { return mean_; }
  /// Per-feature standard deviations (after fit()).
  const at::Tensor& std() const { return std_; }

 private:
  std::string column_;
  at::Tensor mean_;
  at::Tensor std_;
};

/// A height x width window at a random place of each [C, H, W] image, after zero padding.
struct RandomCrop {
  int64_t height = 0;            ///< the window's height
  int64_t width = 0;             ///< the window's width
  int64_t padding = 0;           ///< zeros added on every side first
  uint64_t seed = 0;             ///< with the epoch and row id, where the window falls
  std::string column = "image";  ///< the column it changes
  /// The block with each image cropped.
  Block operator()(Block block) const;
};

/// Mirrors each image left-right with probability p.
struct RandomHorizontalFlip {
  double p = 0.5;                ///< the probability of a flip
  uint64_t seed = 0;             ///< with the epoch and row id, which rows flip
  std::string column = "image";  ///< the column it changes
  /// The block with some images mirrored.
  Block operator()(Block block) const;
};

/// OpenCV's GaussianBlur over each channel of each [C, H, W] image (uint8 or float32), borders
/// reflected; sigma 0 derives it from the kernel size (0.3 * ((k - 1) / 2 - 1) + 0.8).
struct GaussianBlur {
  int kernel_size = 11;          ///< odd, >= 1
  double sigma = 0;              ///< 0: from the kernel size
  std::string column = "image";  ///< the column it changes
  /// The block with every image blurred.
  Block operator()(Block block) const;
};

/// Runs its steps in order.
struct Chain {
  std::vector<BatchFn> steps;  ///< the functions, run in order
  /// The block after every step.
  Block operator()(Block block) const;
};

}  // namespace cohort::data

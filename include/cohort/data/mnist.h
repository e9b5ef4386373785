#pragma once
#include <filesystem>
#include <string>
#include <vector>

#include "cohort/data/tensor_dataset.h"

namespace cohort::data {

/// Which file pair of an MNIST-format folder.
enum class Split { kTrain, kTest };

/// Where Debian's dataset-fashion-mnist package puts its files.
std::filesystem::path default_fashion_mnist_dir();

/// How load_mnist() normalises pixels.
struct MnistOptions {
  /// Normalisation after scaling pixels to [0, 1]; the defaults are Fashion-MNIST's statistics.
  double mean = 0.2860;
  double std = 0.3530;  ///< standard deviation after scaling to [0, 1]
};

/// Checks that `dir` holds the four MNIST-format files (plain or .gz) and that each is whole and
/// consistent with its pair, reading headers only. Throws UsageError naming the file and the fix.
void check_mnist_dir(const std::filesystem::path& dir);

/// The images of one split, [N, H, W], from its IDX files' headers (nothing else is read); the
/// folder's files checked as check_mnist_dir does.
std::vector<int64_t> mnist_shape(const std::filesystem::path& dir, Split split);

/// Loads one split: inputs uint8 [N, 1, 28, 28] with a normalising transform to float, targets
/// int64 [N].
TensorDataset load_mnist(const std::filesystem::path& dir, Split split,
                         const MnistOptions& options = {});

}  // namespace cohort::data

#include "cohort/data/mnist.h"

#include <torch/types.h>

#include "cohort/data/idx.h"
#include "cohort/error.h"

namespace cohort::data {
namespace {

std::filesystem::path find_file(const std::filesystem::path& dir, const std::string& stem) {
  for (const char* suffix : {"", ".gz"}) {
    auto candidate = dir / (stem + suffix);
    if (std::filesystem::exists(candidate)) return candidate;
  }
  throw UsageError("data directory " + dir.string() + " has no " + stem + " (or " + stem +
                   ".gz): give --data-dir a folder with the four MNIST-format IDX files");
}

const char* images_stem(Split split) {
  return split == Split::kTrain ? "train-images-idx3-ubyte" : "t10k-images-idx3-ubyte";
}
const char* labels_stem(Split split) {
  return split == Split::kTrain ? "train-labels-idx1-ubyte" : "t10k-labels-idx1-ubyte";
}

void check_dir_exists(const std::filesystem::path& dir) {
  if (!std::filesystem::is_directory(dir)) {
    throw UsageError("data directory " + dir.string() +
                     " does not exist: install dataset-fashion-mnist or pass --data-dir");
  }
}

void check_pair(const std::filesystem::path& images_path, const IdxHeader& images,
                const std::filesystem::path& labels_path, const IdxHeader& labels) {
  if (images.shape.size() != 3) {
    throw UsageError("IDX file " + images_path.string() + " has " +
                     std::to_string(images.shape.size()) + " dimensions: images need 3 (N, H, W)");
  }
  if (labels.shape.size() != 1) {
    throw UsageError("IDX file " + labels_path.string() + " has " +
                     std::to_string(labels.shape.size()) + " dimensions: labels need 1");
  }
  if (images.shape[0] != labels.shape[0]) {
    throw UsageError("IDX files " + images_path.string() + " and " + labels_path.string() +
                     " disagree: " + std::to_string(images.shape[0]) + " images but " +
                     std::to_string(labels.shape[0]) + " labels");
  }
}

}  // namespace

std::filesystem::path default_fashion_mnist_dir() { return "/usr/share/datasets/fashion-mnist"; }

void check_mnist_dir(const std::filesystem::path& dir) {
  check_dir_exists(dir);
  for (Split split : {Split::kTrain, Split::kTest}) {
    auto images_path = find_file(dir, images_stem(split));
    auto labels_path = find_file(dir, labels_stem(split));
    check_pair(images_path, inspect_idx(images_path), labels_path, inspect_idx(labels_path));
  }
}

std::vector<int64_t> mnist_shape(const std::filesystem::path& dir, Split split) {
  check_mnist_dir(dir);
  return inspect_idx(find_file(dir, images_stem(split))).shape;
}

TensorDataset load_mnist(const std::filesystem::path& dir, Split split,
                         const MnistOptions& options) {
  check_dir_exists(dir);
  auto images_path = find_file(dir, images_stem(split));
  auto labels_path = find_file(dir, labels_stem(split));
  auto images = read_idx(images_path);
  auto labels = read_idx(labels_path);
  check_pair(images_path, IdxHeader{images.sizes().vec()}, labels_path,
             IdxHeader{labels.sizes().vec()});
  if (options.std <= 0) throw UsageError("MnistOptions.std must be > 0");
  TensorDataset dataset;
  dataset.inputs = images.unsqueeze(1);
  dataset.targets = labels.to(torch::kLong);
  const double scale = 1.0 / (255.0 * options.std);
  const double shift = options.mean / options.std;
  dataset.transform = [scale, shift](const at::Tensor& pixels) {
    return pixels.to(torch::kFloat).mul_(scale).sub_(shift);
  };
  return dataset;
}

}  // namespace cohort::data

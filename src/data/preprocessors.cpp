#include "cohort/data/preprocessors.h"

#include <torch/types.h>

#ifdef COHORT_WITH_OPENCV
#include <opencv2/imgproc.hpp>
#endif

#include "cohort/data/data_iterator.h"
#include "cohort/error.h"

namespace cohort::data {

namespace {

// A generator for one row: the same (seed, epoch, id) gives the same draws anywhere.
uint64_t row_state(uint64_t seed, int64_t id) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ULL ^
               (static_cast<uint64_t>(current_epoch()) + 1) * 0xBF58476D1CE4E5B9ULL ^
               static_cast<uint64_t>(id) * 0x94D049BB133111EBULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

double uniform01(uint64_t& state) {
  state = state * 6364136223846793005ULL + 1442695040888963407ULL;
  return static_cast<double>(state >> 11) * (1.0 / 9007199254740992.0);
}

std::vector<int64_t> row_ids(const Block& block) {
  if (!block.has(kIdColumn)) {
    throw UsageError("random preprocessing needs the '" + std::string(kIdColumn) +
                     "' column (Datasets add it; keep it in earlier map functions)");
  }
  auto ids = block[kIdColumn].to(at::kLong).contiguous();
  return std::vector<int64_t>(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + ids.numel());
}

const at::Tensor& images_of(const Block& block, const std::string& column, const char* who) {
  const auto& images = block[column];
  if (images.dim() != 4) {
    throw UsageError(std::string(who) + ": column '" + column +
                     "' must be images [N, C, H, W], got " + std::to_string(images.dim()) +
                     " dimensions");
  }
  return images;
}

}  // namespace

Block Normalize::operator()(Block block) const {
  auto x = block[column].to(at::kFloat) * scale;
  if (!mean.empty()) {
    if (mean.size() != std.size())
      throw UsageError("Normalize: mean and std need the same number of channels");
    if (x.dim() < 2 || x.size(1) != static_cast<int64_t>(mean.size())) {
      throw UsageError("Normalize: " + std::to_string(mean.size()) +
                       " channel statistics for column '" + column + "' with " +
                       (x.dim() < 2 ? std::string("no channel dimension")
                                    : std::to_string(x.size(1)) + " channels"));
    }
    std::vector<int64_t> shape(static_cast<size_t>(x.dim()), 1);
    shape[1] = static_cast<int64_t>(mean.size());
    auto m = torch::tensor(mean, torch::kFloat).view(shape);
    auto s = torch::tensor(std, torch::kFloat).view(shape);
    x = (x - m) / s;
  }
  block.columns[column] = x;
  return block;
}

StandardScaler& StandardScaler::fit(const Dataset& dataset) {
  at::Tensor sum, sum_sq;
  int64_t rows = 0;
  DataIterator iterator(dataset);
  for (Block& block : iterator.iter_batches({.batch_size = 1024})) {
    auto x = block[column_].to(at::kDouble);
    if (x.dim() != 2)
      throw UsageError("StandardScaler: column '" + column_ + "' must be [rows, features]");
    sum = sum.defined() ? sum + x.sum(0) : x.sum(0);
    sum_sq = sum_sq.defined() ? sum_sq + (x * x).sum(0) : (x * x).sum(0);
    rows += x.size(0);
  }
  if (rows == 0) throw UsageError("StandardScaler: fit on a dataset without rows");
  auto mean = sum / static_cast<double>(rows);
  auto var = (sum_sq / static_cast<double>(rows) - mean * mean).clamp_min(0);
  mean_ = mean.to(at::kFloat);
  // A constant feature keeps its values centred rather than dividing by zero.
  const auto std = var.sqrt().to(at::kFloat);
  std_ = std.masked_fill(std < 1e-12, 1.0);
  return *this;
}

Block StandardScaler::operator()(Block block) const {
  if (!mean_.defined()) throw UsageError("StandardScaler: call fit(dataset) before using it");
  auto x = block[column_].to(at::kFloat);
  if (x.dim() != 2 || x.size(1) != mean_.size(0)) {
    throw UsageError("StandardScaler: fit on " + std::to_string(mean_.size(0)) +
                     " features, column '" + column_ + "' has shape " +
                     std::to_string(x.dim() == 2 ? x.size(1) : -1) + " features");
  }
  block.columns[column_] = (x - mean_) / std_;
  return block;
}

Block RandomCrop::operator()(Block block) const {
  const auto& images = images_of(block, column, "RandomCrop");
  auto padded =
      padding > 0 ? at::constant_pad_nd(images, {padding, padding, padding, padding}, 0) : images;
  const int64_t h = padded.size(2), w = padded.size(3);
  if (height > h || width > w || height < 1 || width < 1) {
    throw UsageError("RandomCrop: a " + std::to_string(height) + "x" + std::to_string(width) +
                     " crop of " + std::to_string(h) + "x" + std::to_string(w) +
                     " images (after padding)");
  }
  const auto ids = row_ids(block);
  std::vector<at::Tensor> out;
  out.reserve(ids.size());
  for (size_t r = 0; r < ids.size(); ++r) {
    uint64_t state = row_state(seed, ids[r]);
    const auto top = static_cast<int64_t>(uniform01(state) * static_cast<double>(h - height + 1));
    const auto left = static_cast<int64_t>(uniform01(state) * static_cast<double>(w - width + 1));
    out.push_back(padded[static_cast<int64_t>(r)].narrow(1, top, height).narrow(2, left, width));
  }
  block.columns[column] = out.empty() ? padded.narrow(2, 0, height).narrow(3, 0, width).contiguous()
                                      : torch::stack(out);
  return block;
}

Block RandomHorizontalFlip::operator()(Block block) const {
  const auto& images = images_of(block, column, "RandomHorizontalFlip");
  const auto ids = row_ids(block);
  std::vector<int64_t> flip;
  for (size_t r = 0; r < ids.size(); ++r) {
    uint64_t state = row_state(seed ^ 0x5bd1e995ULL, ids[r]);
    if (uniform01(state) < p) flip.push_back(static_cast<int64_t>(r));
  }
  if (flip.empty()) return block;
  auto out = images.clone();
  auto index = torch::tensor(flip, torch::kLong);
  out.index_copy_(0, index, images.index_select(0, index).flip({3}));
  block.columns[column] = out;
  return block;
}

Block GaussianBlur::operator()(Block block) const {
  if (kernel_size < 1 || kernel_size % 2 == 0) {
    throw UsageError("GaussianBlur: kernel_size=" + std::to_string(kernel_size) +
                     " must be odd and positive");
  }
  auto images = images_of(block, column, "GaussianBlur").contiguous();
  if (images.scalar_type() != at::kByte && images.scalar_type() != at::kFloat) {
    throw UsageError("GaussianBlur: images must be uint8 or float32, got " +
                     std::string(c10::toString(images.scalar_type())));
  }
#ifndef COHORT_WITH_OPENCV
  throw UsageError(
      "GaussianBlur needs OpenCV, and this cohort was built without it: rebuild with "
      "COHORT_WITH_OPENCV=ON and OpenCV's core, imgproc and imgcodecs");
#else
  const int type = images.scalar_type() == at::kByte ? CV_8UC1 : CV_32FC1;
  auto out = torch::empty_like(images);
  const int64_t planes = images.size(0) * images.size(1);
  const int h = static_cast<int>(images.size(2)), w = static_cast<int>(images.size(3));
  const size_t plane_bytes =
      static_cast<size_t>(h) * static_cast<size_t>(w) * images.element_size();
  auto* src = static_cast<char*>(images.data_ptr());
  auto* dst = static_cast<char*>(out.data_ptr());
  // Each [H, W] plane of a contiguous [N, C, H, W] tensor is one single-channel image.
  for (int64_t p = 0; p < planes; ++p) {
    cv::Mat in(h, w, type, src + p * plane_bytes);
    cv::Mat result(h, w, type, dst + p * plane_bytes);
    cv::GaussianBlur(in, result, cv::Size(kernel_size, kernel_size), sigma, sigma,
                     cv::BORDER_REFLECT_101);
  }
  block.columns[column] = out;
  return block;
#endif
}

Block Chain::operator()(Block block) const {
  for (const auto& step : steps) block = step(std::move(block));
  return block;
}

}  // namespace cohort::data

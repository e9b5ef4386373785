#include "cohort/models/zoo.h"

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/pooling.h>
#include <torch/types.h>

#include "cohort/error.h"

namespace cohort::models {
namespace F = torch::nn::functional;

MlpImpl::MlpImpl(const ModelOptions& o) {
  const int64_t in = o.in_channels * o.image_size * o.image_size;
  fc1_ = register_module("fc1", torch::nn::Linear(in, 128));
  fc2_ = register_module("fc2", torch::nn::Linear(128, 64));
  fc3_ = register_module("fc3", torch::nn::Linear(64, o.num_classes));
}

torch::Tensor MlpImpl::forward(torch::Tensor x) {
  x = x.flatten(1);
  x = torch::relu(fc1_->forward(x));
  x = torch::relu(fc2_->forward(x));
  return fc3_->forward(x);
}

CnnImpl::CnnImpl(const ModelOptions& o) {
  conv1_ = register_module(
      "conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(o.in_channels, 32, 3).padding(1)));
  conv2_ =
      register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3).padding(1)));
  const int64_t side = o.image_size / 4;
  flat_features_ = 64 * side * side;
  fc1_ = register_module("fc1", torch::nn::Linear(flat_features_, 128));
  fc2_ = register_module("fc2", torch::nn::Linear(128, o.num_classes));
}

torch::Tensor CnnImpl::forward(torch::Tensor x) {
  x = torch::max_pool2d(torch::relu(conv1_->forward(x)), 2);
  x = torch::max_pool2d(torch::relu(conv2_->forward(x)), 2);
  x = x.reshape({x.size(0), flat_features_});
  x = torch::relu(fc1_->forward(x));
  return fc2_->forward(x);
}

namespace {

torch::nn::Conv2d conv(int64_t in, int64_t out, int64_t kernel, int64_t stride, int64_t padding) {
  return torch::nn::Conv2d(
      torch::nn::Conv2dOptions(in, out, kernel).stride(stride).padding(padding).bias(false));
}

class BasicBlockImpl : public torch::nn::Module {
 public:
  BasicBlockImpl(int64_t in, int64_t out, int64_t stride) {
    conv1_ = register_module("conv1", conv(in, out, 3, stride, 1));
    bn1_ = register_module("bn1", torch::nn::BatchNorm2d(out));
    conv2_ = register_module("conv2", conv(out, out, 3, 1, 1));
    bn2_ = register_module("bn2", torch::nn::BatchNorm2d(out));
    if (stride != 1 || in != out) {
      downsample_ = register_module(
          "downsample",
          torch::nn::Sequential(conv(in, out, 1, stride, 0), torch::nn::BatchNorm2d(out)));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    auto y = torch::relu(bn1_->forward(conv1_->forward(x)));
    y = bn2_->forward(conv2_->forward(y));
    return torch::relu(y + (downsample_ ? downsample_->forward(x) : x));
  }

 private:
  torch::nn::Conv2d conv1_{nullptr}, conv2_{nullptr};
  torch::nn::BatchNorm2d bn1_{nullptr}, bn2_{nullptr};
  torch::nn::Sequential downsample_{nullptr};
};
TORCH_MODULE(BasicBlock);

class EncoderBlockImpl : public torch::nn::Module {
 public:
  EncoderBlockImpl(int64_t width, int64_t heads, int64_t mlp_ratio) {
    norm1_ = register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
    attention_ = register_module("attention", torch::nn::MultiheadAttention(width, heads));
    norm2_ = register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
    mlp_ = register_module(
        "mlp", torch::nn::Sequential(torch::nn::Linear(width, width * mlp_ratio), torch::nn::GELU(),
                                     torch::nn::Linear(width * mlp_ratio, width)));
  }
  // x: [tokens, batch, width], the layout of torch::nn::MultiheadAttention.
  torch::Tensor forward(torch::Tensor x) {
    auto h = norm1_->forward(x);
    x = x + std::get<0>(attention_->forward(h, h, h, {}, /*need_weights=*/false));
    return x + mlp_->forward(norm2_->forward(x));
  }

 private:
  torch::nn::LayerNorm norm1_{nullptr}, norm2_{nullptr};
  torch::nn::MultiheadAttention attention_{nullptr};
  torch::nn::Sequential mlp_{nullptr};
};
TORCH_MODULE(EncoderBlock);

}  // namespace

ResNet18Impl::ResNet18Impl(const ModelOptions& o) {
  stem_ = register_module(
      "stem", torch::nn::Sequential(
                  conv(o.in_channels, 64, 7, 2, 3), torch::nn::BatchNorm2d(64), torch::nn::ReLU(),
                  torch::nn::MaxPool2d(torch::nn::MaxPool2dOptions(3).stride(2).padding(1))));
  torch::nn::Sequential layers;
  int64_t in = 64;
  for (int64_t out : {64, 128, 256, 512}) {
    const int64_t stride = out == 64 ? 1 : 2;
    layers->push_back(BasicBlock(in, out, stride));
    layers->push_back(BasicBlock(out, out, 1));
    in = out;
  }
  layers_ = register_module("layers", layers);
  fc_ = register_module("fc", torch::nn::Linear(512, o.num_classes));
}

torch::Tensor ResNet18Impl::forward(torch::Tensor x) {
  x = layers_->forward(stem_->forward(x));
  x = F::adaptive_avg_pool2d(x, F::AdaptiveAvgPool2dFuncOptions(1)).flatten(1);
  return fc_->forward(x);
}

VisionTransformerImpl::VisionTransformerImpl(const ModelOptions& o) {
  const int64_t tokens = (o.image_size / o.patch_size) * (o.image_size / o.patch_size);
  patch_embed_ = register_module(
      "patch_embed",
      torch::nn::Conv2d(
          torch::nn::Conv2dOptions(o.in_channels, o.width, o.patch_size).stride(o.patch_size)));
  cls_token_ = register_parameter("cls_token", torch::randn({1, 1, o.width}) * 0.02);
  positions_ = register_parameter("positions", torch::randn({tokens + 1, 1, o.width}) * 0.02);
  torch::nn::Sequential blocks;
  for (int64_t i = 0; i < o.depth; ++i)
    blocks->push_back(EncoderBlock(o.width, o.heads, o.mlp_ratio));
  blocks_ = register_module("blocks", blocks);
  norm_ = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.width})));
  head_ = register_module("head", torch::nn::Linear(o.width, o.num_classes));
}

torch::Tensor VisionTransformerImpl::forward(torch::Tensor x) {
  // [N, C, H, W] -> [tokens, N, width]
  x = patch_embed_->forward(x).flatten(2).permute({2, 0, 1});
  x = torch::cat({cls_token_.expand({1, x.size(1), cls_token_.size(2)}), x}, 0) + positions_;
  x = norm_->forward(blocks_->forward(x));
  return head_->forward(x[0]);
}

const std::vector<std::string>& model_names() {
  static const std::vector<std::string> names{"mlp", "cnn", "resnet18", "vit"};
  return names;
}

ImageClassifier create_model(const std::string& name, const ModelOptions& o) {
  auto positive = [](const char* what, int64_t v) {
    if (v < 1)
      throw UsageError(std::string("model option ") + what + "=" + std::to_string(v) +
                       " must be >= 1");
  };
  positive("num_classes", o.num_classes);
  positive("in_channels", o.in_channels);
  positive("image_size", o.image_size);
  if (name == "mlp") return std::make_shared<MlpImpl>(o);
  if (name == "cnn") {
    if (o.image_size % 4 != 0) {
      throw UsageError("cnn needs an image size divisible by 4 (two 2x2 pools), got " +
                       std::to_string(o.image_size));
    }
    return std::make_shared<CnnImpl>(o);
  }
  if (name == "resnet18") return std::make_shared<ResNet18Impl>(o);
  if (name == "vit") {
    positive("patch_size", o.patch_size);
    positive("depth", o.depth);
    positive("heads", o.heads);
    positive("mlp_ratio", o.mlp_ratio);
    if (o.image_size % o.patch_size != 0) {
      throw UsageError("vit: patch size " + std::to_string(o.patch_size) +
                       " does not divide image size " + std::to_string(o.image_size));
    }
    if (o.width % o.heads != 0) {
      throw UsageError("vit: width " + std::to_string(o.width) + " is not divisible by heads " +
                       std::to_string(o.heads));
    }
    return std::make_shared<VisionTransformerImpl>(o);
  }
  std::string known;
  for (const auto& n : model_names()) known += (known.empty() ? "" : ", ") + n;
  throw UsageError("unknown model '" + name + "': choose one of " + known);
}

}  // namespace cohort::models

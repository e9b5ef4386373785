#pragma once
#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include "cohort/comm/process_group.h"
#include "cohort/parallel/fully_shard.h"

namespace cohort::models {

/// The classifiers of the seed examples. Every model maps [N, C, H, W] images to [N, classes].
/// Their layers are parallel::FullyShard units, ZeRO stage 3's (mlp: each linear layer; cnn:
/// each convolution and linear layer; resnet18: the stem, each residual block and the head; vit:
/// each encoder block, the embedding and head staying whole); without stage 3 they are the plain
/// layers, under the same parameter names.
class ImageClassifierImpl : public torch::nn::Module {
 public:
  /// The logits of a batch of images [N, C, H, W].
  virtual torch::Tensor forward(torch::Tensor x) = 0;
  /// The model as consecutive layers whose composition is forward(): where a pipeline may cut it
  /// (parallel::pipeline::split_sequential). The layers are the model's own modules, shared, not
  /// copied, each with its activation, pooling or reshaping; every parameter of the model is in
  /// exactly one layer. mlp: 3 layers, cnn: 4, resnet18: 10 (stem, 8 blocks, head), vit: depth + 2
  /// (embedding, blocks, head). A model of the user's that does not override it: a UsageError.
  virtual torch::nn::Sequential pipeline_layers();
};
/// A zoo model, as create_model() returns it.
using ImageClassifier = std::shared_ptr<ImageClassifierImpl>;

/// The shapes a zoo model is built for, and the ViT's size.
struct ModelOptions {
  int64_t num_classes = 10;  ///< classes (logits per image)
  int64_t in_channels = 1;   ///< channels of an image
  int64_t image_size = 28;   ///< height and width of an image
  /// Vision Transformer only.
  int64_t patch_size = 7;
  int64_t depth = 4;      ///< encoder blocks
  int64_t width = 128;    ///< embedding width
  int64_t heads = 4;      ///< attention heads per block
  int64_t mlp_ratio = 4;  ///< the MLP's hidden width as a multiple of width
  /// Vision Transformer only: each block's attention heads and MLP cut over this group
  /// (Megatron-style tensor parallelism: one all-reduce forward and one backward per attention
  /// and per MLP). Every rank of the group builds the model at the same point with the same
  /// torch seed and feeds it the same input; the initial weights are then those of the dense model
  /// with that seed, sliced. heads and width x mlp_ratio must be divisible by the group's size.
  /// Empty or of size 1: dense blocks.
  comm::ProcessGroup tensor_parallel_group;
};

/// Seed 000: 784-128-64-10.
class MlpImpl : public ImageClassifierImpl {
 public:
  /// The MLP of `options` (two hidden layers).
  explicit MlpImpl(const ModelOptions& options = {});
  /// The logits of a batch of images.
  torch::Tensor forward(torch::Tensor x) override;
  torch::nn::Sequential pipeline_layers() override;

 private:
  parallel::FullyShard fc1_{nullptr}, fc2_{nullptr}, fc3_{nullptr};
};

/// Seed 000: conv 32, conv 64 (3x3, each followed by 2x2 max-pool), fc 128, fc 10.
class CnnImpl : public ImageClassifierImpl {
 public:
  /// The CNN of the Ray Train MNIST article, for `options`' image shape.
  explicit CnnImpl(const ModelOptions& options = {});
  /// The logits of a batch of images.
  torch::Tensor forward(torch::Tensor x) override;
  torch::nn::Sequential pipeline_layers() override;

 private:
  parallel::FullyShard conv1_{nullptr}, conv2_{nullptr}, fc1_{nullptr}, fc2_{nullptr};
  int64_t flat_features_ = 0;
};

/// Seed 002: torchvision's resnet18 with a 1-channel 7x7 stride-2 first convolution.
class ResNet18Impl : public ImageClassifierImpl {
 public:
  /// ResNet-18 for `options`' channels and classes.
  explicit ResNet18Impl(const ModelOptions& options = {});
  /// The logits of a batch of images.
  torch::Tensor forward(torch::Tensor x) override;
  torch::nn::Sequential pipeline_layers() override;

 private:
  parallel::FullyShard stem_{nullptr}, fc_{nullptr};
  torch::nn::Sequential layers_{nullptr};  ///< of FullyShard blocks
};

/// Seed 003: a Vision Transformer (patch embedding, class token, learned positions, pre-norm
/// encoder blocks, linear head), sized by ModelOptions.
class VisionTransformerImpl : public ImageClassifierImpl {
 public:
  /// A Vision Transformer of `options` (cut over options.tensor_parallel_group when it has one).
  explicit VisionTransformerImpl(const ModelOptions& options = {});
  /// The logits of a batch of images.
  torch::Tensor forward(torch::Tensor x) override;
  torch::nn::Sequential pipeline_layers() override;
  /// With a tensor_parallel_group: takes this rank's slices of a dense ViT of the same options
  /// (without the group), or gathers the whole weights from the group's slices into one (a
  /// collective: every rank of the group calls it), e.g. to save a checkpoint that loads into the
  /// unsplit model. Without a group: copies.
  void load_from_dense(VisionTransformerImpl& dense);
  /// See load_from_dense: the other direction.
  void copy_to_dense(VisionTransformerImpl& dense);

 private:
  torch::nn::Conv2d patch_embed_{nullptr};
  torch::Tensor cls_token_, positions_;
  torch::nn::Sequential blocks_{nullptr};  ///< of FullyShard encoder blocks
  torch::nn::LayerNorm norm_{nullptr};
  torch::nn::Linear head_{nullptr};
};

/// The zoo's names: "mlp", "cnn", "resnet18", "vit".
const std::vector<std::string>& model_names();
/// Throws UsageError listing the names when `name` is unknown, or when the options do not fit
/// the model (e.g. an image size the patch size does not divide).
ImageClassifier create_model(const std::string& name, const ModelOptions& options = {});

}  // namespace cohort::models

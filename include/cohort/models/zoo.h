#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include "cohort/comm/process_group.h"
#include "cohort/data/labelled_data.h"
#include "cohort/json.h"
#include "cohort/parallel/fully_shard.h"

namespace cohort::models {

/// The shapes a zoo model is built for, and the sizes of the transformers (ViT, GPT).
struct ModelOptions {
  int64_t num_classes = 10;  ///< classes (logits per image)
  int64_t in_channels = 1;   ///< channels of an image
  int64_t image_size = 28;   ///< height and width of an image
  /// Vision Transformer only.
  int64_t patch_size = 7;
  int64_t depth = 4;      ///< ViT and GPT: transformer blocks
  int64_t width = 128;    ///< ViT and GPT: embedding width
  int64_t heads = 4;      ///< ViT and GPT: attention heads per block
  int64_t mlp_ratio = 4;  ///< ViT and GPT: the MLP's hidden width as a multiple of width
  /// GPT only: tokens (256: bytes, as `--data text:FILE` reads them).
  int64_t vocab_size = 256;
  /// GPT only: the longest sequence, in tokens (its learned positions).
  int64_t context = 128;
  /// GPT only: the output head is the token embedding's weight (GPT-2's tying), or a layer of
  /// its own. Cut into pipeline stages, the first stage and the last each hold a copy of the
  /// weight (GptImpl::pipeline_layers(int)).
  bool tie_embeddings = true;
  /// Deferred initialisation: each FullyShard unit is built, its parameters then give their
  /// memory back until it is materialised (parallel::deferred_unit): by ZeRO stage 3 one unit at a
  /// time, keeping its shard, by parallel::materialize() for any other plan (train::parallelize
  /// does either). The weights are those of the model built without it, bit for bit; the peak
  /// while building is the parameters outside the units and one unit.
  bool deferred_init = false;
  /// ViT and GPT: each block's attention heads and MLP cut over this group (Megatron-style
  /// tensor parallelism: one all-reduce forward and one backward per attention and per MLP).
  /// Every rank of the group builds the model at the same point with the same torch seed and
  /// feeds it the same input; the initial weights are then those of the dense model with that
  /// seed, sliced. heads and width x mlp_ratio must be divisible by the group's size. Empty or of
  /// size 1: dense blocks.
  comm::ProcessGroup tensor_parallel_group;
};

/// `options` for a model of `data`: its channels, image size and classes, or a text's vocabulary
/// and context (data::open_labelled_data).
ModelOptions options_for_data(const data::LabelledData& data, ModelOptions options = {});

/// The options as JSON (e.g. a Trainer's train_loop_config, for the workers) and back, without the
/// tensor-parallel group (each process's own); a missing key keeps its default, a value of the
/// wrong type is a UsageError naming it.
void to_json(Json& json, const ModelOptions& options);
/// ModelOptions from JSON (see to_json).
void from_json(const Json& json, ModelOptions& options);

/// The zoo's models: the classifiers of the seed examples, which map [N, C, H, W] images to
/// [N, classes], and a GPT-style language model, which maps tokens [N, T] to [N, T, vocab]. Their
/// layers are parallel::FullyShard units, ZeRO stage 3's (mlp: each linear layer; cnn: each
/// convolution and linear layer; resnet18: the stem, each residual block and the head; vit and
/// gpt: each transformer block, the embeddings and head staying whole); without stage 3 they are
/// the plain layers, under the same parameter names.
class ZooModelImpl : public torch::nn::Module {
 public:
  /// The logits of a batch: of images [N, C, H, W], or of tokens [N, T] for the GPT.
  virtual torch::Tensor forward(torch::Tensor x) = 0;
  /// The model as consecutive layers whose composition is forward(): where a pipeline may cut it
  /// (parallel::pipeline::split_sequential). The layers are the model's own modules, shared, not
  /// copied, each with its activation, pooling or reshaping; every parameter of the model is in
  /// exactly one layer (a tied GPT cut over pipeline ranks: see GptImpl::pipeline_layers(int)).
  /// mlp: 3 layers, cnn: 4, resnet18: 10 (stem, 8 blocks, head), vit and gpt: depth + 2 (embedding,
  /// blocks, head). A model of the user's that does not override it: a UsageError.
  virtual torch::nn::Sequential pipeline_layers();
  /// A random batch of `rows` the model takes, and targets for logits_cross_entropy(): images of
  /// the options' shape and class labels, or for the GPT tokens and the next tokens. From torch's
  /// default generator. A model of the user's: 28 x 28 one-channel images and 10 classes.
  virtual std::pair<torch::Tensor, torch::Tensor> sample_batch(int64_t rows) const;

 protected:
  ModelOptions options_;  ///< what the model was built for (sample_batch's shapes)
};
/// A zoo model, as create_model() returns it.
using ZooModel = std::shared_ptr<ZooModelImpl>;

/// The zoo's loss: cross-entropy over the logits' last dimension, the mean over every row (a
/// classifier's [N, classes] against labels [N]) or every token (a language model's [N, T, vocab]
/// against the next tokens [N, T]).
torch::Tensor logits_cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets);

/// Seed 000: 784-128-64-10.
class MlpImpl : public ZooModelImpl {
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
class CnnImpl : public ZooModelImpl {
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
class ResNet18Impl : public ZooModelImpl {
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
class VisionTransformerImpl : public ZooModelImpl {
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

/// A GPT-style decoder-only language model (Radford et al. 2019): token embedding and learned
/// positions, pre-norm decoder blocks (causal self-attention, a GELU MLP), a final layer norm and
/// an output head tied to the token embedding (ModelOptions::tie_embeddings). Sized by
/// ModelOptions' depth, width, heads, mlp_ratio, vocab_size and context. Tokens [N, T], T <=
/// context, to logits [N, T, vocab_size]. Attention is at::scaled_dot_product_attention where
/// libtorch has it (2.0 on).
class GptImpl : public ZooModelImpl {
 public:
  /// A GPT of `options` (cut over options.tensor_parallel_group when it has one).
  explicit GptImpl(const ModelOptions& options = {});
  /// The logits of every position of a batch of token sequences [N, T] (integers < vocab_size).
  torch::Tensor forward(torch::Tensor tokens) override;
  /// pipeline_layers(1): the layers of one pipeline rank (a tensor-parallel mesh's).
  torch::nn::Sequential pipeline_layers() override;
  /// The embedding layer, the blocks and the head, for a pipeline over `ranks` ranks. Tied, the
  /// head reads the embedding layer's weight; over more than one rank the head layer holds the
  /// embedding module too, so that the weight is a parameter of the first stage and of the last
  /// (Megatron-LM's and DeepSpeed's tied embeddings): each rank steps its own copy and the
  /// pipeline keeps them equal (parallel::pipeline::find_tied_parameters()).
  torch::nn::Sequential pipeline_layers(int ranks);
  /// Random tokens [rows, context] and the tokens that follow each, [rows, context].
  std::pair<torch::Tensor, torch::Tensor> sample_batch(int64_t rows) const override;
  /// As VisionTransformerImpl::load_from_dense: this rank's slices of a dense GPT.
  void load_from_dense(GptImpl& dense);
  /// As VisionTransformerImpl::copy_to_dense: the slices gathered into a dense GPT (collective).
  void copy_to_dense(GptImpl& dense);
  /// A training step's floating-point operations per token at sequence length `tokens`, as
  /// model FLOPs utilisation counts them (Kaplan et al. 2020; PaLM): 6 per multiplying weight
  /// (the blocks' and the head's; the embeddings are lookups) and 12 x depth x width x tokens
  /// for attention's scores and weighted sums.
  int64_t flops_per_token(int64_t tokens) const;

 private:
  torch::nn::Embedding token_embedding_{nullptr};
  torch::Tensor positions_;
  torch::nn::Sequential blocks_{nullptr};  ///< of FullyShard decoder blocks
  torch::nn::LayerNorm norm_{nullptr};
  torch::nn::Linear head_{nullptr};  ///< untied only
};

/// `model`'s layers for a pipeline over `ranks` ranks: a GPT's pipeline_layers(ranks), every other
/// model's pipeline_layers().
torch::nn::Sequential pipeline_layers(ZooModelImpl& model, int ranks);

/// The zoo's names: "mlp", "cnn", "resnet18", "vit", "gpt".
const std::vector<std::string>& model_names();
/// Throws UsageError listing the names when `name` is unknown, or when the options do not fit
/// the model (e.g. an image size the patch size does not divide).
ZooModel create_model(const std::string& name, const ModelOptions& options = {});

}  // namespace cohort::models

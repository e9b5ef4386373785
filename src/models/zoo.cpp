#include "cohort/models/zoo.h"

#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/pooling.h>
#include <torch/types.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>

#include <functional>
#include <mutex>
#include <utility>

#include "cohort/error.h"
#include "cohort/parallel/tensor_parallel.h"

namespace cohort::models {
namespace F = torch::nn::functional;

ModelOptions options_for_data(const data::LabelledData& data, ModelOptions options) {
  options.in_channels = data.channels;
  options.image_size = data.image_size;
  options.num_classes = data.num_classes;
  if (data.kind == data::LabelledData::Kind::kText) {
    options.vocab_size = data.num_classes;
    options.context = data.context;
  }
  return options;
}

void to_json(Json& j, const ModelOptions& o) {
  j = Json{{"num_classes", o.num_classes},
           {"in_channels", o.in_channels},
           {"image_size", o.image_size},
           {"patch_size", o.patch_size},
           {"depth", o.depth},
           {"width", o.width},
           {"heads", o.heads},
           {"mlp_ratio", o.mlp_ratio},
           {"vocab_size", o.vocab_size},
           {"context", o.context},
           {"tie_embeddings", o.tie_embeddings},
           {"deferred_init", o.deferred_init}};
}

void from_json(const Json& j, ModelOptions& o) {
  const ModelOptions d;
  o.num_classes = json_field(j, "num_classes", d.num_classes);
  o.in_channels = json_field(j, "in_channels", d.in_channels);
  o.image_size = json_field(j, "image_size", d.image_size);
  o.patch_size = json_field(j, "patch_size", d.patch_size);
  o.depth = json_field(j, "depth", d.depth);
  o.width = json_field(j, "width", d.width);
  o.heads = json_field(j, "heads", d.heads);
  o.mlp_ratio = json_field(j, "mlp_ratio", d.mlp_ratio);
  o.vocab_size = json_field(j, "vocab_size", d.vocab_size);
  o.context = json_field(j, "context", d.context);
  o.tie_embeddings = json_field(j, "tie_embeddings", d.tie_embeddings);
  o.deferred_init = json_field(j, "deferred_init", d.deferred_init);
}

namespace {

using NamedModules = std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>;
using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

// One pipeline layer: modules and parameters of a model, registered here too (the same
// tensors, so that a stage's parameters are the model's), and how to apply them.
class LayerImpl : public torch::nn::Module {
 public:
  using Function = std::function<torch::Tensor(const torch::Tensor&)>;
  LayerImpl(NamedModules modules, NamedTensors parameters, Function function)
      : function_(std::move(function)) {
    for (auto& [name, module] : modules) register_module(name, std::move(module));
    for (auto& [name, tensor] : parameters) register_parameter(name, tensor);
  }
  torch::Tensor forward(torch::Tensor x) { return function_(x); }

 private:
  Function function_;
};
TORCH_MODULE(Layer);

// A layer of one module with what comes before and after it (reshaping, activation, pooling).
template <typename Holder>
Layer layer(const std::string& name, Holder module,
            std::function<torch::Tensor(const torch::Tensor&)> before,
            std::function<torch::Tensor(const torch::Tensor&)> after) {
  return Layer(NamedModules{{name, module.ptr()}}, NamedTensors{},
               [module, before = std::move(before), after = std::move(after)](
                   const torch::Tensor& x) mutable { return after(module->forward(before(x))); });
}

// The parameters of `from` into those of the same name and shape in `to` (tensor-parallel
// slices, of other shapes, are left to their layers).
void copy_parameters(const torch::nn::Module& from, torch::nn::Module& to) {
  torch::NoGradGuard no_grad;
  const auto source = from.named_parameters();
  for (auto& p : to.named_parameters()) {
    const auto* s = source.find(p.key());
    if (s != nullptr && s->sizes() == p.value().sizes()) p.value().copy_(*s);
  }
}

// A FullyShard unit of `make()`, deferred when the options ask (parallel::deferred_unit).
template <typename Make>
parallel::FullyShard unit(const ModelOptions& o, Make make) {
  return parallel::deferred_unit(std::move(make), o.deferred_init);
}

torch::Tensor identity(const torch::Tensor& x) { return x; }
torch::Tensor relu(const torch::Tensor& x) { return torch::relu(x); }
torch::Tensor relu_pool(const torch::Tensor& x) { return torch::max_pool2d(torch::relu(x), 2); }

}  // namespace

std::pair<torch::Tensor, torch::Tensor> ZooModelImpl::sample_batch(int64_t rows) const {
  const auto& o = options_;
  return {torch::randn({rows, o.in_channels, o.image_size, o.image_size}),
          torch::randint(0, o.num_classes, {rows})};
}

torch::Tensor logits_cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets) {
  if (logits.dim() <= 2) return F::cross_entropy(logits, targets);
  return F::cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
}

torch::nn::Sequential ZooModelImpl::pipeline_layers() {
  throw UsageError(name() +
                   " does not say where it may be cut into pipeline stages: override "
                   "pipeline_layers() to return its layers in order, or give the pipeline a "
                   "torch::nn::Sequential");
}

MlpImpl::MlpImpl(const ModelOptions& o) {
  options_ = o;
  const int64_t in = o.in_channels * o.image_size * o.image_size;
  fc1_ = register_module("fc1", unit(o, [=] { return torch::nn::Linear(in, 128); }));
  fc2_ = register_module("fc2", unit(o, [] { return torch::nn::Linear(128, 64); }));
  fc3_ = register_module(
      "fc3", unit(o, [classes = o.num_classes] { return torch::nn::Linear(64, classes); }));
}

torch::Tensor MlpImpl::forward(torch::Tensor x) {
  x = x.flatten(1);
  x = torch::relu(fc1_->forward(x));
  x = torch::relu(fc2_->forward(x));
  return fc3_->forward(x);
}

torch::nn::Sequential MlpImpl::pipeline_layers() {
  torch::nn::Sequential layers;
  layers->push_back(layer(
      "fc1", fc1_, [](const torch::Tensor& x) { return x.flatten(1); }, relu));
  layers->push_back(layer("fc2", fc2_, identity, relu));
  layers->push_back(fc3_);
  return layers;
}

CnnImpl::CnnImpl(const ModelOptions& o) {
  options_ = o;
  conv1_ = register_module(
      "conv1", unit(o, [channels = o.in_channels] {
        return torch::nn::Conv2d(torch::nn::Conv2dOptions(channels, 32, 3).padding(1));
      }));
  conv2_ = register_module(
      "conv2",
      unit(o, [] { return torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3).padding(1)); }));
  const int64_t side = o.image_size / 4;
  flat_features_ = 64 * side * side;
  fc1_ = register_module(
      "fc1", unit(o, [features = flat_features_] { return torch::nn::Linear(features, 128); }));
  fc2_ = register_module(
      "fc2", unit(o, [classes = o.num_classes] { return torch::nn::Linear(128, classes); }));
}

torch::Tensor CnnImpl::forward(torch::Tensor x) {
  x = torch::max_pool2d(torch::relu(conv1_->forward(x)), 2);
  x = torch::max_pool2d(torch::relu(conv2_->forward(x)), 2);
  x = x.reshape({x.size(0), flat_features_});
  x = torch::relu(fc1_->forward(x));
  return fc2_->forward(x);
}

torch::nn::Sequential CnnImpl::pipeline_layers() {
  const int64_t features = flat_features_;
  torch::nn::Sequential layers;
  layers->push_back(layer("conv1", conv1_, identity, relu_pool));
  layers->push_back(layer("conv2", conv2_, identity, relu_pool));
  layers->push_back(layer(
      "fc1", fc1_,
      [features](const torch::Tensor& x) {
        return x.reshape({x.size(0), features});
      },
      relu));
  layers->push_back(fc2_);
  return layers;
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

// A pre-norm transformer block: x + attention(norm1(x)), then x + mlp(norm2(x)). The ViT's
// attends to every token; a decoder's (causal) to the tokens up to its own.
class EncoderBlockImpl : public torch::nn::Module {
 public:
  EncoderBlockImpl(int64_t width, int64_t heads, int64_t mlp_ratio,
                   const comm::ProcessGroup& tensor_parallel, bool causal = false)
      : heads_(heads), causal_(causal) {
    norm1_ = register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
    torch::nn::MultiheadAttention attention(width, heads);
    torch::nn::Sequential mlp(torch::nn::Linear(width, width * mlp_ratio), torch::nn::GELU(),
                              torch::nn::Linear(width * mlp_ratio, width));
    if (tensor_parallel.valid() && tensor_parallel.world_size() > 1) {
      // The dense layers drew their weights from torch's generator as the dense model's do; the
      // sliced layers' own draws are undone, so that the model is the dense one, sliced, and the
      // blocks after this one draw what they would in a dense model.
      auto generator = at::detail::getDefaultCPUGenerator();
      std::unique_lock lock(generator.mutex());
      const auto state = generator.get_state();
      lock.unlock();
      parallel::TensorParallelSelfAttention sliced_attention(width, heads, tensor_parallel, causal);
      parallel::TensorParallelMlp sliced_mlp(width, width * mlp_ratio, tensor_parallel);
      lock.lock();
      generator.set_state(state);
      lock.unlock();
      sliced_attention->load_from_dense(attention);
      sliced_mlp->load_from_dense(mlp);
      tp_attention_ = register_module("attention", sliced_attention);
      norm2_ = register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
      tp_mlp_ = register_module("mlp", sliced_mlp);
    } else {
      attention_ = register_module("attention", attention);
      norm2_ = register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
      mlp_ = register_module("mlp", mlp);
    }
  }
  // With tensor parallelism: the dense block's attention and MLP sliced into this one, or this
  // one's gathered over the group into the dense block (collective). Dense: copies.
  void load_from_dense(EncoderBlockImpl& dense) {
    if (tp_attention_) {
      tp_attention_->load_from_dense(dense.attention_);
      tp_mlp_->load_from_dense(dense.mlp_);
    } else {
      copy_parameters(*dense.attention_, *attention_);
      copy_parameters(*dense.mlp_, *mlp_);
    }
  }
  void copy_to_dense(EncoderBlockImpl& dense) {
    if (tp_attention_) {
      tp_attention_->copy_to_dense(dense.attention_);
      tp_mlp_->copy_to_dense(dense.mlp_);
    } else {
      copy_parameters(*attention_, *dense.attention_);
      copy_parameters(*mlp_, *dense.mlp_);
    }
  }
  // x: [tokens, batch, width], the layout of torch::nn::MultiheadAttention.
  torch::Tensor forward(torch::Tensor x) {
    auto h = norm1_->forward(x);
    x = x + attend(h);
    h = norm2_->forward(x);
    return x + (tp_mlp_ ? tp_mlp_->forward(h) : mlp_->forward(h));
  }

 private:
  torch::Tensor attend(const torch::Tensor& h) {
    if (tp_attention_) return tp_attention_->forward(h);
    // torch::nn::MultiheadAttention's weights through the attention kernel: libtorch's module
    // computes the attention weights explicitly, keeping [tokens, tokens] of them for each head
    // for backward, and takes a decoder's mask only as a tensor.
    return attention_->out_proj->forward(parallel::self_attention_heads(
        h, attention_->in_proj_weight, attention_->in_proj_bias, heads_, causal_));
  }

  int64_t heads_;
  bool causal_;
  torch::nn::LayerNorm norm1_{nullptr}, norm2_{nullptr};
  torch::nn::MultiheadAttention attention_{nullptr};
  torch::nn::Sequential mlp_{nullptr};
  parallel::TensorParallelSelfAttention tp_attention_{nullptr};
  parallel::TensorParallelMlp tp_mlp_{nullptr};
};
TORCH_MODULE(EncoderBlock);

// The GPT's block: its own type, so that `--activation-checkpointing layers:DecoderBlock` names it.
class DecoderBlockImpl : public EncoderBlockImpl {
 public:
  DecoderBlockImpl(int64_t width, int64_t heads, int64_t mlp_ratio,
                   const comm::ProcessGroup& tensor_parallel)
      : EncoderBlockImpl(width, heads, mlp_ratio, tensor_parallel, /*causal=*/true) {}
};
TORCH_MODULE(DecoderBlock);

// Block i of a ViT's or GPT's blocks, each held through a FullyShard.
std::shared_ptr<EncoderBlockImpl> block(const torch::nn::Sequential& blocks, size_t i) {
  return blocks->ptr<parallel::FullyShardImpl>(i)->module_as<EncoderBlockImpl>();
}

// A transformer's weights from a dense one of the same options (`sliced` holds this rank's
// slices of the blocks; the other parameters are copied), or gathered into it (`gather`,
// collective).
void exchange_with_dense(torch::nn::Module& sliced, const torch::nn::Sequential& sliced_blocks,
                         torch::nn::Module& dense, const torch::nn::Sequential& dense_blocks,
                         bool gather) {
  if (gather) {
    copy_parameters(sliced, dense);
  } else {
    copy_parameters(dense, sliced);  // all but the sliced weights
  }
  for (size_t i = 0; i < sliced_blocks->size(); ++i) {
    if (gather) {
      block(sliced_blocks, i)->copy_to_dense(*block(dense_blocks, i));
    } else {
      block(sliced_blocks, i)->load_from_dense(*block(dense_blocks, i));
    }
  }
}

// A pipeline layer per block, through its FullyShard: what ZeRO stage 3 gathers and activation
// checkpointing recomputes. Between the layers the batch comes first, [N, T, width], the blocks
// take [T, N, width].
void push_block_layers(torch::nn::Sequential& layers, const torch::nn::Sequential& blocks) {
  for (size_t i = 0; i < blocks->size(); ++i) {
    parallel::FullyShard unit(blocks->ptr<parallel::FullyShardImpl>(i));
    layers->push_back(Layer(NamedModules{{"block", unit.ptr()}}, NamedTensors{},
                            [unit](const torch::Tensor& x) mutable {
                              return unit->forward(x.transpose(0, 1)).transpose(0, 1);
                            }));
  }
}

}  // namespace

ResNet18Impl::ResNet18Impl(const ModelOptions& o) {
  options_ = o;
  stem_ = register_module(
      "stem", unit(o, [channels = o.in_channels] {
        return torch::nn::Sequential(
            conv(channels, 64, 7, 2, 3), torch::nn::BatchNorm2d(64), torch::nn::ReLU(),
            torch::nn::MaxPool2d(torch::nn::MaxPool2dOptions(3).stride(2).padding(1)));
      }));
  torch::nn::Sequential layers;
  int64_t in = 64;
  for (int64_t out : {64, 128, 256, 512}) {
    const int64_t stride = out == 64 ? 1 : 2;
    layers->push_back(unit(o, [=] { return BasicBlock(in, out, stride); }));
    layers->push_back(unit(o, [=] { return BasicBlock(out, out, 1); }));
    in = out;
  }
  layers_ = register_module("layers", layers);
  fc_ = register_module(
      "fc", unit(o, [classes = o.num_classes] { return torch::nn::Linear(512, classes); }));
}

torch::Tensor ResNet18Impl::forward(torch::Tensor x) {
  x = layers_->forward(stem_->forward(x));
  x = F::adaptive_avg_pool2d(x, F::AdaptiveAvgPool2dFuncOptions(1)).flatten(1);
  return fc_->forward(x);
}

torch::nn::Sequential ResNet18Impl::pipeline_layers() {
  torch::nn::Sequential layers;
  layers->push_back(layer("stem", stem_, identity, identity));
  for (size_t i = 0; i < layers_->size(); ++i)
    layers->push_back(parallel::FullyShard(layers_->ptr<parallel::FullyShardImpl>(i)));
  layers->push_back(layer(
      "fc", fc_,
      [](const torch::Tensor& x) {
        return F::adaptive_avg_pool2d(x, F::AdaptiveAvgPool2dFuncOptions(1)).flatten(1);
      },
      identity));
  return layers;
}

VisionTransformerImpl::VisionTransformerImpl(const ModelOptions& o) {
  options_ = o;
  const int64_t tokens = (o.image_size / o.patch_size) * (o.image_size / o.patch_size);
  patch_embed_ = register_module(
      "patch_embed",
      torch::nn::Conv2d(
          torch::nn::Conv2dOptions(o.in_channels, o.width, o.patch_size).stride(o.patch_size)));
  cls_token_ = register_parameter("cls_token", torch::randn({1, 1, o.width}) * 0.02);
  positions_ = register_parameter("positions", torch::randn({tokens + 1, 1, o.width}) * 0.02);
  torch::nn::Sequential blocks;
  for (int64_t i = 0; i < o.depth; ++i)
    blocks->push_back(unit(
        o, [o] { return EncoderBlock(o.width, o.heads, o.mlp_ratio, o.tensor_parallel_group); }));
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

void VisionTransformerImpl::load_from_dense(VisionTransformerImpl& dense) {
  exchange_with_dense(*this, blocks_, dense, dense.blocks_, /*gather=*/false);
}

void VisionTransformerImpl::copy_to_dense(VisionTransformerImpl& dense) {
  exchange_with_dense(*this, blocks_, dense, dense.blocks_, /*gather=*/true);
}

// Between the layers the batch comes first, [N, tokens, width], as a pipeline needs; the blocks
// take the layout of torch::nn::MultiheadAttention, [tokens, N, width].
torch::nn::Sequential VisionTransformerImpl::pipeline_layers() {
  torch::nn::Sequential layers;
  auto patch_embed = patch_embed_;
  auto cls_token = cls_token_, positions = positions_;
  layers->push_back(Layer(
      NamedModules{{"patch_embed", patch_embed.ptr()}},
      NamedTensors{{"cls_token", cls_token}, {"positions", positions}},
      [patch_embed, cls_token, positions](const torch::Tensor& images) mutable {
        auto x = patch_embed->forward(images).flatten(2).permute({2, 0, 1});
        x = torch::cat({cls_token.expand({1, x.size(1), cls_token.size(2)}), x}, 0) + positions;
        return x.transpose(0, 1);
      }));
  push_block_layers(layers, blocks_);
  auto norm = norm_;
  auto head = head_;
  layers->push_back(Layer(NamedModules{{"norm", norm.ptr()}, {"head", head.ptr()}}, NamedTensors{},
                          [norm, head](const torch::Tensor& x) mutable {
                            return head->forward(norm->forward(x.select(1, 0)));
                          }));
  return layers;
}

namespace {

// tokens [N, T] -> the embedded sequence [N, T, width].
torch::Tensor embed(torch::nn::Embedding& embedding, const torch::Tensor& positions,
                    const torch::Tensor& tokens) {
  const int64_t context = positions.size(0);
  const int64_t length = tokens.dim() == 2 ? tokens.size(1) : 0;
  if (length < 1 || length > context) {
    throw UsageError("gpt: tokens of shape " + c10::str(tokens.sizes()) +
                     " where [batch, T] with T <= the context " + std::to_string(context) +
                     " was expected: use shorter sequences or a longer --context");
  }
  const auto ids = tokens.scalar_type() == torch::kLong ? tokens : tokens.to(torch::kLong);
  return embedding->forward(ids) + positions.narrow(0, 0, length);
}

}  // namespace

GptImpl::GptImpl(const ModelOptions& o) {
  options_ = o;
  token_embedding_ =
      register_module("token_embedding", torch::nn::Embedding(o.vocab_size, o.width));
  positions_ = register_parameter("positions", torch::randn({o.context, o.width}) * 0.02);
  torch::nn::Sequential blocks;
  for (int64_t i = 0; i < o.depth; ++i)
    blocks->push_back(unit(
        o, [o] { return DecoderBlock(o.width, o.heads, o.mlp_ratio, o.tensor_parallel_group); }));
  blocks_ = register_module("blocks", blocks);
  norm_ = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.width})));
  if (!o.tie_embeddings) {
    head_ = register_module(
        "head", torch::nn::Linear(torch::nn::LinearOptions(o.width, o.vocab_size).bias(false)));
  }
  // GPT-2's initialisation of the embeddings: N(0, 0.02).
  torch::NoGradGuard no_grad;
  token_embedding_->weight.normal_(0, 0.02);
}

torch::Tensor GptImpl::forward(torch::Tensor tokens) {
  // [N, T, width] -> [T, N, width], the blocks' layout, and back.
  auto x = blocks_->forward(embed(token_embedding_, positions_, tokens).transpose(0, 1));
  x = norm_->forward(x.transpose(0, 1));
  return head_ ? head_->forward(x) : F::linear(x, token_embedding_->weight);
}

std::pair<torch::Tensor, torch::Tensor> GptImpl::sample_batch(int64_t rows) const {
  const auto sequence = torch::randint(0, options_.vocab_size, {rows, options_.context + 1});
  return {sequence.narrow(1, 0, options_.context), sequence.narrow(1, 1, options_.context)};
}

void GptImpl::load_from_dense(GptImpl& dense) {
  exchange_with_dense(*this, blocks_, dense, dense.blocks_, /*gather=*/false);
}

void GptImpl::copy_to_dense(GptImpl& dense) {
  exchange_with_dense(*this, blocks_, dense, dense.blocks_, /*gather=*/true);
}

int64_t GptImpl::flops_per_token(int64_t tokens) const {
  const auto& o = options_;
  // Per block: q, k, v and the output projection (4 w^2), the MLP (2 r w^2); the head (w v).
  const int64_t weights =
      o.depth * (4 + 2 * o.mlp_ratio) * o.width * o.width + o.width * o.vocab_size;
  return 6 * weights + 12 * o.depth * o.width * tokens;
}

torch::nn::Sequential GptImpl::pipeline_layers() { return pipeline_layers(1); }

torch::nn::Sequential GptImpl::pipeline_layers(int ranks) {
  torch::nn::Sequential layers;
  auto embedding = token_embedding_;
  auto positions = positions_;
  layers->push_back(Layer(NamedModules{{"token_embedding", embedding.ptr()}},
                          NamedTensors{{"positions", positions}},
                          [embedding, positions](const torch::Tensor& tokens) mutable {
                            return embed(embedding, positions, tokens);
                          }));
  push_block_layers(layers, blocks_);
  auto norm = norm_;
  if (head_) {
    auto head = head_;
    layers->push_back(Layer(
        NamedModules{{"norm", norm.ptr()}, {"head", head.ptr()}}, NamedTensors{},
        [norm, head](const torch::Tensor& x) mutable { return head->forward(norm->forward(x)); }));
  } else {
    // Tied: the head reads the embedding layer's weight. On one rank a parameter of that layer
    // alone (its optimizer steps it once); over several, of the head layer too, on the last rank.
    NamedModules modules{{"norm", norm.ptr()}};
    if (ranks > 1) modules.emplace_back("token_embedding", embedding.ptr());
    const auto weight = token_embedding_->weight;
    layers->push_back(
        Layer(std::move(modules), NamedTensors{}, [norm, weight](const torch::Tensor& x) mutable {
          return F::linear(norm->forward(x), weight);
        }));
  }
  return layers;
}

torch::nn::Sequential pipeline_layers(ZooModelImpl& model, int ranks) {
  if (auto* gpt = dynamic_cast<GptImpl*>(&model)) return gpt->pipeline_layers(ranks);
  return model.pipeline_layers();
}

const std::vector<std::string>& model_names() {
  static const std::vector<std::string> names{"mlp", "cnn", "resnet18", "vit", "gpt"};
  return names;
}

ZooModel create_model(const std::string& name, const ModelOptions& o) {
  auto positive = [](const char* what, int64_t v) {
    if (v < 1)
      throw UsageError(std::string("model option ") + what + "=" + std::to_string(v) +
                       " must be >= 1");
  };
  positive("num_classes", o.num_classes);
  positive("in_channels", o.in_channels);
  positive("image_size", o.image_size);
  const bool transformer = name == "vit" || name == "gpt";
  if (o.tensor_parallel_group.valid() && o.tensor_parallel_group.world_size() > 1 &&
      (name == "mlp" || name == "cnn" || name == "resnet18")) {
    throw UsageError(name +
                     " has no tensor-parallel layers: use vit or gpt with tensor "
                     "parallelism, or pipeline " +
                     name + " instead");
  }
  if (transformer) {
    positive("depth", o.depth);
    positive("heads", o.heads);
    positive("mlp_ratio", o.mlp_ratio);
    if (o.width % o.heads != 0) {
      throw UsageError(name + ": width " + std::to_string(o.width) + " is not divisible by heads " +
                       std::to_string(o.heads) +
                       ": choose a width that is a multiple of the heads (e.g. " +
                       std::to_string(o.heads * std::max<int64_t>(1, o.width / o.heads)) + ")");
    }
    if (const auto& tp = o.tensor_parallel_group; tp.valid() && tp.world_size() > 1) {
      const int64_t ways = tp.world_size();
      if (o.heads % ways != 0 || (o.width * o.mlp_ratio) % ways != 0) {
        throw UsageError(name + ": tensor parallelism over " + std::to_string(ways) +
                         " ranks cuts the " + std::to_string(o.heads) + " heads and the " +
                         std::to_string(o.width * o.mlp_ratio) +
                         " MLP features into equal slices: use a tp degree that divides both");
      }
    }
  }
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
    if (o.image_size % o.patch_size != 0) {
      throw UsageError("vit: patch size " + std::to_string(o.patch_size) +
                       " does not divide image size " + std::to_string(o.image_size));
    }
    return std::make_shared<VisionTransformerImpl>(o);
  }
  if (name == "gpt") {
    positive("vocab_size", o.vocab_size);
    positive("context", o.context);
    return std::make_shared<GptImpl>(o);
  }
  std::string known;
  for (const auto& n : model_names()) known += (known.empty() ? "" : ", ") + n;
  throw UsageError("unknown model '" + name + "': choose one of " + known);
}

}  // namespace cohort::models

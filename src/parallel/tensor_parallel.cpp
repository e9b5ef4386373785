#include "cohort/parallel/tensor_parallel.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/linear.h>
#include <torch/nn/init.h>
#include <torch/version.h>

#include <cmath>
#include <limits>
#include <memory>
#include <string>

#include "cohort/error.h"

namespace cohort::parallel {
namespace {

namespace F = torch::nn::functional;

int64_t slice_of(int64_t size, const comm::ProcessGroup& group, const std::string& what) {
  if (!group.valid()) throw UsageError(what + ": the tensor-parallel group is empty");
  const int64_t tp = group.world_size();
  if (size % tp != 0) {
    throw UsageError(what + ": " + std::to_string(size) + " is not divisible by the tensor-" +
                     "parallel degree " + std::to_string(tp) + ": use a tp degree that divides " +
                     std::to_string(size));
  }
  return size / tp;
}

// torch::nn::Linear's initialisation, with the dense layer's fan-in.
void init_like_linear(at::Tensor& weight, at::Tensor& bias, int64_t fan_in) {
  const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
  torch::NoGradGuard no_grad;
  weight.uniform_(-bound, bound);
  if (bias.defined()) bias.uniform_(-bound, bound);
}

void check_dense(const at::Tensor& dense, at::IntArrayRef expected, const std::string& what) {
  if (dense.sizes() != expected) {
    throw UsageError(what + ": the dense weight is " + c10::str(dense.sizes()) + ", expected " +
                     c10::str(expected));
  }
}

// Every rank's slice of `t`, joined along `dim` in rank order.
at::Tensor gather_slices(comm::ProcessGroup& group, const at::Tensor& t, int64_t dim) {
  return at::cat(group.allgather(t.detach().contiguous()), dim);
}

}  // namespace

at::Tensor copy_to_tensor_parallel(const at::Tensor& x, comm::ProcessGroup group) {
  at::Tensor y = x.view_as(x);
  if (y.requires_grad() && group.world_size() > 1) {
    // A handle copy the (const) hook may call collectives on.
    auto handle = std::make_shared<comm::ProcessGroup>(std::move(group));
    y.register_hook([handle](const at::Tensor& grad) {
      std::vector<at::Tensor> summed{grad.clone(at::MemoryFormat::Contiguous)};
      handle->allreduce(summed);
      return summed[0];
    });
  }
  return y;
}

at::Tensor reduce_from_tensor_parallel(const at::Tensor& x, comm::ProcessGroup group) {
  if (group.world_size() == 1) return x;
  std::vector<at::Tensor> summed{x.detach().clone(at::MemoryFormat::Contiguous)};
  group.allreduce(summed);
  // The value of the sum, the gradient of the identity.
  return x + (summed[0] - x).detach();
}

ColumnParallelLinearImpl::ColumnParallelLinearImpl(int64_t in, int64_t out,
                                                   comm::ProcessGroup group, bool with_bias)
    : group_(std::move(group)) {
  const int64_t rows = slice_of(out, group_,
                                "ColumnParallelLinear(" + std::to_string(in) + ", " +
                                    std::to_string(out) + ") output features");
  weight = register_parameter("weight", at::empty({rows, in}));
  if (with_bias) bias = register_parameter("bias", at::empty({rows}));
  init_like_linear(weight, bias, in);
}

void ColumnParallelLinearImpl::load_from_dense(const torch::nn::Linear& dense) {
  const int64_t rows = weight.size(0), r = group_.rank();
  check_dense(dense->weight, {rows * group_.world_size(), weight.size(1)}, "ColumnParallelLinear");
  torch::NoGradGuard no_grad;
  weight.copy_(tensor_parallel_slice(dense->weight, {.dim = 0}, r, group_.world_size()));
  if (bias.defined())
    bias.copy_(tensor_parallel_slice(dense->bias, {.dim = 0}, r, group_.world_size()));
}

void ColumnParallelLinearImpl::copy_to_dense(torch::nn::Linear& dense) {
  check_dense(dense->weight, {weight.size(0) * group_.world_size(), weight.size(1)},
              "ColumnParallelLinear");
  const at::Tensor w = gather_slices(group_, weight, 0);
  const at::Tensor b = bias.defined() ? gather_slices(group_, bias, 0) : at::Tensor();
  torch::NoGradGuard no_grad;
  dense->weight.copy_(w);
  if (b.defined()) dense->bias.copy_(b);
}

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& x) {
  return F::linear(copy_to_tensor_parallel(x, group_), weight, bias);
}

RowParallelLinearImpl::RowParallelLinearImpl(int64_t in, int64_t out, comm::ProcessGroup group,
                                             bool with_bias)
    : group_(std::move(group)) {
  const int64_t columns = slice_of(
      in, group_,
      "RowParallelLinear(" + std::to_string(in) + ", " + std::to_string(out) + ") input features");
  weight = register_parameter("weight", at::empty({out, columns}));
  if (with_bias) bias = register_parameter("bias", at::empty({out}));
  init_like_linear(weight, bias, in);
}

void RowParallelLinearImpl::load_from_dense(const torch::nn::Linear& dense) {
  const int64_t columns = weight.size(1), r = group_.rank();
  check_dense(dense->weight, {weight.size(0), columns * group_.world_size()}, "RowParallelLinear");
  torch::NoGradGuard no_grad;
  weight.copy_(tensor_parallel_slice(dense->weight, {.dim = 1}, r, group_.world_size()));
  if (bias.defined()) bias.copy_(dense->bias);
}

void RowParallelLinearImpl::copy_to_dense(torch::nn::Linear& dense) {
  check_dense(dense->weight, {weight.size(0), weight.size(1) * group_.world_size()},
              "RowParallelLinear");
  const at::Tensor w = gather_slices(group_, weight, 1);
  torch::NoGradGuard no_grad;
  dense->weight.copy_(w);
  if (bias.defined()) dense->bias.copy_(bias);  // the same on every rank
}

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& x) {
  at::Tensor y = reduce_from_tensor_parallel(F::linear(x, weight), group_);
  return bias.defined() ? y + bias : y;
}

TensorParallelMlpImpl::TensorParallelMlpImpl(int64_t width, int64_t hidden,
                                             comm::ProcessGroup group) {
  fc1_ = register_module("fc1", ColumnParallelLinear(width, hidden, group));
  fc2_ = register_module("fc2", RowParallelLinear(hidden, width, group));
}

void TensorParallelMlpImpl::load_from_dense(const torch::nn::Sequential& dense) {
  if (dense->size() != 3) {
    throw UsageError("TensorParallelMlp: the dense MLP has " + std::to_string(dense->size()) +
                     " layers; expected Linear, GELU, Linear");
  }
  fc1_->load_from_dense(dense->ptr<torch::nn::LinearImpl>(0));
  fc2_->load_from_dense(dense->ptr<torch::nn::LinearImpl>(2));
}

void TensorParallelMlpImpl::copy_to_dense(torch::nn::Sequential& dense) {
  if (dense->size() != 3) {
    throw UsageError("TensorParallelMlp: the dense MLP has " + std::to_string(dense->size()) +
                     " layers; expected Linear, GELU, Linear");
  }
  torch::nn::Linear fc1(dense->ptr<torch::nn::LinearImpl>(0));
  torch::nn::Linear fc2(dense->ptr<torch::nn::LinearImpl>(2));
  fc1_->copy_to_dense(fc1);
  fc2_->copy_to_dense(fc2);
}

at::Tensor TensorParallelMlpImpl::forward(const at::Tensor& x) {
  return fc2_->forward(F::gelu(fc1_->forward(x)));
}

TensorParallelSelfAttentionImpl::TensorParallelSelfAttentionImpl(int64_t width, int64_t heads,
                                                                 comm::ProcessGroup group,
                                                                 bool causal)
    : width_(width), heads_(heads), causal_(causal), group_(std::move(group)) {
  if (heads < 1 || width % heads != 0) {
    throw UsageError("TensorParallelSelfAttention: width " + std::to_string(width) +
                     " is not divisible by heads " + std::to_string(heads));
  }
  local_heads_ = slice_of(heads, group_, "TensorParallelSelfAttention heads");
  const int64_t local = local_heads_ * (width / heads);
  in_proj_weight_ = register_parameter("in_proj_weight", at::empty({3 * local, width}));
  in_proj_bias_ = register_parameter("in_proj_bias", at::empty({3 * local}));
  init_like_linear(in_proj_weight_, in_proj_bias_, width);
  out_proj_ = register_module("out_proj", RowParallelLinear(width, width, group_));
}

void TensorParallelSelfAttentionImpl::load_from_dense(const torch::nn::MultiheadAttention& dense) {
  check_dense(dense->in_proj_weight, {3 * width_, width_}, "TensorParallelSelfAttention");
  torch::NoGradGuard no_grad;
  // This rank's heads of each of q, k and v.
  const TensorParallelCut qkv{.dim = 0, .blocks = 3};
  in_proj_weight_.copy_(
      tensor_parallel_slice(dense->in_proj_weight, qkv, group_.rank(), group_.world_size()));
  in_proj_bias_.copy_(
      tensor_parallel_slice(dense->in_proj_bias, qkv, group_.rank(), group_.world_size()));
  out_proj_->load_from_dense(dense->out_proj);
}

void TensorParallelSelfAttentionImpl::copy_to_dense(torch::nn::MultiheadAttention& dense) {
  const int64_t local = local_heads_ * (width_ / heads_);
  check_dense(dense->in_proj_weight, {3 * width_, width_}, "TensorParallelSelfAttention");
  // Rank r's rows are its q, k and v slices stacked: dense q is every rank's q slice in order.
  const auto weights = group_.allgather(in_proj_weight_.detach().contiguous());
  const auto biases = group_.allgather(in_proj_bias_.detach().contiguous());
  torch::NoGradGuard no_grad;
  for (int64_t part = 0; part < 3; ++part) {
    for (size_t r = 0; r < weights.size(); ++r) {
      const int64_t row = part * width_ + static_cast<int64_t>(r) * local;
      dense->in_proj_weight.narrow(0, row, local).copy_(weights[r].narrow(0, part * local, local));
      dense->in_proj_bias.narrow(0, row, local).copy_(biases[r].narrow(0, part * local, local));
    }
  }
  out_proj_->copy_to_dense(dense->out_proj);
}

at::Tensor self_attention_heads(const at::Tensor& x, const at::Tensor& in_proj_weight,
                                const at::Tensor& in_proj_bias, int64_t heads, bool causal) {
  const int64_t tokens = x.size(0), batch = x.size(1);
  const int64_t head_dim = in_proj_weight.size(0) / (3 * heads);
  const auto qkv = F::linear(x, in_proj_weight, in_proj_bias).chunk(3, -1);
#if TORCH_VERSION_MAJOR >= 2
  // [tokens, batch, heads x head_dim] -> [batch, heads, tokens, head_dim]. Four dimensions, as
  // CUDA's fused kernels (flash, memory-efficient and cuDNN attention) require: given three,
  // libtorch runs its math kernel there, which keeps every head's [tokens, tokens] weights for
  // backward. (On the CPU, libtorch 2.14 runs flash attention for three dimensions too.)
  auto split = [&](const at::Tensor& t) {
    return t.reshape({tokens, batch, heads, head_dim}).permute({1, 2, 0, 3});
  };
  const at::Tensor out = at::scaled_dot_product_attention(split(qkv[0]), split(qkv[1]),
                                                          split(qkv[2]), {}, 0.0, causal);
  return out.permute({2, 0, 1, 3}).reshape({tokens, batch, heads * head_dim});
#else
  // [tokens, batch, heads x head_dim] -> [batch x heads, tokens, head_dim], as bmm takes them.
  auto split = [&](const at::Tensor& t) {
    return t.reshape({tokens, batch * heads, head_dim}).transpose(0, 1);
  };
  const at::Tensor q = split(qkv[0]) / std::sqrt(static_cast<double>(head_dim));
  at::Tensor scores = at::bmm(q, split(qkv[1]).transpose(1, 2));
  if (causal) {
    const auto future = at::ones({tokens, tokens}, x.options().dtype(at::kBool)).triu(1);
    scores = scores.masked_fill(future, -std::numeric_limits<double>::infinity());
  }
  const at::Tensor out = at::bmm(at::softmax(scores, -1), split(qkv[2]));
  return out.transpose(0, 1).reshape({tokens, batch, heads * head_dim});
#endif
}

at::Tensor TensorParallelSelfAttentionImpl::forward(const at::Tensor& x) {
  return out_proj_->forward(self_attention_heads(
      copy_to_tensor_parallel(x, group_), in_proj_weight_, in_proj_bias_, local_heads_, causal_));
}

std::map<std::string, TensorParallelCut> tensor_parallel_cuts(const torch::nn::Module& module) {
  std::map<std::string, TensorParallelCut> cuts;
  for (const auto& item : module.named_modules()) {
    const std::string prefix = item.key().empty() ? "" : item.key() + ".";
    const torch::nn::Module* m = item.value().get();
    auto add = [&](const char* name, const at::Tensor& t, TensorParallelCut cut) {
      if (t.defined()) cuts[prefix + name] = cut;
    };
    if (const auto* column = dynamic_cast<const ColumnParallelLinearImpl*>(m)) {
      add("weight", column->weight, {.dim = 0});
      add("bias", column->bias, {.dim = 0});
    } else if (const auto* row = dynamic_cast<const RowParallelLinearImpl*>(m)) {
      add("weight", row->weight, {.dim = 1});
    } else if (dynamic_cast<const TensorParallelSelfAttentionImpl*>(m) != nullptr) {
      for (const auto& p : m->named_parameters(/*recurse=*/false))
        cuts[prefix + p.key()] = {.dim = 0, .blocks = 3};
    }
  }
  return cuts;
}

std::set<std::string> tensor_parallel_slices(const torch::nn::Module& module) {
  std::set<std::string> names;
  for (const auto& [name, cut] : tensor_parallel_cuts(module)) names.insert(name);
  return names;
}

namespace {

// The regions of `whole` that slice `index` of `count` consists of, one per block.
std::vector<at::Tensor> slice_regions(const at::Tensor& whole, TensorParallelCut cut, int64_t index,
                                      int64_t count) {
  const int64_t block = whole.size(cut.dim) / cut.blocks, length = block / count;
  if (count < 1 || index < 0 || index >= count || block * cut.blocks != whole.size(cut.dim) ||
      length * count != block) {
    throw UsageError("tensor-parallel slice " + std::to_string(index) + " of " +
                     std::to_string(count) + ": a tensor of shape " + c10::str(whole.sizes()) +
                     " is not " + std::to_string(cut.blocks) + " block(s) along dim " +
                     std::to_string(cut.dim) + " divisible into " + std::to_string(count) +
                     " slices");
  }
  std::vector<at::Tensor> regions;
  for (int64_t b = 0; b < cut.blocks; ++b)
    regions.push_back(whole.narrow(cut.dim, b * block + index * length, length));
  return regions;
}

}  // namespace

at::Tensor tensor_parallel_slice(const at::Tensor& whole, TensorParallelCut cut, int64_t index,
                                 int64_t count) {
  const auto regions = slice_regions(whole, cut, index, count);
  return regions.size() == 1 ? regions[0] : at::cat(regions, cut.dim);
}

void set_tensor_parallel_slice(at::Tensor& whole, TensorParallelCut cut, int64_t index,
                               int64_t count, const at::Tensor& slice) {
  auto regions = slice_regions(whole, cut, index, count);
  const int64_t length = regions[0].size(cut.dim);
  for (size_t b = 0; b < regions.size(); ++b)
    regions[b].copy_(slice.narrow(cut.dim, static_cast<int64_t>(b) * length, length));
}

}  // namespace cohort::parallel

/// \file
/// Tensor parallelism (Megatron-LM, Shoeybi et al. 2019): a layer's weight cut in slices over the
/// ranks of a tensor-parallel group. A column-parallel layer followed by a row-parallel one (an
/// MLP, or attention's projections by heads) needs one all-reduce in forward and one in backward.
#pragma once
#include <map>
#include <set>
#include <string>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include "cohort/comm/process_group.h"

namespace cohort::parallel {

/// Identity forward; the gradient is summed over `group` in backward (where a replicated input
/// enters column-parallel layers: each rank's slice contributes to its gradient).
at::Tensor copy_to_tensor_parallel(const at::Tensor& x, comm::ProcessGroup group);
/// Sum over `group` forward (the partial outputs of a row-parallel layer); identity backward.
at::Tensor reduce_from_tensor_parallel(const at::Tensor& x, comm::ProcessGroup group);

/// y = x A^T + b with A's rows (the output features) cut over the group: rank r computes output
/// features [r out/tp, (r+1) out/tp). `out` must be divisible by the group's size.
class ColumnParallelLinearImpl : public torch::nn::Module {
 public:
  /// A layer of `in` inputs and `out` outputs whose outputs are cut over `group`.
  ColumnParallelLinearImpl(int64_t in, int64_t out, comm::ProcessGroup group, bool bias = true);
  /// Takes this rank's rows of a dense layer of the same shape.
  void load_from_dense(const torch::nn::Linear& dense);
  /// Gathers the whole layer from the group's slices into `dense` (a collective: every rank of
  /// the group calls it). load_from_dense's inverse.
  void copy_to_dense(torch::nn::Linear& dense);
  /// x: [..., in] (the same on every rank) -> [..., out / tp].
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;  ///< this rank's rows of the weight
  at::Tensor bias;    ///< this rank's rows of the bias

 private:
  comm::ProcessGroup group_;
};
/// The module holder of ColumnParallelLinearImpl.
TORCH_MODULE(ColumnParallelLinear);

/// y = x A^T + b with A's columns (the input features) cut over the group: rank r takes input
/// features [r in/tp, (r+1) in/tp), the partial products are summed over the group, b added once.
class RowParallelLinearImpl : public torch::nn::Module {
 public:
  /// A layer of `in` inputs and `out` outputs whose inputs are cut over `group`.
  RowParallelLinearImpl(int64_t in, int64_t out, comm::ProcessGroup group, bool bias = true);
  /// Takes this rank's columns of a dense layer of the same shape.
  void load_from_dense(const torch::nn::Linear& dense);
  /// Gathers the whole layer into `dense` (a collective of the group); load_from_dense's inverse.
  void copy_to_dense(torch::nn::Linear& dense);
  /// x: [..., in / tp] (this rank's slice) -> [..., out], the same on every rank.
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;  ///< this rank's columns of the weight
  at::Tensor bias;    ///< the bias, whole on every rank

 private:
  comm::ProcessGroup group_;
};
/// The module holder of RowParallelLinearImpl.
TORCH_MODULE(RowParallelLinear);

/// Linear(width, hidden), GELU, Linear(hidden, width), the hidden features cut over the group:
/// one all-reduce forward, one backward. `hidden` must be divisible by the group's size.
class TensorParallelMlpImpl : public torch::nn::Module {
 public:
  /// The MLP of `width` features and `hidden` hidden ones, cut over `group`.
  TensorParallelMlpImpl(int64_t width, int64_t hidden, comm::ProcessGroup group);
  /// From a dense Sequential(Linear(width, hidden), GELU, Linear(hidden, width)).
  void load_from_dense(const torch::nn::Sequential& dense);
  /// Gathers the whole MLP into `dense` (a collective of the group).
  void copy_to_dense(torch::nn::Sequential& dense);
  /// [..., width] -> [..., width], the same on every rank.
  at::Tensor forward(const at::Tensor& x);

 private:
  ColumnParallelLinear fc1_{nullptr};
  RowParallelLinear fc2_{nullptr};
};
/// The module holder of TensorParallelMlpImpl.
TORCH_MODULE(TensorParallelMlp);

/// Scaled dot-product attention of `heads` heads before the output projection, in
/// torch::nn::MultiheadAttention's layout: x [tokens, batch, width] projected by `in_proj_weight`
/// [3 x heads x head_dim, width] and `in_proj_bias` (q, k and v stacked) -> [tokens, batch,
/// heads x head_dim]. `causal`: token t attends to tokens 0..t only (a decoder's mask). Uses
/// at::scaled_dot_product_attention where libtorch has it (2.0 on), in the four-dimensional
/// layout its fused kernels take (on CUDA, only that one), so that backward keeps no [tokens,
/// tokens] weights; the explicit softmax before.
at::Tensor self_attention_heads(const at::Tensor& x, const at::Tensor& in_proj_weight,
                                const at::Tensor& in_proj_bias, int64_t heads, bool causal);

/// Self-attention with the heads cut over the group (torch::nn::MultiheadAttention's math and
/// layout, [tokens, batch, width]): q, k and v column-parallel by heads, the output projection
/// row-parallel. `heads` must be divisible by the group's size.
class TensorParallelSelfAttentionImpl : public torch::nn::Module {
 public:
  /// Self-attention of `width` features and `heads` heads, the heads cut over `group`; `causal`:
  /// each token attends to itself and the tokens before it only (a decoder's).
  TensorParallelSelfAttentionImpl(int64_t width, int64_t heads, comm::ProcessGroup group,
                                  bool causal = false);
  /// Takes this rank's heads of a dense torch::nn::MultiheadAttention(width, heads).
  void load_from_dense(const torch::nn::MultiheadAttention& dense);
  /// Gathers the whole attention into `dense` (a collective of the group).
  void copy_to_dense(torch::nn::MultiheadAttention& dense);
  /// [tokens, batch, width] -> [tokens, batch, width], the same on every rank.
  at::Tensor forward(const at::Tensor& x);

 private:
  int64_t width_, heads_, local_heads_;
  bool causal_;
  comm::ProcessGroup group_;
  at::Tensor in_proj_weight_, in_proj_bias_;  ///< this rank's q, k and v rows, stacked
  RowParallelLinear out_proj_{nullptr};
};
/// The module holder of TensorParallelSelfAttentionImpl.
TORCH_MODULE(TensorParallelSelfAttention);

/// How a parameter is cut over a tensor-parallel group: along `dim`, in `blocks` equal blocks that
/// are each cut in as many slices as the group has ranks; rank r holds slice r of every block,
/// stacked (attention's in_proj rows: the q, k and v blocks, each cut by heads).
struct TensorParallelCut {
  int64_t dim = 0;     ///< the dimension cut
  int64_t blocks = 1;  ///< equal blocks along it, each cut into slices
};

/// The parameters of `module` that are cut over a tensor-parallel group (each rank holds another
/// slice), by their names in `module`, with their cuts: the column-parallel layers' weights and
/// biases (dim 0), the row-parallel layers' weights (dim 1), attention's in_proj weight and bias
/// (dim 0, 3 blocks). Every other parameter is whole on each rank of the group, its gradient the
/// same there (e.g. a row-parallel layer's bias, a layer norm), so a norm over the group counts
/// it once.
std::map<std::string, TensorParallelCut> tensor_parallel_cuts(const torch::nn::Module& module);
/// Their names alone.
std::set<std::string> tensor_parallel_slices(const torch::nn::Module& module);

/// Slice `index` of `count` of a whole tensor cut by `cut` (what rank `index` of a group of
/// `count` holds; load_from_dense's), and its inverse: `slice` written into that region of `whole`.
at::Tensor tensor_parallel_slice(const at::Tensor& whole, TensorParallelCut cut, int64_t index,
                                 int64_t count);
/// See tensor_parallel_slice(): writes `slice` into its region of `whole`.
void set_tensor_parallel_slice(at::Tensor& whole, TensorParallelCut cut, int64_t index,
                               int64_t count, const at::Tensor& slice);

}  // namespace cohort::parallel

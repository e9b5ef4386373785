#pragma once
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "cohort/comm/process_group.h"

// What every data-parallel engine (DDP, ZeRO) does to make the ranks' replicas one model.
namespace cohort::parallel::detail {

// Every rank publishes its parameters' shapes and dtypes; a mismatch is a UsageError naming the
// first differing parameter and the two ranks, instead of a hang or a size error inside a
// collective later. `who` starts the message (e.g. "prepare_model").
void verify_same_layout(comm::ProcessGroup& group, const std::vector<std::string>& names,
                        const std::vector<at::Tensor>& params, const std::string& who);

// Overwrites `tensors` with rank 0's values: one broadcast per dtype and device.
void broadcast_from_rank0(comm::ProcessGroup& group, const std::vector<at::Tensor>& tensors);
// Replaces `tensors` (floating point) with their mean over the ranks: one all-reduce per dtype
// and device.
void average_across_ranks(comm::ProcessGroup& group, const std::vector<at::Tensor>& tensors);

// Every rank takes rank 0's parameters and buffers (nothing with one rank).
void take_rank0_state(comm::ProcessGroup& group, const std::vector<at::Tensor>& params,
                      const std::vector<at::Tensor>& buffers);
// Where data parallelism starts: verify_same_layout, then take_rank0_state.
void start_replicas(comm::ProcessGroup& group, const std::vector<std::string>& names,
                    const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& buffers,
                    const std::string& who);

// A module's trainable parameters (requires_grad), in registration order, with their names.
struct NamedParameters {
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
};
// The module's trainable parameters, checked to be exactly `optimizer_params` (each one in it,
// none other) and of one dtype and device: a UsageError starting with `who` names the parameter
// otherwise, and one without any.
NamedParameters trainable_parameters(const torch::nn::Module& module,
                                     const std::vector<at::Tensor>& optimizer_params,
                                     const std::string& who);

// For an optimizer that wraps another (local SGD, the parameter server): the wrapped one's param
// groups and a copy of its defaults; a UsageError starting with `who` when it is null.
std::vector<torch::optim::OptimizerParamGroup> param_groups_of(
    const torch::optim::Optimizer* optimizer, const std::string& who);
std::unique_ptr<torch::optim::OptimizerOptions> defaults_of(
    const torch::optim::Optimizer* optimizer, const std::string& who);

// Loads `inner`'s state, then gives its param groups' options (a scheduled lr among them) to
// `wrapper`, the optimizer that wraps it.
void load_wrapped(torch::optim::Optimizer& wrapper, torch::optim::Optimizer& inner,
                  torch::serialize::InputArchive& archive);

// "[2,3] Float": a tensor's shape and dtype, for messages.
std::string describe(const at::Tensor& t);

}  // namespace cohort::parallel::detail

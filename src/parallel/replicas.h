#pragma once
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

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

// "[2,3] Float": a tensor's shape and dtype, for messages.
std::string describe(const at::Tensor& t);

}  // namespace cohort::parallel::detail

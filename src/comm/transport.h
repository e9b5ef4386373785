// The transports under a ProcessGroup (private to comm/): one c10d group each over the group's
// ranks, Gloo for CPU tensors (and CUDA ones through Gloo's CUDA path), NCCL for CUDA tensors.
// What a transport's c10d group lacks is built here from what it has, so ProcessGroup offers
// the same collectives on every transport and every libtorch line.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cohort/comm/process_group.h"
#include "comm/c10d_compat.h"

namespace cohort::comm {

// A collective a transport started: the native work, and what is left to do once it completed
// (Gloo has no average; a built-up collective copies its result out).
struct Started {
  c10::intrusive_ptr<c10d::Work> work;
  std::function<void()> finish;
};

class Transport {
 public:
  enum class Kind { kGloo, kNccl };
  Transport(Kind kind, c10::intrusive_ptr<NativeGroup> native, int rank, int world_size,
            std::chrono::milliseconds timeout);
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;

  Kind kind() const { return kind_; }
  const char* name() const { return kind_ == Kind::kGloo ? "gloo" : "nccl"; }

  Started allreduce(std::vector<at::Tensor>& tensors, ReduceOp op);
  Started broadcast(std::vector<at::Tensor>& tensors, int root);
  Started allgather(std::vector<at::Tensor>& outputs, const at::Tensor& input);
  Started allgather_into(at::Tensor& output, const at::Tensor& input);
  Started reduce_scatter(at::Tensor& output, std::vector<at::Tensor>& inputs, ReduceOp op);
  Started reduce_scatter_tensor(at::Tensor& output, const at::Tensor& input, ReduceOp op);
  Started all_to_all(at::Tensor& output, const at::Tensor& input,
                     std::vector<int64_t> output_splits, std::vector<int64_t> input_splits);
  Started send(const at::Tensor& tensor, int peer, int tag);
  Started recv(at::Tensor& tensor, int peer, int tag);
  Started barrier();

  // Bytes of the buffers scratch() has made, free or in use: what it keeps between collectives.
  int64_t scratch_bytes() const;

 private:
  // Gloo has no reduce-scatter in libtorch 1.13 (one path on every line keeps it tested):
  // reduce_scatter_gloo picks an all-to-all of the pieces, reduced on arrival (float32 and
  // float64 CPU tensors), or else an all-reduce of the flat tensor, of which each rank keeps its
  // part. Both may reduce into `flat`.
  Started reduce_scatter_gloo(at::Tensor& output, at::Tensor flat, ReduceOp op);
  Started reduce_scatter_by_all_to_all(at::Tensor& output, at::Tensor flat, ReduceOp op);
  Started reduce_scatter_by_allreduce(at::Tensor& output, at::Tensor flat, ReduceOp op);
  // An all-reduce of 16-bit floats as an all-gather of their bits and a reduction in fp32 on
  // each rank: Gloo sums no bfloat16, libtorch 2.x's Gloo no float16 either, and the fp32
  // reduction is the more exact one.
  Started allreduce_by_allgather(std::vector<at::Tensor>& tensors, ReduceOp op);
  std::function<void()> average(std::vector<at::Tensor> tensors) const;
  c10d::ReduceOp native_op(ReduceOp op) const;
  // Whether Gloo moves this tensor with its all-to-all (CPU, float32 or float64), which the
  // built-up reduce-scatter and all-gather use.
  bool gloo_all_to_all_fits(const at::Tensor& t) const;
  // A buffer of `numel` elements like `like`, from a pool that keeps the buffers of earlier
  // collectives: a fresh 100 MB buffer costs a page fault per 4 KiB on every call. The buffer
  // goes back to the pool when the last copy of the returned handle is gone.
  std::shared_ptr<at::Tensor> scratch(int64_t numel, const at::Tensor& like);

  Kind kind_;
  c10::intrusive_ptr<NativeGroup> native_;
  int rank_;
  int world_size_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<struct ScratchPool> scratch_pool_;
};

// Gloo over `store` (whose keys it prefixes itself) on options.interface_address.
std::unique_ptr<Transport> make_gloo_transport(const c10::intrusive_ptr<c10d::Store>& store,
                                               int rank, int world_size,
                                               const ProcessGroupOptions& options);
// A UsageError when this libtorch has no NCCL (nccl_available()).
void require_nccl();
// NCCL; a UsageError when this libtorch has none.
std::unique_ptr<Transport> make_nccl_transport(const c10::intrusive_ptr<c10d::Store>& store,
                                               int rank, int world_size,
                                               const ProcessGroupOptions& options);

}  // namespace cohort::comm

#pragma once
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "cohort/comm/store.h"

namespace cohort::comm {

enum class ReduceOp { kSum, kAvg, kMax, kMin };

struct ProcessGroupOptions {
  // Address of this host's interface that the transport binds to.
  std::string interface_address = "127.0.0.1";
  // Deadline for every rank to join the group.
  std::chrono::milliseconds setup_timeout{60'000};
  // Deadline of each collective.
  std::chrono::milliseconds timeout{300'000};
  // Transport threads of the backend; 1 keeps them from competing with compute on small hosts.
  int threads = 1;
  // Keys of this group live under this prefix in the store, so several groups share one store.
  std::string prefix = "pg";
};

// An in-flight collective.
class Work {
 public:
  struct State;  // opaque; defined in src/comm/process_group.cpp
  Work() = default;
  explicit Work(std::shared_ptr<State> state) : state_(std::move(state)) {}
  // Blocks until done; throws TimeoutError after `timeout` naming the collective.
  void wait();
  bool completed() const;
  bool valid() const { return state_ != nullptr; }
  // Runs `fn` in wait(), after the collective completed (e.g. to decompress a result).
  Work& then(std::function<void()> fn);

 private:
  std::shared_ptr<State> state_;
};

// A group of ranks that run collectives together (Gloo underneath). Passed by value:
// copies refer to the same group.
class ProcessGroup {
 public:
  // An empty handle; use create().
  ProcessGroup() = default;
  static ProcessGroup create(Store store, int rank, int world_size,
                             const ProcessGroupOptions& options = {});

  bool valid() const { return state_ != nullptr; }
  int rank() const;
  int world_size() const;
  std::chrono::milliseconds timeout() const;

  // Asynchronous in-place all-reduce of tensors of one dtype and device.
  Work allreduce_async(std::vector<at::Tensor>& tensors, ReduceOp op = ReduceOp::kSum);
  void allreduce(std::vector<at::Tensor>& tensors, ReduceOp op = ReduceOp::kSum);
  // How many collectives this rank has entered, and the name of the last: what a stall
  // inspector compares across ranks to name those that did not enter a collective.
  int64_t collectives_entered() const;
  std::string last_collective() const;

  Work broadcast_async(std::vector<at::Tensor>& tensors, int root);
  void broadcast(std::vector<at::Tensor>& tensors, int root);
  // Gathers one tensor of the same shape from every rank, ordered by rank.
  std::vector<at::Tensor> allgather(const at::Tensor& tensor);
  void barrier();

 private:
  struct State;
  explicit ProcessGroup(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;
};

}  // namespace cohort::comm

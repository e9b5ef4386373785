/// \file
/// A whole training step (forward, backward, gradient all-reduce, optimizer step) captured once
/// as a CUDA graph and replayed: one launch per step instead of hundreds, which is what bounds a
/// small model's step on a modern GPU.
///
///   auto step = [&](const std::vector<torch::Tensor>& in) {
///     optimizer.zero_grad();
///     auto loss = torch::nn::functional::cross_entropy(model->forward(in[0]), in[1]);
///     loss.backward();
///     optimizer.step();
///     return loss.detach();
///   };
///   train::CapturedStep captured(step, {.optimizer = &optimizer});
///   for (auto& batch : loader) auto loss = captured.run({batch.data, batch.target});
///
/// The first `warmup_steps` calls run eagerly on a side stream (libraries pick their algorithms,
/// optimizer state and gradients are allocated, DDP's buckets settle); the next one captures the
/// step on the static input buffers and replays it; every later call copies its inputs into those
/// buffers and replays. Every call is one real training step: the results are the eager loop's.
///
/// A step that cannot be captured (a host synchronisation such as .item(), a CPU tensor, an
/// operation CUDA graphs refuse) runs eagerly from then on, with one logged reason; with a process
/// group, the ranks agree first, so that every rank captures or none does. Inputs of other shapes
/// than the captured ones (a partial last batch) run eagerly too.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace cohort::comm {
class ProcessGroup;
}
namespace cohort::optim {
class FlatOptimizer;
}

namespace cohort::train {

/// How CapturedStep captures: the eager steps before it, the optimizer and group to keep in step.
struct CaptureOptions {
  /// Eager steps before the capture; >= 1 (SGD's first step differs from the others).
  int warmup_steps = 3;
  /// The step's optimizer, when it is a FlatOptimizer: it keeps its step counts and learning
  /// rates (an LR schedule's changes reach the replays) in line with the replays. Other
  /// optimizers are captured as they are: a torch::optim optimizer keeps its state right, but a
  /// learning rate changed after the capture does not reach the graph.
  optim::FlatOptimizer* optimizer = nullptr;
  /// The group whose ranks capture together (the step's DDP group): they agree on capturing or
  /// falling back. The step's collectives must run over NCCL; Gloo's cannot be captured.
  comm::ProcessGroup* group = nullptr;
  /// Logs the reason for falling back to eager steps (default: standard error, rank 0 only).
  std::function<void(const std::string&)> log;
};

/// A training step (forward, backward, optimizer) captured once as a CUDA graph and replayed:
/// one kernel launch per step. Falls back to eager steps, saying why, where capture fails.
class CapturedStep {
 public:
  /// The step: the inputs in, the loss (or any tensor) out.
  using StepFunction = std::function<torch::Tensor(const std::vector<torch::Tensor>& inputs)>;

  /// UsageError when warmup_steps < 1.
  explicit CapturedStep(StepFunction step, CaptureOptions options = {});
  ~CapturedStep();
  CapturedStep(const CapturedStep&) = delete;
  CapturedStep& operator=(const CapturedStep&) = delete;

  /// One training step on `inputs` (CUDA tensors; the same number every call); returns what the
  /// step function returns (after a replay: a buffer the next replay overwrites; clone it to keep
  /// it). UsageError for CPU inputs: CUDA graphs need a GPU.
  torch::Tensor run(const std::vector<torch::Tensor>& inputs);

  /// Whether the step is a graph now (false before the capture and after a fallback).
  bool captured() const;
  /// Why the step runs eagerly for good; empty while it is captured or not yet tried.
  const std::string& fallback_reason() const;
  /// Calls that replayed the graph.
  int64_t replays() const;
  /// Calls that ran eagerly (warm-up, other shapes, fallback).
  int64_t eager_steps() const;

  /// Whether this libtorch can capture CUDA graphs (a CUDA build) and a GPU is present.
  static bool available();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// While alive, this thread's current CUDA stream is the one CapturedStep warms up and captures
/// on (one per device). Wrap the model in DDP (train::prepare_model) inside one when its step will
/// be captured: DDP keeps the gradient accumulators it finds at set-up, whose stream must be the
/// capture's (the legacy default stream cannot join a capture). No-op without CUDA.
class CaptureStreamScope {
 public:
  CaptureStreamScope();
  ~CaptureStreamScope();
  CaptureStreamScope(const CaptureStreamScope&) = delete;
  CaptureStreamScope& operator=(const CaptureStreamScope&) = delete;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace cohort::train

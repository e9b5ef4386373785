#include "cohort/train/captured_step.h"

#include <iostream>
#include <map>
#include <mutex>
#include <optional>

#include "cohort/comm/process_group.h"
#include "cohort/error.h"
#include "cohort/optim/flat_optimizer.h"
#include "cohort/trace.h"
#include "train/worker_session.h"

#ifdef COHORT_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace cohort::train {

#ifdef COHORT_WITH_CUDA
namespace {
// The stream captures run on, one per device for the process: CaptureStreamScope sets it up
// for DDP, CapturedStep warms up and captures on it.
c10::cuda::CUDAStream capture_stream(c10::DeviceIndex device) {
  static std::mutex mutex;
  static std::map<c10::DeviceIndex, c10::cuda::CUDAStream> streams;
  std::lock_guard lock(mutex);
  auto it = streams.find(device);
  if (it == streams.end())
    it = streams.emplace(device, c10::cuda::getStreamFromPool(false, device)).first;
  return it->second;
}
}  // namespace
#endif

struct CapturedStep::Impl {
  StepFunction step;
  CaptureOptions options;
  std::vector<at::Tensor> static_inputs;  // the captured step reads these
  at::Tensor static_output;
  std::string fallback_reason;
  bool tried = false;  // the capture was tried (it succeeded, or the fallback holds)
  std::vector<int64_t> counts_before_capture;  // the optimizer's host step counts
  // In a train loop: the train::step_optimizer() calls the captured step made (its host side,
  // which a replay skips: the session's step count and the timeline's step ends).
  int64_t session_steps_before_capture = 0;
  int64_t session_steps_per_step = 0;
  int64_t calls = 0, replays = 0, eager = 0;
#ifdef COHORT_WITH_CUDA
  std::unique_ptr<at::cuda::CUDAGraph> graph;
#endif

  void log(const std::string& line) const {
    if (options.log) {
      options.log(line);
    } else if (!options.group || options.group->rank() == 0) {
      std::cerr << line << std::endl;
    }
  }

  at::Tensor run_eagerly(const std::vector<at::Tensor>& inputs) {
    ++eager;
    return step(inputs);
  }

  bool same_shapes(const std::vector<at::Tensor>& inputs) const {
    if (inputs.size() != static_inputs.size()) return false;
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (inputs[i].sizes() != static_inputs[i].sizes() ||
          inputs[i].scalar_type() != static_inputs[i].scalar_type() ||
          inputs[i].device() != static_inputs[i].device())
        return false;
    }
    return true;
  }

  // Whether every rank of the group can go on with a graph, given whether this one can.
  bool ranks_agree(bool ok, const at::Tensor& like) const {
    if (!options.group) return ok;
    std::vector<at::Tensor> failures{
        at::full({1}, ok ? 0.0 : 1.0, like.options().dtype(at::kFloat))};
    options.group->allreduce(failures);
    return failures[0].item<double>() == 0;
  }

#ifdef COHORT_WITH_CUDA
  // Runs `fn` on the side stream, ordered after the current stream's work and before its next.
  template <typename Fn>
  void on_side_stream(const c10::Device& device, Fn&& fn) {
    const auto current = c10::cuda::getCurrentCUDAStream(device.index());
    const auto side = capture_stream(device.index());
    if (current == side) {
      fn();
      return;
    }
    at::cuda::CUDAEvent ready;
    ready.record(current);
    ready.block(side);
    {
      c10::cuda::CUDAStreamGuard guard(side);
      fn();
    }
    at::cuda::CUDAEvent done;
    done.record(side);
    done.block(current);
  }

  // Captures the step on the static inputs; the reason when it cannot be.
  std::string capture() {
    // CUDA tensors go over NCCL unless the group is Gloo's (or this libtorch has no NCCL).
    if (options.group &&
        (options.group->backend() == comm::Backend::kGloo || !comm::nccl_available())) {
      return "the step's collectives run over gloo, which a CUDA graph cannot hold: create the "
             "process group with the nccl backend (cohort train: --backend auto or nccl)";
    }
    if (options.optimizer && options.optimizer->offloaded_to_host()) {
      return "the optimizer updates in host memory (--offload-optimizer cpu or disk:PATH), which "
             "a CUDA graph cannot hold: keep the state on the GPU to capture the step";
    }
    if (options.optimizer) counts_before_capture = options.optimizer->host_step_counts();
    auto* session = current_session();
    if (session) session_steps_before_capture = session->steps_through_step_optimizer;
    std::string reason;
    graph = std::make_unique<at::cuda::CUDAGraph>();
    on_side_stream(static_inputs.front().device(), [&] {
      try {
        // Thread-local: the capture restricts this thread only, not others that allocate or
        // copy meanwhile (a data loader's prefetch thread pinning host memory).
        graph->capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
        try {
          static_output = step(static_inputs);
        } catch (const std::exception& e) {
          reason = e.what();
        }
        graph->capture_end();
      } catch (const std::exception& e) {
        if (reason.empty()) reason = e.what();
      }
      // A capture ended by an error leaves the error behind; the next call must not see it.
      (void)cudaGetLastError();
    });
    if (reason.empty() && options.optimizer && !options.optimizer->replays_exactly()) {
      reason =
          "the optimizer's step did not run on libtorch's fused CUDA kernels (a parameter "
          "without a gradient, or libtorch < 2.4), whose step count and learning rate live on the "
          "device: a replay would repeat the captured ones";
    }
    if (session) {
      session_steps_per_step = session->steps_through_step_optimizer - session_steps_before_capture;
    }
    if (!reason.empty()) {
      undo_capture();
      // The first line of the error says what was refused; the rest is libtorch's backtrace.
      if (const auto newline = reason.find('\n'); newline != std::string::npos)
        reason.resize(newline);
    }
    return reason;
  }

  // A capture that will not be replayed: its host side ran, its device side never will.
  void undo_capture() {
    graph.reset();
    static_output = at::Tensor();
    if (options.optimizer) options.optimizer->restore_host_step_counts(counts_before_capture);
    if (auto* session = current_session())
      session->steps_through_step_optimizer = session_steps_before_capture;
    session_steps_per_step = 0;
  }

  // What a replay skips of the step's host side, in a train loop.
  void count_replayed_step() {
    auto* session = current_session();
    if (!session) return;
    session->steps_through_step_optimizer += session_steps_per_step;
    for (int64_t i = 0; i < session_steps_per_step; ++i) trace::end_step();
  }
#endif
};

CapturedStep::CapturedStep(StepFunction step, CaptureOptions options)
    : impl_(std::make_unique<Impl>()) {
  if (!step) throw UsageError("CapturedStep: the step function is empty");
  if (options.warmup_steps < 1)
    throw UsageError("CapturedStep: warmup_steps " + std::to_string(options.warmup_steps) +
                     " must be >= 1 (the first step differs from the others: state is "
                     "allocated, SGD's momentum starts)");
  impl_->step = std::move(step);
  impl_->options = std::move(options);
}

CapturedStep::~CapturedStep() = default;

bool CapturedStep::available() {
#ifdef COHORT_WITH_CUDA
  return torch::cuda::is_available();
#else
  return false;
#endif
}

torch::Tensor CapturedStep::run(const std::vector<torch::Tensor>& inputs) {
  auto& s = *impl_;
  if (inputs.empty()) throw UsageError("CapturedStep::run: no inputs given");
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].is_cuda()) {
      throw UsageError("CapturedStep::run: input " + std::to_string(i) + " is on " +
                       inputs[i].device().str() +
                       "; CUDA graphs capture GPU work only: move the batch to the GPU, or "
                       "train without a captured step (drop --cuda-graph)");
    }
  }
  ++s.calls;
#ifdef COHORT_WITH_CUDA
  if (!s.tried) {
    if (s.static_inputs.empty()) {
      for (const auto& t : inputs) s.static_inputs.push_back(t.clone());
    }
    // Past the warm-up the ranks capture together, on inputs of the captured shapes (a rank's
    // partial batch puts every rank's capture off by a step).
    if (s.calls <= s.options.warmup_steps ||
        !s.ranks_agree(s.same_shapes(inputs), inputs.front())) {
      at::Tensor out;
      s.on_side_stream(inputs.front().device(), [&] { out = s.run_eagerly(inputs); });
      return out;
    }
    for (size_t i = 0; i < inputs.size(); ++i) s.static_inputs[i].copy_(inputs[i]);
    std::string reason = s.capture();
    s.tried = true;
    if (!s.ranks_agree(reason.empty(), inputs.front())) {
      if (reason.empty()) {
        reason = "another rank could not capture its step";
        s.undo_capture();
      }
    }
    if (!reason.empty()) {
      s.fallback_reason = reason;
      s.log("cuda graph: the training step runs eagerly: " + reason);
      return s.run_eagerly(inputs);
    }
    // The capture recorded this call's step without running it: the first replay runs it.
    ++s.replays;
    s.graph->replay();
    return s.static_output;
  }
  if (s.graph && s.same_shapes(inputs)) {
    for (size_t i = 0; i < inputs.size(); ++i) s.static_inputs[i].copy_(inputs[i], true);
    if (s.options.optimizer) s.options.optimizer->before_replay();
    ++s.replays;
    s.graph->replay();
    s.count_replayed_step();
    return s.static_output;
  }
#endif
  return s.run_eagerly(inputs);
}

bool CapturedStep::captured() const {
#ifdef COHORT_WITH_CUDA
  return impl_->graph != nullptr;
#else
  return false;
#endif
}

const std::string& CapturedStep::fallback_reason() const { return impl_->fallback_reason; }
int64_t CapturedStep::replays() const { return impl_->replays; }
int64_t CapturedStep::eager_steps() const { return impl_->eager; }

struct CaptureStreamScope::Impl {
#ifdef COHORT_WITH_CUDA
  std::optional<c10::cuda::CUDAStream> previous;
#endif
};

CaptureStreamScope::CaptureStreamScope() : impl_(std::make_unique<Impl>()) {
#ifdef COHORT_WITH_CUDA
  if (!torch::cuda::is_available()) return;
  const auto current = c10::cuda::getCurrentCUDAStream();
  const auto side = capture_stream(current.device_index());
  if (current == side) return;
  // The work queued so far comes first.
  at::cuda::CUDAEvent ready;
  ready.record(current);
  ready.block(side);
  impl_->previous = current;
  c10::cuda::setCurrentCUDAStream(side);
#endif
}

CaptureStreamScope::~CaptureStreamScope() {
#ifdef COHORT_WITH_CUDA
  if (!impl_->previous) return;
  const auto side = c10::cuda::getCurrentCUDAStream(impl_->previous->device_index());
  at::cuda::CUDAEvent done;
  done.record(side);
  done.block(*impl_->previous);
  c10::cuda::setCurrentCUDAStream(*impl_->previous);
#endif
}

}  // namespace cohort::train

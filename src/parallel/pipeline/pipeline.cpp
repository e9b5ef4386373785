#include "cohort/parallel/pipeline/pipeline.h"

#include <ATen/autocast_mode.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>

#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <set>

#include "cohort/error.h"
#include "cohort/parallel/local_sgd.h"
#include "cohort/trace.h"

namespace cohort::parallel::pipeline {
namespace {

std::string shape_text(at::IntArrayRef sizes, at::ScalarType dtype) {
  std::string out = "[";
  for (size_t i = 0; i < sizes.size(); ++i) out += (i ? ", " : "") + std::to_string(sizes[i]);
  return out + "] " + c10::toString(dtype);
}

// The activation entering a stage, as the first step's probe found it: every dim but the batch
// (dim 0), and the dtype.
struct Activation {
  std::vector<int64_t> tail;
  at::ScalarType dtype = at::kFloat;
};

// What a stage's output looks like, sent ahead of the first step: [failed, dtype, ndim, dims...].
constexpr int kMetaLength = 16;
constexpr int kMaxDims = kMetaLength - 3;
constexpr int kMessageBytes = 1024;

double seconds_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// One (stage, micro-batch) between its forward and its backward.
struct Slot {
  at::Tensor input;        // requires grad for stages after the first
  at::Tensor root;         // the stage's output, or the weighted loss on the last stage
  at::Tensor grad_output;  // the gradient of the output (none on the last stage)
  at::Tensor input_grad;   // the gradient of the input, once the (input) backward ran
};

// Frees a (stage, micro-batch) once its backward is done; only the input's gradient may still
// wait for its send.
void release(Slot& slot) {
  const at::Tensor keep = slot.input_grad;
  slot = Slot{};
  slot.input_grad = keep;
}

}  // namespace

struct Pipeline::State {
  std::vector<Stage> stages;
  comm::ProcessGroup group;
  LossFunction loss;
  PipelineOptions options;
  Program program;
  int rank = 0;
  int num_stages = 1;
  std::vector<int> indices;  // this rank's global stage indices
  // Per local stage: the parameters its weight backward accumulates into.
  std::vector<std::vector<at::Tensor>> trainable;
  std::vector<Activation> inputs_by_stage;
  bool probed = false;
  // Per local stage, per micro-batch.
  std::vector<std::vector<Slot>> slots;
  std::vector<std::pair<comm::Work, at::Tensor>> sends;
  std::vector<TimedAction> timeline;
  // Data parallelism: one DDP engine per local stage, and the position in this rank's action list
  // of each stage's last gradient-producing action, the one that synchronises.
  std::vector<std::unique_ptr<DistributedDataParallel>> data_parallel;
  std::vector<size_t> last_gradient_action;
  // ZeRO instead (PipelineOptions::zero): one engine for all of this rank's stages, made by
  // prepare_optimizer(); it synchronises in the rank's last gradient-producing action.
  ZeroOptimizer* zero = nullptr;
  size_t last_gradient_action_of_rank = 0;
  // Local SGD or DiLoCo instead (PipelineOptions::sync): made by prepare_optimizer(); it averages
  // the stages in its own step.
  LocalSgdOptimizer* local_sgd = nullptr;
  std::shared_ptr<torch::nn::Module> stages_module;  // module(), made once

  int local(int stage) const { return stage / program.layout.ranks; }
  bool remote(int stage) const { return program.layout.rank_of(stage) != rank; }
  int tag(int stage, int mb, int kind) const { return (mb * num_stages + stage) * 2 + kind; }
  int probe_tag(int stage) const { return 2 * num_stages * program.micro_batches + stage; }
  int tied_tag(size_t tied) const { return probe_tag(num_stages) + static_cast<int>(tied); }
  c10::Device device_of(int stage) const {
    for (const auto& p : stages[local(stage)].module().parameters()) return p.device();
    return c10::Device(c10::kCPU);
  }
  std::string where(const Action& a) const {
    return "pipeline rank " + std::to_string(rank) + ", " + to_string(a);
  }

  void probe(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets);
  void run(const Action& a, const std::vector<at::Tensor>& inputs,
           const std::vector<at::Tensor>& targets, const std::vector<double>& weights,
           at::Tensor& loss_sum);
  void backward_input(int stage, Slot& slot, bool whole);
  void backward_weight(int stage, Slot& slot);
  void hand_over_gradient(int stage, int mb, Slot& slot);
  void sum_tied_gradients();
  // Per tied parameter: what the group's activity says while its copies' gradients are summed.
  std::vector<std::string> tied_activities;
};

namespace {

// The stages in eval mode while it lives, then back in the mode each had: a forward inside draws
// nothing from the random generators (dropout) and leaves BatchNorm's running statistics alone.
class EvalModeScope {
 public:
  explicit EvalModeScope(const std::vector<Stage>& stages) {
    for (const auto& stage : stages) {
      training_.push_back(stage.module().is_training());
      stage.module().eval();
    }
    stages_ = &stages;
  }
  ~EvalModeScope() {
    for (size_t i = 0; i < training_.size(); ++i) (*stages_)[i].module().train(training_[i]);
  }
  EvalModeScope(const EvalModeScope&) = delete;
  EvalModeScope& operator=(const EvalModeScope&) = delete;

 private:
  const std::vector<Stage>* stages_ = nullptr;
  std::vector<bool> training_;
};

}  // namespace

// The first step: a no-grad forward of micro-batch 0 stage by stage, each stage's output shape
// sent to the next stage's rank, which tries it; every rank's verdict is gathered so that a
// mismatch is the same error everywhere. In eval mode: the probe leaves no trace in the
// training (a run resumed from a checkpoint probes again, and draws and trains as the
// uninterrupted run does).
void Pipeline::State::probe(const std::vector<at::Tensor>& inputs,
                            const std::vector<at::Tensor>& targets) {
  torch::NoGradGuard no_grad;
  EvalModeScope eval_mode(stages);
  const int last = num_stages - 1;
  const int64_t rows = inputs.at(0).size(0);
  std::string error;
  at::Tensor carried;  // the output of the previous stage when it is on this rank
  inputs_by_stage.assign(static_cast<size_t>(num_stages), {});
  for (int s : indices) {
    at::Tensor x;
    bool upstream_failed = false;
    if (s == 0) {
      x = inputs.at(0).to(device_of(s));
    } else if (!remote(s - 1)) {
      upstream_failed = !carried.defined();
      x = carried;
    } else {
      at::Tensor meta = at::zeros({kMetaLength}, at::kLong);
      group.set_activity("pipeline stage " + std::to_string(s) + ": receiving the shape of stage " +
                         std::to_string(s - 1) + "'s output");
      group.recv(meta, program.layout.rank_of(s - 1), probe_tag(s));
      const int64_t* m = meta.data_ptr<int64_t>();
      upstream_failed = m[0] != 0;
      if (!upstream_failed) {
        std::vector<int64_t> sizes(m + 3, m + 3 + m[2]);
        x = at::zeros(sizes,
                      at::TensorOptions(static_cast<at::ScalarType>(m[1])).device(device_of(s)));
      }
    }
    at::Tensor out;
    if (!upstream_failed && error.empty()) {
      if (s > 0) {
        inputs_by_stage[s] = {{x.sizes().begin() + 1, x.sizes().end()}, x.scalar_type()};
      }
      try {
        out = stages[local(s)].forward(x);
        if (!out.defined() || out.dim() == 0 || out.size(0) != rows) {
          error = "stage " + std::to_string(s) + " (rank " + std::to_string(rank) + ") returned " +
                  (out.defined() ? shape_text(out.sizes(), out.scalar_type())
                                 : std::string("no tensor")) +
                  " for a micro-batch of " + std::to_string(rows) +
                  " rows: a pipeline stage must keep the batch in dim 0";
          out = at::Tensor();
        } else if (s == last) {
          loss(out, targets.at(0).to(out.device()));
        } else if (out.dim() > kMaxDims) {
          error = "stage " + std::to_string(s) + " returned " + std::to_string(out.dim()) +
                  " dims; a pipeline passes at most " + std::to_string(kMaxDims);
          out = at::Tensor();
        }
      } catch (const std::exception& e) {
        const std::string what = e.what();
        const std::string first_line = what.substr(0, what.find('\n'));
        if (s == last && out.defined()) {
          error = "the loss cannot take the last stage's (stage " + std::to_string(s) + ", rank " +
                  std::to_string(rank) + ") output " + shape_text(out.sizes(), out.scalar_type()) +
                  " with targets " +
                  shape_text(targets.at(0).sizes(), targets.at(0).scalar_type()) + ": " +
                  first_line;
        } else if (s == 0) {
          error = "stage 0 (rank " + std::to_string(rank) + ") cannot take the input " +
                  shape_text(x.sizes(), x.scalar_type()) + ": " + first_line;
        } else {
          error = "stage " + std::to_string(s) + " (rank " + std::to_string(rank) +
                  ") cannot take stage " + std::to_string(s - 1) + "'s output " +
                  shape_text(x.sizes(), x.scalar_type()) + ": " + first_line + ": make stage " +
                  std::to_string(s - 1) + "'s output match stage " + std::to_string(s) +
                  "'s input, or cut the model elsewhere";
        }
        out = at::Tensor();
      }
    }
    if (s < last && remote(s + 1)) {
      at::Tensor meta = at::zeros({kMetaLength}, at::kLong);
      int64_t* m = meta.data_ptr<int64_t>();
      m[0] = out.defined() ? 0 : 1;
      if (out.defined()) {
        m[1] = static_cast<int64_t>(out.scalar_type());
        m[2] = out.dim();
        for (int64_t d = 0; d < out.dim(); ++d) m[3 + d] = out.size(d);
      }
      group.send(meta, program.layout.rank_of(s + 1), probe_tag(s + 1));
    }
    carried = out;
  }
  // Every rank's verdict: the first error, on every rank.
  group.set_activity("pipeline: comparing the stages' shapes");
  at::Tensor message = at::zeros({kMessageBytes}, at::kByte);
  std::memcpy(message.data_ptr(), error.data(),
              std::min(error.size(), static_cast<size_t>(kMessageBytes - 1)));
  const std::vector<at::Tensor> all = group.allgather(message);
  group.set_activity("");
  for (const at::Tensor& m : all) {
    const char* text = static_cast<const char*>(m.data_ptr());
    if (text[0] != '\0') throw UsageError(std::string(text, strnlen(text, kMessageBytes)));
  }
  // Under the caller's autocast the no-grad forward left bf16/fp16 casts of the weights in
  // autocast's cache, made without autograd history: the step's forward would use them, and the
  // first step of every process would compute no gradient for those weights.
  at::autocast::clear_cache();
  probed = true;
}

void Pipeline::State::backward_input(int stage, Slot& slot, bool whole) {
  const bool last = stage == num_stages - 1;
  std::vector<at::Tensor> grad_outputs;
  if (!last) grad_outputs.push_back(slot.grad_output);
  if (whole) {
    torch::autograd::backward({slot.root}, grad_outputs);
    if (stage > 0) slot.input_grad = slot.input.grad();
    return;
  }
  // Only the input's gradient; the graph stays for the weight backward.
  if (stage == 0) return;
  slot.input_grad = torch::autograd::grad({slot.root}, {slot.input}, grad_outputs,
                                          /*retain_graph=*/true)[0];
}

void Pipeline::State::backward_weight(int stage, Slot& slot) {
  const std::vector<at::Tensor>& params = trainable[local(stage)];
  if (params.empty()) return;
  std::vector<at::Tensor> grad_outputs;
  if (stage != num_stages - 1) grad_outputs.push_back(slot.grad_output);
  // Into .grad through the parameters' gradient accumulators, whose hooks data parallelism
  // listens to.
  torch::autograd::backward({slot.root}, grad_outputs, /*retain_graph=*/false,
                            /*create_graph=*/false, params);
}

// After the (input) backward: the input's gradient goes to the previous stage, on this rank
// directly.
void Pipeline::State::hand_over_gradient(int stage, int mb, Slot& slot) {
  if (stage > 0 && !remote(stage - 1)) {
    slots[local(stage - 1)][mb].grad_output = slot.input_grad;
    slot.input_grad = at::Tensor();
  }
}

// Each tied parameter's gradient (PipelineOptions::tied_parameters) becomes the sum of its
// copies': this rank's sent to the other holders, theirs received, and added in rank order, the
// same order on every holder, so that every copy's gradient is the same, bit for bit.
void Pipeline::State::sum_tied_gradients() {
  const auto& tied = options.tied_parameters;
  for (size_t i = 0; i < tied.size(); ++i) {
    const TiedParameter& t = tied[i];
    // With ZeRO, this rank's piece of the reduced gradient: the copies' engines give each tied
    // parameter a bucket of its own, so their pieces for this dp rank are the same elements.
    at::Tensor grad;
    if (zero != nullptr) {
      grad = zero->shard_gradient(t.parameter);
    } else {
      at::Tensor parameter = t.parameter;
      if (!parameter.grad().defined()) parameter.mutable_grad() = at::zeros_like(parameter);
      grad = parameter.mutable_grad();
    }
    group.set_activity(tied_activities[i]);
    const at::Tensor own = grad.contiguous().clone();
    std::vector<comm::Work> sends_of_this;
    std::vector<at::Tensor> copies;
    for (int r : t.ranks) {
      if (r == rank) {
        copies.push_back(own);
        continue;
      }
      sends_of_this.push_back(group.send_async(own, r, tied_tag(i)));
      at::Tensor theirs = at::empty_like(own);
      group.recv(theirs, r, tied_tag(i));
      copies.push_back(theirs);
    }
    // Into the gradient itself: `own`, which the sends read, is a copy.
    grad.copy_(copies[0]);
    for (size_t k = 1; k < copies.size(); ++k) grad.add_(copies[k]);
    for (auto& work : sends_of_this) work.wait();
  }
}

void Pipeline::State::run(const Action& a, const std::vector<at::Tensor>& inputs,
                          const std::vector<at::Tensor>& targets,
                          const std::vector<double>& weights, at::Tensor& loss_sum) {
  const int s = a.stage, mb = a.micro_batch, last = num_stages - 1;
  switch (a.type) {
    case ActionType::kRecvActivation: {
      const Activation& act = inputs_by_stage[s];
      std::vector<int64_t> sizes{inputs[mb].size(0)};
      sizes.insert(sizes.end(), act.tail.begin(), act.tail.end());
      at::Tensor buffer = at::empty(sizes, at::TensorOptions(act.dtype).device(device_of(s)));
      group.recv(buffer, program.layout.rank_of(s - 1), tag(s, mb, 0));
      slots[local(s)][mb].input = buffer.requires_grad_(true);
      return;
    }
    case ActionType::kForward: {
      Slot& slot = slots[local(s)][mb];
      if (s == 0) slot.input = inputs[mb].to(device_of(s));
      at::Tensor out = stages[local(s)].forward(slot.input);
      if (s == last) {
        at::Tensor l = loss(out, targets[mb].to(out.device())) * weights[mb];
        loss_sum = loss_sum.defined() ? loss_sum + l.detach() : l.detach();
        slot.root = l;
      } else {
        slot.root = out;
        if (!remote(s + 1)) {
          slots[local(s + 1)][mb].input = out.detach().requires_grad_(true);
        }
      }
      return;
    }
    case ActionType::kSendActivation: {
      at::Tensor out = slots[local(s)][mb].root.detach();
      sends.emplace_back(group.send_async(out, program.layout.rank_of(s + 1), tag(s + 1, mb, 0)),
                         out);
      return;
    }
    case ActionType::kRecvGradient: {
      Slot& slot = slots[local(s)][mb];
      at::Tensor buffer = at::empty_like(slot.root, at::MemoryFormat::Contiguous);
      group.recv(buffer, program.layout.rank_of(s + 1), tag(s, mb, 1));
      slot.grad_output = buffer;
      return;
    }
    case ActionType::kBackward:
    case ActionType::kBackwardInput: {
      Slot& slot = slots[local(s)][mb];
      const bool whole = a.type == ActionType::kBackward;
      backward_input(s, slot, whole);
      hand_over_gradient(s, mb, slot);
      if (whole) release(slot);
      return;
    }
    case ActionType::kBackwardWeight: {
      Slot& slot = slots[local(s)][mb];
      backward_weight(s, slot);
      release(slot);
      return;
    }
    case ActionType::kSendGradient: {
      Slot& slot = slots[local(s)][mb];
      sends.emplace_back(
          group.send_async(slot.input_grad, program.layout.rank_of(s - 1), tag(s - 1, mb, 1)),
          slot.input_grad);
      slot.input_grad = at::Tensor();
      return;
    }
    case ActionType::kOptimizerStep: {
      for (auto& [work, tensor] : sends) work.wait();
      sends.clear();
      sum_tied_gradients();
      if (options.optimizer_step) options.optimizer_step();
      return;
    }
  }
}

Pipeline::Pipeline(std::vector<Stage> stages, comm::ProcessGroup group, LossFunction loss,
                   PipelineOptions options)
    : state_(std::make_unique<State>()) {
  State& st = *state_;
  if (!group.valid()) throw UsageError("Pipeline: the pipeline process group is empty");
  if (!loss) throw UsageError("Pipeline: no loss function given");
  st.program = compile_schedule(
      {.kind = options.schedule,
       .layout = {.ranks = group.world_size(), .virtual_stages = options.virtual_stages},
       .micro_batches = options.micro_batches});
  if (static_cast<int>(stages.size()) != options.virtual_stages) {
    throw UsageError("Pipeline on rank " + std::to_string(group.rank()) + ": " +
                     std::to_string(stages.size()) + " stage modules given for " +
                     std::to_string(options.virtual_stages) +
                     " virtual stages per rank: give one module per stage this rank holds");
  }
  st.stages = std::move(stages);
  st.group = std::move(group);
  st.loss = std::move(loss);
  st.options = std::move(options);
  st.rank = st.group.rank();
  st.num_stages = st.program.layout.stages();
  st.indices = st.program.layout.stages_of(st.rank);
  for (const Stage& stage : st.stages) {
    auto& params = st.trainable.emplace_back();
    for (const auto& p : stage.module().parameters())
      if (p.requires_grad()) params.push_back(p);
  }
  st.slots.assign(st.stages.size(),
                  std::vector<Slot>(static_cast<size_t>(st.program.micro_batches)));
  comm::ProcessGroup& dp = st.options.data_parallel_group;
  const auto& actions = st.program.ranks[st.rank];
  st.last_gradient_action.assign(st.stages.size(), 0);
  for (size_t i = 0; i < actions.size(); ++i) {
    const ActionType type = actions[i].type;
    if (type == ActionType::kBackward || type == ActionType::kBackwardWeight) {
      st.last_gradient_action[st.local(actions[i].stage)] = i;
      st.last_gradient_action_of_rank = i;
    }
  }
  validate(st.options.sync);
  const bool synchronous = is_synchronous(st.options.sync);
  if (std::holds_alternative<AsyncParameterServer>(st.options.sync)) {
    throw UsageError("Pipeline: the asynchronous parameter server (sync " +
                     to_string(st.options.sync) +
                     ") serves whole models, not a pipeline's stages: use DDP, local SGD or "
                     "DiLoCo over the data-parallel group");
  }
  if (const auto conflict = zero_conflict(st.options.sync, st.options.zero.stage)) {
    throw UsageError("Pipeline: sync " + *conflict + "; use ZeRO stage 0 or synchronous DDP");
  }
  if (!synchronous && !dp.valid()) {
    throw UsageError("Pipeline: sync " + to_string(st.options.sync) +
                     " needs the data-parallel group whose replicas it averages (PipelineOptions::"
                     "data_parallel_group, e.g. a DeviceMesh's dp())");
  }
  const int ranks = st.group.world_size();
  for (const TiedParameter& t : st.options.tied_parameters) {
    const bool here = std::find(t.ranks.begin(), t.ranks.end(), st.rank) != t.ranks.end();
    const bool in_range =
        std::all_of(t.ranks.begin(), t.ranks.end(), [&](int r) { return r >= 0 && r < ranks; });
    if (!t.parameter.defined() || t.ranks.size() < 2 || !here || !in_range ||
        !std::is_sorted(t.ranks.begin(), t.ranks.end())) {
      throw UsageError("Pipeline on rank " + std::to_string(st.rank) + ": tied parameter '" +
                       t.name + "' needs this rank's copy and the ascending pipeline ranks (of " +
                       std::to_string(ranks) +
                       ") that hold one, this rank among two or more: take them from "
                       "find_tied_parameters()");
    }
    std::string holders;
    for (int r : t.ranks) holders += (holders.empty() ? "" : ", ") + std::to_string(r);
    st.tied_activities.push_back("pipeline rank " + std::to_string(st.rank) +
                                 ": summing the gradient of " + t.name +
                                 " with its copies on pipeline ranks " + holders);
  }
  if (st.options.zero.stage != 0) {
    st.options.zero.validate();
    if (!dp.valid()) {
      throw UsageError("Pipeline: ZeRO stage " + std::to_string(st.options.zero.stage) +
                       " needs the data-parallel group it shards over (PipelineOptions::"
                       "data_parallel_group, e.g. a DeviceMesh's dp())");
    }
  } else if (synchronous && dp.valid() && dp.world_size() > 1) {
    for (const Stage& stage : st.stages) {
      st.data_parallel.push_back(
          std::make_unique<DistributedDataParallel>(stage.ptr(), dp, st.options.data_parallel));
    }
  }
}

Pipeline::~Pipeline() = default;
Pipeline::Pipeline(Pipeline&&) noexcept = default;
Pipeline& Pipeline::operator=(Pipeline&&) noexcept = default;

at::Tensor Pipeline::step(const at::Tensor& inputs, const at::Tensor& targets) {
  State& st = *state_;
  const int m = st.program.micro_batches;
  if (!inputs.defined() || inputs.dim() == 0)
    throw UsageError("Pipeline::step: inputs must be a tensor with the batch in dim 0");
  if (!targets.defined() || targets.dim() == 0 || targets.size(0) != inputs.size(0)) {
    throw UsageError("Pipeline::step: targets must have the inputs' " +
                     std::to_string(inputs.size(0)) + " rows in dim 0");
  }
  const int64_t rows = inputs.size(0);
  if (rows < m) {
    throw UsageError("Pipeline::step: a batch of " + std::to_string(rows) +
                     " rows cannot be split into " + std::to_string(m) +
                     " micro-batches: use batches of at least " + std::to_string(m) +
                     " rows or fewer micro-batches");
  }
  const std::vector<at::Tensor> in = inputs.tensor_split(m);
  const std::vector<at::Tensor> tgt = targets.tensor_split(m);
  std::vector<double> weights;
  for (const auto& t : in) weights.push_back(static_cast<double>(t.size(0)) / rows);
  if (st.options.zero.stage != 0 && st.zero == nullptr) {
    throw UsageError("Pipeline::step: ZeRO stage " + std::to_string(st.options.zero.stage) +
                     " has no engine yet: pass the optimizer through "
                     "Pipeline::prepare_optimizer() before the first step");
  }
  if (!is_synchronous(st.options.sync) && st.local_sgd == nullptr) {
    throw UsageError("Pipeline::step: sync " + to_string(st.options.sync) +
                     " has no engine yet: pass the optimizer through "
                     "Pipeline::prepare_optimizer() before the first step (without it the "
                     "replicas would never be averaged)");
  }
  if (!st.probed) st.probe(in, tgt);
  at::Tensor loss_sum;
  st.timeline.clear();
  // ZeRO-3's prefetching follows the order of the whole step's units (the schedule's), not of
  // the forwards since the last backward, which changes with the schedule's phase.
  std::optional<ZeroOptimizer::StepOrderScope> unit_order;
  if (st.zero != nullptr) unit_order.emplace(*st.zero);
  const auto& actions = st.program.ranks[st.rank];
  for (size_t i = 0; i < actions.size(); ++i) {
    const Action& a = actions[i];
    st.group.set_activity(st.where(a));
    try {
      const double start = st.options.record_timeline ? seconds_now() : 0.0;
      // A stage's gradients are averaged over the data-parallel group once, in its last backward.
      // With ZeRO, once per rank: in its last.
      const bool gradients =
          a.type == ActionType::kBackward || a.type == ActionType::kBackwardWeight;
      std::optional<DistributedDataParallel::NoSyncGuard> accumulate;
      if (!st.data_parallel.empty() && gradients &&
          i != st.last_gradient_action[st.local(a.stage)]) {
        accumulate.emplace(*st.data_parallel[st.local(a.stage)]);
      }
      std::optional<ZeroOptimizer::NoSyncGuard> accumulate_shards;
      if (st.zero != nullptr && gradients && i != st.last_gradient_action_of_rank)
        accumulate_shards.emplace(*st.zero);
      // Where the step's time goes (cohort/trace.h): the stages' forward and backward work;
      // the sends' and receives' waits count as communication where they wait.
      std::optional<trace::Span> phase;
      if (a.type == ActionType::kForward) phase.emplace(trace::Phase::kForward);
      if (gradients || a.type == ActionType::kBackwardInput) phase.emplace(trace::Phase::kBackward);
      st.run(a, in, tgt, weights, loss_sum);
      if (st.options.record_timeline)
        st.timeline.push_back({a, start, seconds_now(), heap_bytes_in_use()});
    } catch (const c10::Error& e) {
      st.group.set_activity("");
      throw RuntimeError(st.where(a) + ": " + e.what_without_backtrace());
    } catch (...) {
      st.group.set_activity("");
      throw;
    }
  }
  st.group.set_activity("");
  if (unit_order) unit_order->close();
  return loss_sum;
}

const std::vector<TimedAction>& Pipeline::timeline() const { return state_->timeline; }

int64_t heap_bytes_in_use() {
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
  const struct mallinfo2 info = ::mallinfo2();
  return static_cast<int64_t>(info.uordblks + info.hblkhd);
#else
  return -1;
#endif
}

double measured_bubble(const std::vector<std::vector<TimedAction>>& timelines) {
  double first = std::numeric_limits<double>::infinity(), last = -first, busy = 0.0;
  for (const auto& rank : timelines) {
    for (const TimedAction& t : rank) {
      first = std::min(first, t.start);
      last = std::max(last, t.end);
      const ActionType type = t.action.type;
      if (type == ActionType::kForward || type == ActionType::kBackward ||
          type == ActionType::kBackwardInput || type == ActionType::kBackwardWeight) {
        busy += t.end - t.start;
      }
    }
  }
  if (timelines.empty() || !(last > first)) return 0.0;
  return 1.0 - busy / (static_cast<double>(timelines.size()) * (last - first));
}

std::unique_ptr<torch::optim::Optimizer> Pipeline::prepare_optimizer(
    std::unique_ptr<torch::optim::Optimizer> optimizer) {
  State& st = *state_;
  if (!optimizer) throw UsageError("Pipeline::prepare_optimizer: the optimizer is null");
  const bool synchronous = is_synchronous(st.options.sync);
  if (st.options.zero.stage == 0 && synchronous) return optimizer;
  if (st.zero != nullptr || st.local_sgd != nullptr) {
    throw UsageError(
        "Pipeline::prepare_optimizer: called twice; the pipeline's data-parallel engine exists "
        "already: keep the optimizer the first call returned");
  }
  if (!synchronous) {
    auto local = std::make_unique<LocalSgdOptimizer>(
        module(), std::move(optimizer), st.options.data_parallel_group, st.options.sync);
    st.local_sgd = local.get();
    return local;
  }
  std::vector<at::Tensor> tied;
  for (const TiedParameter& t : st.options.tied_parameters) tied.push_back(t.parameter);
  auto zero = std::make_unique<ZeroOptimizer>(module(), *optimizer, st.options.data_parallel_group,
                                              st.options.zero, tied);
  st.zero = zero.get();
  return zero;
}

std::shared_ptr<torch::nn::Module> Pipeline::module() const {
  State& st = *state_;
  if (st.stages.size() == 1) return st.stages[0].ptr();
  if (st.stages_module) return st.stages_module;
  // The stages' layers under their own names, where that names every parameter once.
  bool by_layer = true;
  std::set<std::string> names;
  for (const Stage& stage : st.stages) {
    const auto& m = stage.module();
    by_layer = by_layer && m.named_parameters(/*recurse=*/false).is_empty() &&
               m.named_buffers(/*recurse=*/false).is_empty();
    for (const auto& child : m.named_children())
      by_layer = by_layer && names.insert(child.key()).second;
  }
  auto all = std::make_shared<torch::nn::Module>("PipelineStages");
  for (size_t i = 0; i < st.stages.size(); ++i) {
    if (by_layer) {
      for (const auto& child : st.stages[i].module().named_children())
        all->register_module(child.key(), child.value());
    } else {
      all->register_module("stage" + std::to_string(st.indices[i]), st.stages[i].ptr());
    }
  }
  st.stages_module = all;
  return all;
}

std::vector<at::Tensor> Pipeline::parameters() const {
  std::vector<at::Tensor> out;
  for (const Stage& s : state_->stages)
    for (const auto& p : s.module().parameters()) out.push_back(p);
  return out;
}

const std::vector<TiedParameter>& Pipeline::tied_parameters() const {
  return state_->options.tied_parameters;
}

const std::vector<Stage>& Pipeline::stages() const { return state_->stages; }
std::vector<int> Pipeline::stage_indices() const { return state_->indices; }
const Program& Pipeline::program() const { return state_->program; }
bool Pipeline::is_first() const { return state_->rank == 0; }
bool Pipeline::is_last() const {
  return state_->program.layout.rank_of(state_->num_stages - 1) == state_->rank;
}

// ---------------------------------------------------------------------------------------------
// Cutting a Sequential

std::vector<torch::nn::Sequential> split_sequential(const torch::nn::Sequential& model,
                                                    const std::vector<int>& layers_per_stage) {
  const auto children = model->named_children();
  int total = 0;
  for (int n : layers_per_stage) {
    if (n < 1) {
      throw UsageError("split_sequential: every stage needs at least one layer, got a stage of " +
                       std::to_string(n));
    }
    total += n;
  }
  if (total != static_cast<int>(model->size())) {
    throw UsageError("split_sequential: the stages hold " + std::to_string(total) +
                     " layers but the model has " + std::to_string(model->size()));
  }
  std::vector<torch::nn::Sequential> stages;
  size_t next = 0;
  auto it = model->begin();
  for (int n : layers_per_stage) {
    torch::nn::Sequential stage;
    for (int i = 0; i < n; ++i, ++next, ++it) stage->push_back(children[next].key(), *it);
    stages.push_back(stage);
  }
  return stages;
}

std::vector<TiedParameter> find_tied_parameters(const std::vector<torch::nn::Sequential>& stages,
                                                const PipelineLayout& layout, int rank) {
  if (static_cast<int>(stages.size()) != layout.stages()) {
    throw UsageError("find_tied_parameters: " + std::to_string(stages.size()) +
                     " stages given for a layout of " + std::to_string(layout.stages()) +
                     ": give every stage of the pipeline");
  }
  // Per tensor, in the order the stages first name it: its first name and the stages that hold it.
  struct Holders {
    std::string name;
    at::Tensor parameter;
    std::vector<int> stages;
  };
  std::vector<Holders> seen;
  std::map<const c10::TensorImpl*, size_t> index;
  for (int s = 0; s < layout.stages(); ++s) {
    for (const auto& p : stages[static_cast<size_t>(s)]->named_parameters()) {
      if (!p.value().requires_grad()) continue;
      const auto [it, inserted] = index.emplace(p.value().unsafeGetTensorImpl(), seen.size());
      if (inserted) seen.push_back({p.key(), p.value(), {}});
      auto& holders = seen[it->second].stages;
      if (holders.empty() || holders.back() != s) holders.push_back(s);
    }
  }
  std::vector<TiedParameter> tied;
  for (const Holders& h : seen) {
    if (h.stages.size() < 2) continue;
    std::vector<int> ranks;
    for (size_t k = 0; k < h.stages.size(); ++k) {
      const int r = layout.rank_of(h.stages[k]);
      const auto earlier = std::find(ranks.begin(), ranks.end(), r);
      if (earlier != ranks.end()) {
        throw UsageError("parameter '" + h.name + "' is in two stages of pipeline rank " +
                         std::to_string(r) + " (stages " +
                         std::to_string(h.stages[static_cast<size_t>(earlier - ranks.begin())]) +
                         " and " + std::to_string(h.stages[k]) +
                         "), whose optimizer would step it twice: cut the model so that the "
                         "layers that share it are on different ranks");
      }
      ranks.push_back(r);
    }
    if (std::find(ranks.begin(), ranks.end(), rank) == ranks.end()) continue;
    std::sort(ranks.begin(), ranks.end());
    tied.push_back({h.name, h.parameter, std::move(ranks)});
  }
  return tied;
}

std::vector<int> even_split(int layers, int stages) {
  if (stages < 1) throw UsageError("pipeline stages must be >= 1, got " + std::to_string(stages));
  if (stages > layers) {
    throw UsageError("cannot cut " + std::to_string(layers) + " layers into " +
                     std::to_string(stages) + " pipeline stages: use at most " +
                     std::to_string(layers) + " stages");
  }
  std::vector<int> counts(static_cast<size_t>(stages), layers / stages);
  for (int i = 0; i < layers % stages; ++i) ++counts[i];
  return counts;
}

std::vector<int> balanced_split(torch::nn::Sequential model, int stages, const at::Tensor& sample,
                                int repeats) {
  const int n = static_cast<int>(model->size());
  even_split(n, stages);  // the same bad-input checks
  std::vector<std::vector<double>> runs(static_cast<size_t>(n));
  for (int r = 0; r < std::max(1, repeats); ++r) {
    at::Tensor x = sample;
    int i = 0;
    for (auto& layer : *model) {
      const at::Tensor in = x.detach().requires_grad_(x.is_floating_point());
      const auto start = std::chrono::steady_clock::now();
      at::Tensor y = layer.forward(in);
      if (y.requires_grad()) y.sum().backward();
      runs[i++].push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      x = y.detach();
    }
  }
  model->zero_grad();
  std::vector<double> cost(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) cost[i] = *std::min_element(runs[i].begin(), runs[i].end());
  // best[k][i]: the smallest slowest stage for the first i layers in k stages.
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(stages + 1, std::vector<double>(n + 1, inf));
  std::vector<std::vector<int>> cut(stages + 1, std::vector<int>(n + 1, 0));
  best[0][0] = 0.0;
  for (int k = 1; k <= stages; ++k) {
    for (int i = k; i <= n; ++i) {
      double tail = 0.0;
      for (int j = i - 1; j >= k - 1; --j) {
        tail += cost[j];
        const double slowest = std::max(best[k - 1][j], tail);
        if (slowest < best[k][i]) {
          best[k][i] = slowest;
          cut[k][i] = j;
        }
      }
    }
  }
  std::vector<int> counts(static_cast<size_t>(stages));
  for (int k = stages, i = n; k > 0; --k) {
    counts[k - 1] = i - cut[k][i];
    i = cut[k][i];
  }
  return counts;
}

}  // namespace cohort::parallel::pipeline

#include "cohort/train/parallel_model.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <map>

#include "cohort/data/data_loader.h"
#include "cohort/error.h"
#include "cohort/optim/flat_optimizer.h"
#include "cohort/optim/random_state.h"
#include "cohort/optim/state_dict.h"
#include "cohort/parallel/activation_checkpointing.h"
#include "cohort/parallel/fully_shard.h"
#include "cohort/parallel/mesh.h"
#include "cohort/parallel/pipeline/pipeline.h"
#include "cohort/parallel/tensor_parallel.h"
#include "cohort/runtime/control_channel.h"
#include "cohort/train/captured_step.h"
#include "cohort/train/context.h"
#include "cohort/train/memory_estimate.h"
#include "cohort/train/prepare.h"
#include "cohort/train/report.h"
#include "mesh_checkpoint.h"
#include "train/live_recovery.h"
#include "train/run_files.h"
#include "train/worker_session.h"

namespace cohort::train {

namespace pipeline = parallel::pipeline;

struct ParallelModel::State {
  Plan plan;
  ModelSpec model;
  LossFunction loss;
  optim::LrScheduleOptions schedule;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  std::unique_ptr<optim::LrScheduler> lr_scheduler;
  // This rank's random generators (dropout's masks), which checkpoints keep.
  std::optional<optim::RandomState> random;
  int64_t steps = 0;
  // An engine whose ranks agree outside steps (local SGD, the parameter server: sync()).
  optim::ShardedState* sharded = nullptr;
  // The optimizer where it is a flat one (ZeRO's shard is): its own clipping, CUDA-graph capture
  // and offload to disk.
  optim::FlatOptimizer* flat = nullptr;
  std::unique_ptr<CapturedStep> captured;
  // With a mesh: every stage of the model, this rank's in the pipeline.
  const parallel::DeviceMesh* mesh = nullptr;
  pipeline::PipelineLayout layout;
  std::vector<torch::nn::Sequential> all_stages;
  std::optional<pipeline::Pipeline> pipe;
  std::vector<OptimizerPart::Parameter> parameters;
  // The units whose activations are recomputed in backward.
  std::vector<parallel::CheckpointedUnit> checkpointed;
  // DDP's replicas take rank 0's state before the first step or evaluation, unless a load gave
  // every rank the same state before (a resumed run's, a live regroup's: rank 0's broadcast would
  // be overwritten; it took 0.6-0.8 s of a regroup for 100 M parameters on four processes).
  bool replicas_agree = true;
  void agree_replicas() {
    if (replicas_agree) return;
    get_ddp(model.module).take_rank0_state();
    replicas_agree = true;
  }

  MeshCheckpointParts mesh_parts() {
    return {.mesh = mesh,
            .layout = {.mesh = true,
                       .pp = plan.pp,
                       .tp = plan.tp,
                       .schedule = pipeline::to_string(plan.schedule),
                       .zero_stage = plan.zero.stage},
            .whole = model.dense ? model.dense.get() : model.module.get(),
            .copy_to_dense = model.copy_to_dense,
            .load_from_dense = model.load_from_dense,
            .stages = pipe->module().get(),
            .optimizer = optimizer.get(),
            .parameters = parameters};
  }

  // A micro-batch's loss under the run's precision, its forward timed.
  at::Tensor loss_of(const at::Tensor& inputs, const at::Tensor& targets) {
    auto autocast = train::autocast();
    return loss(model.forward(inputs), targets);
  }

  // Clipping (the loss scaler's unscale first), then the optimizer through the scaler.
  void clip_and_step() {
    if (plan.gradient_clipping > 0) {
      get_loss_scaler().unscale(*optimizer);
      if (flat != nullptr) {
        flat->clip_grad_norm(plan.gradient_clipping);
      } else {
        optim::clip_grad_norm(model.module->parameters(), plan.gradient_clipping);
      }
    }
    step_optimizer(*optimizer);
  }

  // The step's micro-batches, each loss weighted by its rows: the gradient of the mean over all.
  at::Tensor accumulate(const at::Tensor& inputs, const at::Tensor& targets) {
    const int64_t rows = inputs.size(0);
    const int64_t k =
        std::min<int64_t>(plan.gradient_accumulation_steps, std::max<int64_t>(rows, 1));
    const int64_t chunk = (rows + k - 1) / k;
    const auto xs = inputs.split(chunk), ys = targets.split(chunk);
    optimizer->zero_grad();
    at::Tensor total;
    for (size_t i = 0; i < xs.size(); ++i) {
      auto loss = loss_of(xs[i], ys[i]);
      const double share = static_cast<double>(rows) / static_cast<double>(xs[i].size(0));
      std::optional<NoSyncGuard> local;
      if (i + 1 < xs.size()) local.emplace(no_sync(model.module));
      backward(xs.size() > 1 ? loss / share : loss);
      const auto weighted = loss.detach() / share;
      total = total.defined() ? total + weighted : weighted;
    }
    return total;
  }

  // ZeRO stage 3 in a mesh: this rank's stages' units whole while the guard lives, before their
  // values are shared, evaluated, saved or (write_back: cut into the shards again at its end)
  // loaded. Collective over dp; nothing to gather at other stages and without a mesh.
  GatheredParameters gathered_stages(bool write_back = false) const {
    if (!pipe || plan.zero.stage != 3) return {};
    return GatheredParameters(std::make_unique<parallel::ZeroOptimizer::GatheredParameters>(
        dynamic_cast<const parallel::ZeroOptimizer&>(*optimizer), write_back));
  }

  // Copies every stage's parameters and buffers from the pipeline rank that trains it to the
  // pipeline's other ranks: afterwards every rank holds the whole current model. Collective over
  // pp; at ZeRO stage 3 inside gathered_stages().
  void share_stages() {
    auto pp = mesh->pp();
    if (pp.world_size() == 1) return;
    torch::NoGradGuard no_grad;
    for (size_t s = 0; s < all_stages.size(); ++s) {
      const int owner = layout.rank_of(static_cast<int>(s));
      std::vector<at::Tensor> tensors;
      for (const auto& p : all_stages[s]->parameters()) tensors.push_back(p.detach());
      for (const auto& b : all_stages[s]->buffers()) tensors.push_back(b);
      for (auto& t : tensors) {
        std::vector<at::Tensor> one{t};
        pp.broadcast(one, owner);
      }
    }
  }

  // The pipeline's parameters, in the optimizer's order, by their names in the pipeline's module
  // and in the whole (dense) model, with their tensor-parallel slices: so that a run cut
  // otherwise, or not at all, loads their state.
  void name_parameters() {
    std::map<const c10::TensorImpl*, std::string> whole;
    const auto sliced = model.module->named_parameters();
    if (model.dense) {
      const auto dense = model.dense->named_parameters();
      if (dense.size() != sliced.size()) {
        throw UsageError(
            "parallelize: the tensor-parallel model's " + std::to_string(sliced.size()) +
            " parameters do not match the dense model's " + std::to_string(dense.size()) +
            " (ModelSpec::dense must list the same parameters in the same order)");
      }
      for (size_t i = 0; i < sliced.size(); ++i)
        whole[sliced[i].value().unsafeGetTensorImpl()] = dense[i].key();
    } else {
      for (const auto& p : sliced) whole[p.value().unsafeGetTensorImpl()] = p.key();
    }
    std::map<const c10::TensorImpl*, parallel::TensorParallelCut> cuts;
    for (const auto& [name, cut] : parallel::tensor_parallel_cuts(*model.module))
      cuts[sliced[name].unsafeGetTensorImpl()] = cut;
    std::map<const c10::TensorImpl*, std::string> local;
    for (const auto& p : pipe->module()->named_parameters())
      local[p.value().unsafeGetTensorImpl()] = p.key();
    for (const auto& p : pipe->parameters()) {
      const auto* impl = p.unsafeGetTensorImpl();
      if (whole.count(impl) == 0) {
        throw UsageError("parallelize: a parameter of ModelSpec::layers (" + local.at(impl) +
                         ") is not one of ModelSpec::module's; the layers must share the "
                         "module's parameters");
      }
      OptimizerPart::Parameter parameter{
          .name = local.at(impl), .whole_name = whole.at(impl), .shape = p.sizes().vec()};
      if (const auto cut = cuts.find(impl); cut != cuts.end()) {
        parameter.cut = cut->second;
        parameter.slice = mesh->tp_index();
        parameter.slices = mesh->shape().tp;
      }
      parameters.push_back(std::move(parameter));
    }
  }

  void find_engines() {
    sharded = dynamic_cast<optim::ShardedState*>(optimizer.get());
    flat = dynamic_cast<optim::FlatOptimizer*>(optimizer.get());
  }
};

ParallelModel::ParallelModel(std::unique_ptr<State> state) : state_(std::move(state)) {
  // Live recovery takes the state from here (the State stays put when the model moves).
  WorkerSession* session = current_session();
  if (session == nullptr || !session->live_recovery) return;
  State* st = state_.get();
  session->live_owner = st;
  session->live_steps = [st] { return st->steps; };
  session->live_syncs = [st] { return st->sharded ? st->sharded->synchronizations() : 0; };
  session->live_replicas = st->sharded != nullptr && st->sharded->holds_replicas();
  session->live_shard_group = st->plan.zero.stage > 0 ? st->plan.zero.shard_group_size : 0;
  session->live_save = [st](const std::filesystem::path& dir, int rank, int world_size,
                            bool whole) {
    save_live_state(dir, *st->model.module, *st->optimizer, rank, world_size, whole);
  };
  // The driver regroups live only while every survivor trains such a model.
  if (runtime::has_control_channel())
    runtime::send_control_message(Json{{"type", "live_model"}}.dump());
}
ParallelModel::ParallelModel(ParallelModel&&) noexcept = default;
ParallelModel& ParallelModel::operator=(ParallelModel&&) noexcept = default;
ParallelModel::~ParallelModel() {
  WorkerSession* session = current_session();
  if (state_ && session != nullptr && session->live_owner == state_.get()) {
    session->live_owner = nullptr;
    session->live_steps = nullptr;
    session->live_syncs = nullptr;
    session->live_replicas = false;
    session->live_shard_group = 0;
    session->live_save = nullptr;
  }
}

namespace {

void check_model(const ModelSpec& model, const Plan& plan) {
  if (!model.module) throw UsageError("parallelize: ModelSpec::module is null");
  if (!model.forward) throw UsageError("parallelize: ModelSpec::forward is empty");
  if (plan.pp > 1 && !model.layers) {
    throw UsageError("parallelize: a pipeline (--pp " + std::to_string(plan.pp) +
                     ") cuts ModelSpec::layers into stages; give the model's layers in order");
  }
  if (plan.tp > 1 && (!model.dense || !model.copy_to_dense || !model.load_from_dense)) {
    throw UsageError("parallelize: tensor parallelism (--tp " + std::to_string(plan.tp) +
                     ") checkpoints the dense model: give ModelSpec::dense, copy_to_dense and "
                     "load_from_dense");
  }
}

// The mesh of the worker's context matches the plan's degrees.
void check_mesh(const Plan& plan, const TrainContext& ctx) {
  const parallel::MeshShape shape =
      ctx.has_mesh() ? ctx.get_mesh().shape() : parallel::MeshShape{.pp = 1, .tp = 1};
  if (shape.pp != plan.pp || shape.tp != plan.tp) {
    throw UsageError("parallelize: the plan's --pp " + std::to_string(plan.pp) + " --tp " +
                     std::to_string(plan.tp) +
                     " differ from the run's mesh (ScalingConfig::mesh "
                     "pp " +
                     std::to_string(shape.pp) + ", tp " + std::to_string(shape.tp) +
                     "): give both the same degrees");
  }
}

// --offload-optimizer: a flat optimizer's state (ZeRO's shard included; `flat`, null for another
// optimizer) into host memory with the parameters on a GPU, or into files; host memory is where
// a CPU run's state is already.
void offload_optimizer_state(optim::FlatOptimizer* flat, const OptimizerOffload& offload,
                             const TrainContext& ctx) {
  using Device = OptimizerOffload::Device;
  if (offload.device == Device::kNone) return;
  const std::string flag = "--offload-optimizer " + to_string(offload);
  const bool on_gpu = !ctx.get_device().is_cpu();
  if (offload.device == Device::kCpu && !on_gpu) {
    if (ctx.get_world_rank() == 0) {
      std::cout << flag << ": the optimizer state is in host memory already on a CPU run; nothing "
                << "to do" << std::endl;
    }
    return;
  }
  if (flat == nullptr) {
    throw UsageError(flag +
                     " moves the state of cohort's flat optimizers and ZeRO's: use one (not "
                     "--no-flat-optimizer), with --sync ddp");
  }
  // With the parameters on a GPU the update runs on the host, over state there (or in files).
  if (on_gpu) flat->offload_to_host();
  if (offload.device == Device::kDisk) flat->offload_state(offload.path);
  if (ctx.get_world_rank() == 0) {
    std::cout << flag << ": rank 0's optimizer state, " << flat->state_bytes() / 1000000 << " MB, "
              << (offload.device == Device::kDisk ? "streams from files there"
                                                  : "is stepped in host memory")
              << (on_gpu ? " (the gradients come to the host, the weights go back each step)" : "")
              << std::endl;
  }
}

}  // namespace

ParallelModel parallelize(ModelSpec model, const OptimizerFactory& make_optimizer,
                          LossFunction loss, Plan plan, const optim::LrScheduleOptions& schedule) {
  auto& ctx = get_context();
  plan.validate(ctx.get_world_size());
  if (const WorkerSession* session = current_session();
      session != nullptr && session->live_recovery) {
    if (const auto refusal = plan.live_recovery_refusal(ctx.get_world_size()); !refusal.empty())
      throw UsageError(refusal);
  }
  check_model(model, plan);
  check_mesh(plan, ctx);
  if (plan.precision) use_precision(*plan.precision, plan.loss_scaler);
  schedule.validate();
  auto st = std::make_unique<ParallelModel::State>();
  st->plan = plan;
  st->loss = std::move(loss);
  st->schedule = schedule;
  st->random.emplace(ctx.get_world_rank(), ctx.get_world_size(),
                     ctx.get_device().is_cuda() ? std::optional(ctx.get_device()) : std::nullopt);
  // Deferred initialisation: ZeRO stage 3 materialises the units one at a time as it shards
  // them, on a CPU run; every other plan, and a model bound for a GPU, needs the whole model now.
  const bool shards_as_it_materialises =
      plan.zero.stage == 3 && !plan.has_mesh() && ctx.get_device().is_cpu();
  if (!shards_as_it_materialises) parallel::materialize(*model.module);
  // Before any engine wraps the model: the units are the model's own (a pipeline's stages share
  // them).
  if (plan.activation_checkpointing.enabled()) {
    st->checkpointed = parallel::apply_activation_checkpointing(
        *model.module, plan.activation_checkpointing, plan.unit_choice());
  }
  if (!plan.has_mesh()) {
    st->model = std::move(model);
    {
      // A captured step runs on the stream DDP's gradient accumulators were found on.
      std::optional<CaptureStreamScope> capture_stream;
      if (plan.cuda_graph) capture_stream.emplace();
      // DDP (the other engines ignore these options): rank 0's state at the first step
      // (State::agree_replicas), not now.
      prepare_module(st->model.module,
                     {.ddp = {.take_rank0_state = false}, .zero = plan.zero, .sync = plan.sync});
      st->replicas_agree = plan.zero.stage > 0 || !parallel::is_synchronous(plan.sync);
    }
    st->optimizer =
        prepare_optimizer(st->model.module, make_optimizer(st->model.module->parameters()));
    st->find_engines();
    if (plan.cuda_graph) {
      auto* state = st.get();
      st->captured = std::make_unique<CapturedStep>(
          [state](const std::vector<torch::Tensor>& in) {
            state->optimizer->zero_grad();
            const auto loss = state->loss_of(in[0], in[1]);
            backward(loss);
            state->clip_and_step();
            return loss.detach();
          },
          CaptureOptions{.optimizer = st->flat, .group = &ctx.get_process_group()});
    }
  } else {
    st->mesh = &ctx.get_mesh();
    model.module->to(ctx.get_device());
    if (model.dense) model.dense->to(ctx.get_device());
    st->model = std::move(model);
    st->layout = {.ranks = plan.pp, .virtual_stages = plan.virtual_stages()};
    const auto layers = st->model.layers;
    const auto count = static_cast<int>(layers->size());
    if (count < st->layout.stages()) {
      throw UsageError(
          "parallelize: the model has " + std::to_string(count) + " layers, too few for " +
          std::to_string(st->layout.stages()) + " pipeline stages (--pp " +
          std::to_string(plan.pp) +
          (plan.virtual_stages() > 1 ? ", 2 per worker with --schedule interleaved" : "") +
          "): use a smaller --pp or a deeper model");
    }
    st->all_stages =
        pipeline::split_sequential(layers, pipeline::even_split(count, st->layout.stages()));
    std::vector<pipeline::Stage> stages;
    const int pp_index = st->mesh->pp_index();
    for (int s : st->layout.stages_of(pp_index)) stages.emplace_back(st->all_stages[size_t(s)]);
    pipeline::PipelineOptions options{.schedule = plan.schedule,
                                      .micro_batches = plan.micro_batches_per_step(),
                                      .virtual_stages = plan.virtual_stages(),
                                      .data_parallel_group = st->mesh->dp(),
                                      .zero = plan.zero,
                                      .sync = plan.sync};
    // A tied GPT's embedding, in its first stage and its last.
    options.tied_parameters = pipeline::find_tied_parameters(st->all_stages, st->layout, pp_index);
    st->pipe.emplace(std::move(stages), st->mesh->pp(), st->loss, std::move(options));
    // With ZeRO, the engine that shards the optimizer over the dp group; with local SGD or
    // DiLoCo, the one that averages the replicas every H steps.
    st->optimizer = st->pipe->prepare_optimizer(make_optimizer(st->pipe->parameters()));
    st->find_engines();
    st->name_parameters();
  }
  offload_optimizer_state(st->flat, plan.offload_optimizer, ctx);
  st->lr_scheduler = std::make_unique<optim::LrScheduler>(*st->optimizer, schedule, 0);
  // The tensors the engines replaced (the module's own before flattening and sharding).
  release_free_memory();
  if (WorkerSession* session = current_session(); session != nullptr) end_heap_setup(*session);
  return ParallelModel(std::move(st));
}

StepResult ParallelModel::step(const at::Tensor& inputs, const at::Tensor& targets) {
  auto& st = *state_;
  // The step's count and schedule; and where a regroup resumes the data from: after this batch.
  const auto done = [&](bool stepped) {
    if (stepped) {
      st.lr_scheduler->step();
      ++st.steps;
    }
    if (WorkerSession* session = current_session(); session != nullptr && session->live_recovery) {
      session->positions_at_step = session->data_positions;
      session->rows_at_step = inputs.size(0);
    }
  };
  // Outside the live recovery's reach: a failure here is before the replicas agree.
  st.agree_replicas();
  return live_collective([&] {
    StepResult result;
    try {
      result = step_here(inputs, targets);
    } catch (const PeerFailureError&) {
      // Local SGD: the inner step was taken and only the synchronisation after it failed.
      if (st.sharded != nullptr && st.sharded->stepped_before_failure()) done(true);
      throw;
    }
    done(result.stepped);
    return result;
  });
}

StepResult ParallelModel::step_here(const at::Tensor& inputs, const at::Tensor& targets) {
  auto& st = *state_;
  at::Tensor loss;
  if (st.pipe) {
    // A batch too small to split into the step's micro-batches.
    if (inputs.size(0) < st.plan.micro_batches_per_step()) return {.stepped = false};
    st.optimizer->zero_grad();
    {
      // The pipeline times its forward and backward actions itself.
      optim::AutocastGuard autocast(get_context().get_precision(), get_context().get_device());
      loss = st.pipe->step(inputs, targets);
    }
    // By the norm of the whole model: every stage, slice and shard once.
    if (st.plan.gradient_clipping > 0) {
      parallel::clip_grad_norm(*st.mesh, *st.pipe->module(), *st.optimizer,
                               st.plan.gradient_clipping, st.pipe->tied_parameters());
    }
    step_optimizer(*st.optimizer);
  } else if (st.captured) {
    loss = st.captured->run({inputs, targets});
  } else {
    loss = st.accumulate(inputs, targets);
    st.clip_and_step();
  }
  return {.loss = loss};
}

void ParallelModel::sync() {
  if (state_->sharded != nullptr) state_->sharded->synchronize();
}

bool ParallelModel::synchronous() const { return parallel::is_synchronous(state_->plan.sync); }

GatheredParameters ParallelModel::whole_model() {
  state_->agree_replicas();
  if (state_->pipe) {
    auto gathered = state_->gathered_stages();
    state_->share_stages();
    return gathered;
  }
  return gathered_parameters(state_->model.module);
}

Evaluation ParallelModel::evaluate(const data::TensorDataset& data, int64_t batch_size) {
  auto& st = *state_;
  auto& ctx = get_context();
  // A tensor-parallel group's ranks hold slices of one model: they score the same rows, and
  // every row is counted tp times over the world (the sums are divided by tp).
  const int tp = st.plan.tp;
  data::DataLoader loader(data,
                          {.batch_size = batch_size,
                           .shuffle = false,
                           .device = ctx.get_device(),
                           .equal_shards = false},
                          ctx.get_world_rank() / tp, ctx.get_world_size() / tp);
  auto whole = whole_model();
  torch::NoGradGuard no_grad;
  auto& module = *st.model.module;
  const bool training = module.is_training();
  module.eval();
  // Summed on the device, read once at the end: no host sync per batch.
  auto loss_sum = at::zeros({}, at::TensorOptions(at::kDouble).device(ctx.get_device()));
  auto correct = at::zeros_like(loss_sum);
  double rows = 0, targets = 0;
  bool classes = data.targets.defined() && data.targets.dim() >= 1 &&
                 !at::isFloatingType(data.targets.scalar_type());
  for (auto& batch : loader) {
    at::Tensor output;
    {
      optim::AutocastGuard autocast(ctx.get_precision(), ctx.get_device());
      output = st.model.forward(batch.data);
    }
    output = output.to(at::kFloat);
    const auto n = static_cast<double>(batch.data.size(0));
    loss_sum += st.loss(output, batch.target).to(at::kDouble) * n;
    // A logit per class for each target: a classifier's [N, classes] against [N], a language
    // model's [N, T, vocab] against [N, T].
    classes = classes && output.dim() == batch.target.dim() + 1;
    if (classes) correct += output.argmax(-1).eq(batch.target).sum();
    rows += n;
    targets += static_cast<double>(batch.target.numel());
  }
  module.train(training);
  std::vector<at::Tensor> sums{
      at::stack({loss_sum.cpu(), correct.cpu(), at::scalar_tensor(rows, at::kDouble),
                 at::scalar_tensor(classes ? 1.0 : 0.0, at::kDouble),
                 at::scalar_tensor(targets, at::kDouble)})};
  ctx.get_process_group().allreduce(sums);
  const auto total = sums[0];
  Evaluation out;
  const double all = total[2].item<double>();
  out.rows = static_cast<int64_t>(all / tp);
  if (all == 0) return out;
  out.loss = total[0].item<double>() / all;
  // Every rank scored class indices (a rank without rows counts as one).
  if (total[3].item<double>() == static_cast<double>(ctx.get_world_size()))
    out.accuracy = total[1].item<double>() / total[4].item<double>();
  return out;
}

double ParallelModel::replica_spread() {
  auto& ctx = get_context();
  double sum = 0;
  {
    auto whole = whole_model();
    for (const auto& p : state_->model.module->parameters())
      sum += p.detach().to(at::kDouble).sum().item<double>();
  }
  // Rows of (slice, sum), one per rank: tp is the fastest mesh dimension, so a rank's slice is
  // its world rank modulo tp.
  const int tp = state_->plan.tp;
  const auto rows =
      at::cat(ctx.get_process_group().allgather(
                  at::tensor({static_cast<double>(ctx.get_world_rank() % tp), sum}, at::kDouble)))
          .view({-1, 2});
  double spread = 0;
  for (int slice = 0; slice < tp; ++slice) {
    const auto sums = rows.index({rows.select(1, 0).eq(slice)}).select(1, 1);
    spread = std::max(spread, (sums.max() - sums.min()).item<double>());
  }
  return spread;
}

at::Tensor ParallelModel::forward(const at::Tensor& inputs) const {
  return state_->model.forward(inputs);
}

torch::nn::Module& ParallelModel::module() const { return *state_->model.module; }
torch::optim::Optimizer& ParallelModel::optimizer() const { return *state_->optimizer; }
const Plan& ParallelModel::plan() const { return state_->plan; }
int64_t ParallelModel::steps() const { return state_->steps; }

double ParallelModel::lr() const {
  auto& groups = state_->optimizer->param_groups();
  return groups.empty() ? 0.0 : groups.front().options().get_lr();
}

std::string ParallelModel::describe() const {
  const auto& plan = state_->plan;
  std::string engine = plan.zero.stage > 0 ? "ZeRO stage " + std::to_string(plan.zero.stage)
                       : parallel::is_synchronous(plan.sync) ? std::string("DDP")
                                                             : parallel::to_string(plan.sync);
  if (plan.zero.stage > 0 && plan.zero.shard_group_size > 0)
    engine += " in sharding groups of " + std::to_string(plan.zero.shard_group_size);
  const std::string recomputed =
      state_->checkpointed.empty()
          ? ""
          : ", activation checkpointing " + parallel::to_string(plan.activation_checkpointing) +
                " (" + std::to_string(state_->checkpointed.size()) +
                (state_->checkpointed.size() == 1 ? " unit)" : " units)");
  if (!state_->pipe) return engine + recomputed;
  return "mesh " + parallel::to_string(state_->mesh->shape()) + ": " +
         std::to_string(state_->model.layers->size()) + " layers in " +
         std::to_string(state_->layout.stages()) + " stages, " +
         pipeline::to_string(plan.schedule) + " over " +
         std::to_string(plan.micro_batches_per_step()) + " micro-batches, " + engine + " over dp" +
         recomputed;
}

void ParallelModel::save(const std::filesystem::path& dir) const {
  auto& st = *state_;
  const int rank = get_context().get_world_rank();
  if (st.pipe) {
    // The whole model that the checkpoint holds is the first rank's, with every stage's current
    // parameters (its other stages are trained elsewhere).
    const auto gathered = st.gathered_stages();
    st.share_stages();
    save_mesh_checkpoint(dir, st.mesh_parts());
  } else if (rank == 0 || checkpoint_per_rank(*st.optimizer)) {
    save_checkpoint(dir, *st.model.module, *st.optimizer);
  }
  // Every rank's random generators; where the schedule stands, once.
  save_state(dir, optim::kRandomStatePart, st.random->state_dict());
  if (rank == 0) save_state(dir, optim::kLrSchedulePart, st.lr_scheduler->state_dict());
}

void ParallelModel::load(const Checkpoint& checkpoint) {
  auto& st = *state_;
  // A live regroup's kept tensors (kept_tensors.h) go once they are loaded: their memory was the
  // model's and optimizer's before the regroup.
  struct DropKeptState {
    ~DropKeptState() {
      if (WorkerSession* session = current_session()) session->kept_state = {};
    }
  } drop_kept_state;
  if (st.pipe) {
    {
      // Every rank reads the whole model; ZeRO stage 3 keeps its stages' shards of it.
      const auto gathered = st.gathered_stages(/*write_back=*/true);
      load_mesh_checkpoint(checkpoint, st.mesh_parts());
    }
    release_free_memory();  // the load's staging (load_checkpoint does it itself)
  } else {
    check_mesh_checkpoint(checkpoint, st.plan.sync);
    load_checkpoint(checkpoint, *st.model.module, *st.optimizer);
    st.replicas_agree = true;  // every rank loaded the same model
    // ZeRO 1-2 after a live recovery: the parameters from the shards (each rank's model file is
    // current in its own piece only).
    if (st.sharded != nullptr && std::filesystem::exists(checkpoint.path() / kMetaFile) &&
        read_json(checkpoint.path() / kMetaFile).value("live_recovery", false))
      st.sharded->gather_parameters_from_shards();
  }
  // The checkpoint's lr already has the schedule's factor for its steps. A checkpoint of the
  // first release has no schedule of its own: its "steps" metric says where it stood.
  const auto& dir = checkpoint.path();
  st.steps = checkpoint.metrics().value("steps", int64_t{0});
  st.lr_scheduler = std::make_unique<optim::LrScheduler>(*st.optimizer, st.schedule, st.steps);
  if (holds_state(dir, optim::kLrSchedulePart)) {
    load_state(dir, optim::kLrSchedulePart, *st.lr_scheduler);
    st.steps = st.lr_scheduler->steps_done();
  }
  // Last: nothing above draws from the generators it sets.
  if (holds_state(dir, optim::kRandomStatePart)) {
    load_state(dir, optim::kRandomStatePart, *st.random);
    if (!st.random->restored() && get_context().get_world_rank() == 0) {
      std::cerr << "cohort: " << dir.string()
                << " holds the random generators of another world size or device than this "
                   "run's: each rank's generators go on from its seed (dropout draws other masks "
                   "than the checkpoint's run would have)"
                << std::endl;
    }
  }
}

ResumePoint resume_point(const Checkpoint& checkpoint) {
  const auto metrics = checkpoint.metrics();
  const int epoch = metrics.value("epoch", 0);
  const int64_t epoch_step = metrics.value(kEpochStepMetric, int64_t{0});
  if (get_context().get_world_rank() == 0) {
    std::cout << "resuming "
              << (epoch_step > 0 ? "epoch " + std::to_string(epoch) + " after step " +
                                       std::to_string(epoch_step)
                                 : "after epoch " + std::to_string(epoch))
              << " from " << checkpoint.path().string() << std::endl;
  }
  if (epoch_step > 0) return {.epoch = epoch - 1, .epoch_steps_done = epoch_step};
  return {.epoch = epoch};
}

namespace {

// The folder a rank's checkpoint files are written to before they are reported.
std::filesystem::path report_folder() {
  const auto& ctx = get_context();
  return ctx.get_storage_path() /
         (".report-checkpoint-rank" + std::to_string(ctx.get_world_rank()));
}

// This rank's files captured in memory, reported, and written and committed behind the loop.
// Saves `model` into memory (checkpoint_capture()) once the save in flight is done: whether this
// rank saved files, the seconds waited for that one, and the seconds the save took (the step's
// stall).
struct CapturedSave {
  double waited_s = 0, stalled_s = 0;
};
CapturedSave capture_save(const ParallelModel& model) {
  const double waited = wait_for_checkpoint_in_flight();
  const auto dir = report_folder();
  const auto start = std::chrono::steady_clock::now();
  {
    FileCapture capture(dir, checkpoint_capture());
    model.save(dir);
  }
  // The save made the folders, empty: every file went through write_atomically into memory.
  std::error_code error;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(dir, error)) {
    if (entry.is_regular_file()) {
      remove_tree(dir);
      throw RuntimeError("an asynchronous checkpoint's save wrote " + entry.path().string() +
                         " to disk, not into memory: save it synchronously (this is a bug of "
                         "cohort's: report it)");
    }
  }
  remove_tree(dir);
  return {
      .waited_s = waited,
      .stalled_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()};
}

void report_asynchronously(Json metrics, const ParallelModel& model) {
  const auto save = capture_save(model);
  metrics["checkpoint_wait_s"] = save.waited_s;
  metrics["checkpoint_snapshot_s"] = save.stalled_s;
  report_async(metrics, /*has_files=*/true);
}

}  // namespace

void snapshot(const Json& metrics, const ParallelModel& model) {
  auto kept = metrics;
  const auto save = capture_save(model);
  kept["snapshot_wait_s"] = save.waited_s;
  kept["snapshot_stall_s"] = save.stalled_s;
  snapshot_async(kept);
}

void report(const Json& metrics, const ParallelModel& model, const SaveOptions& options) {
  if (options.async && options.skip_when_busy && checkpoint_in_flight_on_any_rank()) {
    auto reported = metrics;
    reported["checkpoint_skipped"] = true;
    report(reported);
    return;
  }
  if (options.async) {
    report_asynchronously(metrics, model);
    return;
  }
  const auto dir = report_folder();
  remove_tree(dir);
  model.save(dir);
  report(metrics, Checkpoint::from_directory(dir));
  remove_tree(dir);
}

}  // namespace cohort::train

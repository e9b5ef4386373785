// `cohort train --pp P --tp T`: the zoo's model on a mesh of dp x pp x tp workers. Every rank
// builds the whole model from the same seed (with T > 1 the ViT's blocks tensor-parallel over its
// tp group), cuts it into the pipeline's stages at its pipeline_layers() and trains its own
// stages; the stages' gradients are averaged over the dp group by the DDP engine, or
// reduce-scattered by ZeRO stage 1 or 2 (--zero-stage), which shards the optimizer over it; with
// --sync local-sgd:H or diloco:H each replica steps alone and the stages are averaged over the dp
// group every H steps and at every epoch's end.
#include <torch/torch.h>

#include <fstream>
#include <iostream>
#include <tuple>

#include "cohort/cohort.h"
#include "cohort/models/zoo.h"
#include "training_job.h"

namespace cohort::cli {
namespace {

namespace pipeline = parallel::pipeline;

// Stages per worker: the interleaved schedule's two, else one.
int virtual_stages_of(pipeline::ScheduleKind kind) {
  return kind == pipeline::ScheduleKind::kInterleaved ? 2 : 1;
}

// Copies every stage's parameters and buffers from the pipeline rank that trains it to the
// pipeline's other ranks: afterwards every rank holds the whole current model (for evaluation and
// the checkpoint). Collective over the pp group.
void share_stages(const std::vector<torch::nn::Sequential>& stages,
                  const pipeline::PipelineLayout& layout, comm::ProcessGroup pp) {
  if (pp.world_size() == 1) return;
  torch::NoGradGuard no_grad;
  for (size_t s = 0; s < stages.size(); ++s) {
    const int owner = layout.rank_of(static_cast<int>(s));
    std::vector<at::Tensor> tensors;
    for (const auto& p : stages[s]->parameters()) tensors.push_back(p.detach());
    for (const auto& b : stages[s]->buffers()) tensors.push_back(b);
    for (auto& t : tensors) {
      std::vector<at::Tensor> one{t};
      pp.broadcast(one, owner);
    }
  }
}

// What a mesh checkpoint holds besides the files: the layout that wrote it.
constexpr const char* kMeshFile = "mesh.json";

// The layout of a checkpoint: a mesh run's degrees and schedule, or none (pp 1, tp 1).
struct WrittenLayout {
  bool mesh = false;
  int pp = 1, tp = 1;
  std::string schedule;
  std::string flags() const {
    return "--pp " + std::to_string(pp) + " --tp " + std::to_string(tp) +
           (pp > 1 ? " --schedule " + schedule : "");
  }
  // A mesh cut as `other` (a mesh too): the same degrees and stages per rank (the schedules may
  // differ otherwise).
  bool same_cut(const WrittenLayout& other) const {
    return mesh && other.mesh && pp == other.pp && tp == other.tp &&
           virtual_stages_of(pipeline::schedule_from_string(schedule)) ==
               virtual_stages_of(pipeline::schedule_from_string(other.schedule));
  }
};
WrittenLayout written_layout(const Checkpoint& checkpoint) {
  const auto file = checkpoint.path() / kMeshFile;
  if (!std::filesystem::exists(file)) return {};
  const auto json = Json::parse(std::ifstream(file));
  return {.mesh = true,
          .pp = json.value("pp", 0),
          .tp = json.value("tp", 0),
          .schedule = json.value("schedule", std::string("1f1b"))};
}

// The folder of one (pp, tp) position's optimizer state: optimizer.pt (DDP, from dp index 0), or
// every dp rank's ZeRO shards. Checkpoints written before ZeRO could shard a pipeline hold the
// state as a file of this name plus ".pt".
std::string optimizer_folder(const parallel::DeviceMesh& mesh) {
  const auto& s = mesh.shape();
  return "optimizer-pp" + std::to_string(mesh.pp_index()) + "-of-" + std::to_string(s.pp) + "-tp" +
         std::to_string(mesh.tp_index()) + "-of-" + std::to_string(s.tp);
}

// The model a checkpoint holds: the whole, unsplit model, which loads into a run without a mesh
// too. With tp > 1 the ViT's slices are gathered into `dense`.
struct CheckpointedModel {
  models::ImageClassifier model;
  std::shared_ptr<models::VisionTransformerImpl> dense;  // with tp > 1
  models::VisionTransformerImpl& sliced() const {
    return dynamic_cast<models::VisionTransformerImpl&>(*model);
  }
  // This rank's optimizer's parameters in order, by their names in the pipeline's module and in
  // the whole (dense) model, with their tensor-parallel slices: so that a run cut otherwise, or
  // not at all, loads its state. Also what this rank loads.
  std::vector<train::OptimizerPart::Parameter> part;
};

// Names and slices of the pipeline's parameters (the stages share the model's tensors): the
// model's names, the dense model's where tensor-parallel (the two list them in the same order).
void name_parts(CheckpointedModel& checkpointed, const pipeline::Pipeline& pipe,
                const parallel::DeviceMesh& mesh) {
  std::map<const c10::TensorImpl*, std::string> whole;
  const auto sliced = checkpointed.model->named_parameters();
  if (checkpointed.dense) {
    const auto dense = checkpointed.dense->named_parameters();
    if (dense.size() != sliced.size()) {
      throw RuntimeError("the tensor-parallel " + std::to_string(sliced.size()) +
                         " parameters do not match the dense model's " +
                         std::to_string(dense.size()));
    }
    for (size_t i = 0; i < sliced.size(); ++i)
      whole[sliced[i].value().unsafeGetTensorImpl()] = dense[i].key();
  } else {
    for (const auto& p : sliced) whole[p.value().unsafeGetTensorImpl()] = p.key();
  }
  std::map<const c10::TensorImpl*, parallel::TensorParallelCut> cuts;
  for (const auto& [name, cut] : parallel::tensor_parallel_cuts(*checkpointed.model))
    cuts[sliced[name].unsafeGetTensorImpl()] = cut;
  std::map<const c10::TensorImpl*, std::string> local;
  for (const auto& p : pipe.module()->named_parameters())
    local[p.value().unsafeGetTensorImpl()] = p.key();
  for (const auto& p : pipe.parameters()) {  // the optimizer's order
    const auto* impl = p.unsafeGetTensorImpl();
    train::OptimizerPart::Parameter parameter{
        .name = local.at(impl), .whole_name = whole.at(impl), .shape = p.sizes().vec()};
    if (const auto cut = cuts.find(impl); cut != cuts.end()) {
      parameter.cut = cut->second;
      parameter.slice = mesh.tp_index();
      parameter.slices = mesh.shape().tp;
    }
    checkpointed.part.push_back(std::move(parameter));
  }
}

// The ranks of dp index 0 write the checkpoint (their replicas' are the same): the model (whole
// after share_stages) from pp index 0, every stage's optimizer state from its rank; with ZeRO
// every dp rank writes its shards of that state too, and with local SGD or DiLoCo its own inner
// state (the folder is then a local SGD checkpoint of `stages`, also holding the global
// parameters and the outer momentum). Every rank reports, so that the checkpoint is committed
// once all got there.
void report_with_checkpoint(const Json& metrics, const parallel::DeviceMesh& mesh,
                            const CheckpointedModel& model, const torch::nn::Module& stages,
                            const torch::optim::Optimizer& optimizer, const std::string& schedule,
                            int zero_stage) {
  auto& ctx = train::get_context();
  if (mesh.dp_index() != 0 && !train::checkpoint_per_rank(optimizer)) {
    train::report(metrics);
    return;
  }
  const auto dir =
      ctx.get_storage_path() / (".report-checkpoint-rank" + std::to_string(ctx.get_world_rank()));
  std::filesystem::create_directories(dir);
  if (mesh.dp_index() == 0 && mesh.pp_index() == 0) {
    if (model.dense) model.sliced().copy_to_dense(*model.dense);  // collective over tp
    if (mesh.tp_index() == 0)
      train::save_model(model.dense ? *model.dense : *model.model, dir / "model.safetensors");
  }
  if (dynamic_cast<const parallel::LocalSgdOptimizer*>(&optimizer) != nullptr) {
    train::save_checkpoint(dir / optimizer_folder(mesh), stages, optimizer);
  } else {
    train::save_optimizer_state(dir / optimizer_folder(mesh), optimizer);
  }
  if (mesh.dp_index() == 0)
    train::save_optimizer_part({.dir = dir / optimizer_folder(mesh), .parameters = model.part});
  if (ctx.get_world_rank() == 0) {
    const auto& s = mesh.shape();
    std::ofstream(dir / kMeshFile)
        << Json{{"pp", s.pp}, {"tp", s.tp}, {"schedule", schedule}, {"zero_stage", zero_stage}}
               .dump(2)
        << "\n";
  }
  train::report(metrics, Checkpoint::from_directory(dir));
  std::filesystem::remove_all(dir);
}

// load_mesh_checkpoint's optimizer state of a synchronous engine (a whole optimizer or ZeRO).
void load_mesh_optimizer_state(const std::filesystem::path& dir, const WrittenLayout& written,
                               const WrittenLayout& here, const parallel::DeviceMesh& mesh,
                               const CheckpointedModel& model, torch::optim::Optimizer& optimizer,
                               const torch::nn::Module& stages) {
  if (!written.same_cut(here)) {
    // Another cut: every stage's state by the model's names.
    std::vector<train::OptimizerPart> parts;
    if (written.mesh) {
      parts = train::find_optimizer_parts(dir);
      if (parts.empty()) {
        throw UsageError("checkpoint " + dir.string() +
                         " was written before a mesh checkpoint named its stages' optimizer "
                         "state: resume it with " +
                         written.flags());
      }
    } else {
      // A run without a mesh: its optimizer was over the (dense) model's parameters, in order.
      train::OptimizerPart whole{.dir = dir, .parameters = {}};
      const torch::nn::Module& dense =
          model.dense ? static_cast<const torch::nn::Module&>(*model.dense) : *model.model;
      for (const auto& p : dense.named_parameters())
        whole.parameters.push_back({p.key(), p.key(), p.value().sizes().vec()});
      parts.push_back(std::move(whole));
    }
    if (train::get_context().get_world_rank() == 0) {
      std::cout << "re-cutting the optimizer state of " << dir.filename().string() << " from "
                << (written.mesh ? written.flags() : "a run without a mesh") << " to "
                << here.flags() << std::endl;
    }
    train::load_optimizer_parts(parts, optimizer, stages, model.part);
    return;
  }
  const auto state = dir / optimizer_folder(mesh);
  auto old_file = state;
  old_file += ".pt";
  if (std::filesystem::is_directory(state)) {
    train::load_optimizer_state(state, optimizer, stages);
  } else if (std::filesystem::exists(old_file) && !train::checkpoint_per_rank(optimizer)) {
    train::load_optimizer(optimizer, old_file);
  } else if (std::filesystem::exists(old_file)) {
    throw UsageError("checkpoint " + dir.string() +
                     " was written before ZeRO could shard a pipeline's optimizer state: resume "
                     "it with --zero-stage 0 (its next checkpoint then loads into ZeRO)");
  } else {
    throw UsageError("checkpoint " + dir.string() + " holds no optimizer state for " +
                     optimizer_folder(mesh) + ": it is incomplete; resume from another one");
  }
}

// Loads the whole model and this rank's optimizer state. From a mesh checkpoint of the same pp,
// tp and stages per rank (any dp; DDP's state, ZeRO's shards or local SGD's, into any engine:
// `stages` is what the optimizer steps, pipe.module()) exactly as written. From any other cut,
// or a run without a mesh: each parameter's state found by the model's name, its
// tensor-parallel slices gathered and cut anew. Local SGD and DiLoCo continue their period from
// a checkpoint of their own of the same cut and dp, else start one from the loaded model with
// the state in their inner optimizer.
void load_mesh_checkpoint(const Checkpoint& checkpoint, const parallel::DeviceMesh& mesh,
                          const CheckpointedModel& model, torch::optim::Optimizer& optimizer,
                          torch::nn::Module& stages, const std::string& schedule) {
  const auto dir = checkpoint.path();
  const auto& s = mesh.shape();
  const WrittenLayout here{.mesh = true, .pp = s.pp, .tp = s.tp, .schedule = schedule};
  const WrittenLayout written = written_layout(checkpoint);
  if (model.dense) {
    train::load_model(*model.dense, dir / "model.safetensors");
    model.sliced().load_from_dense(*model.dense);
  } else {
    train::load_model(*model.model, dir / "model.safetensors");
  }
  auto* local = dynamic_cast<parallel::LocalSgdOptimizer*>(&optimizer);
  const auto state = dir / optimizer_folder(mesh);
  if (local != nullptr && written.same_cut(here) && train::is_local_sgd_checkpoint(state)) {
    // Its own checkpoint: the stages' global parameters, this rank's own and its inner state.
    train::load_checkpoint(Checkpoint::from_directory(state), stages, *local);
    return;
  }
  // The state that the optimizer steps with: local SGD's inner optimizer's, a new period.
  torch::optim::Optimizer& target = local != nullptr ? local->inner() : optimizer;
  load_mesh_optimizer_state(dir, written, here, mesh, model, target, stages);
  if (local != nullptr) local->restore({}, nullptr, 0, {});
}

}  // namespace

void check_mesh_checkpoint(const Checkpoint& checkpoint, const parallel::SyncMode& sync) {
  const WrittenLayout written = written_layout(checkpoint);
  if (!written.mesh) return;
  const bool server = std::holds_alternative<parallel::AsyncParameterServer>(sync);
  const std::string why =
      server ? "the parameter server does not load a mesh's optimizer state"
      : train::find_optimizer_parts(checkpoint.path()).empty()
          ? "it was written before a mesh checkpoint named its stages' optimizer state"
          : "";
  if (why.empty()) {
    if (train::get_context().get_world_rank() == 0) {
      std::cout << "re-cutting the optimizer state of " << checkpoint.path().filename().string()
                << " from " << written.flags() << " to a run without a mesh" << std::endl;
    }
    return;
  }
  throw UsageError(
      "checkpoint " + checkpoint.path().string() + " was written by a mesh run (" +
      written.flags() + "): " + why + "; resume it with " +
      (server ? "--sync ddp, local-sgd:H or diloco:H (with or without " + written.flags() + ")"
              : written.flags()));
}

int micro_batches_of(const TrainOptions& o) {
  const int per_batch = o.micro_batches > 0 ? o.micro_batches : o.pp > 1 ? 2 * o.pp : 1;
  return per_batch * static_cast<int>(std::max<int64_t>(o.gradient_accumulation_steps, 1));
}

void validate_mesh(const TrainOptions& o) {
  if (o.pp < 1) throw UsageError("--pp " + std::to_string(o.pp) + " must be >= 1 (1: no pipeline)");
  if (o.tp < 1) {
    throw UsageError("--tp " + std::to_string(o.tp) + " must be >= 1 (1: no tensor parallelism)");
  }
  if (o.micro_batches < 0) {
    throw UsageError("--micro-batches " + std::to_string(o.micro_batches) +
                     " must be >= 1 (0: 2 x --pp)");
  }
  const auto kind = pipeline::schedule_from_string(o.pipeline_schedule);
  if (o.pp == 1 && o.tp == 1) return;
  const std::string flags = "--pp " + std::to_string(o.pp) + " --tp " + std::to_string(o.tp);
  // The degrees multiply to the workers; the rest is data parallelism.
  if (o.workers % (o.pp * o.tp) != 0) {
    throw UsageError(flags + " makes groups of " + std::to_string(o.pp * o.tp) +
                     " workers, which does not divide --workers " + std::to_string(o.workers) +
                     ": use --workers a multiple of " + std::to_string(o.pp * o.tp));
  }
  const int m = micro_batches_of(o);
  const int per_batch = m / static_cast<int>(o.gradient_accumulation_steps);
  if (o.batch_size < per_batch) {
    throw UsageError("--batch-size " + std::to_string(o.batch_size) + " cannot be split into " +
                     std::to_string(per_batch) +
                     " micro-batches (--micro-batches): use a batch of at least " +
                     std::to_string(per_batch) + " rows");
  }
  // The schedule compiles (e.g. interleaved needs m a multiple of pp) for the micro-batches of
  // an optimizer step: --gradient-accumulation-steps batches' of them.
  pipeline::compile_schedule({.kind = kind,
                              .layout = {.ranks = o.pp, .virtual_stages = virtual_stages_of(kind)},
                              .micro_batches = m});
  auto model = models::create_model(o.model);
  const int stages = o.pp * virtual_stages_of(kind);
  const auto layers = static_cast<int>(model->pipeline_layers()->size());
  if (layers < stages) {
    throw UsageError(
        o.model + " has " + std::to_string(layers) + " layers, too few for " +
        std::to_string(stages) + " pipeline stages (--pp " + std::to_string(o.pp) +
        (virtual_stages_of(kind) > 1 ? ", 2 per worker with --schedule interleaved" : "") +
        "): use a smaller --pp or a deeper model (resnet18 has 10, vit depth + 2)");
  }
  if (o.tp > 1 && o.model != "vit") {
    throw UsageError("--tp " + std::to_string(o.tp) + ": " + o.model +
                     " has no tensor-parallel layers; use --model vit, or --pp to cut " + o.model +
                     " into pipeline stages");
  }
  if (o.tp > 1) {
    const models::ModelOptions vit;
    if (vit.heads % o.tp != 0 || (vit.width * vit.mlp_ratio) % o.tp != 0) {
      throw UsageError("--tp " + std::to_string(o.tp) + " must divide the vit's " +
                       std::to_string(vit.heads) + " heads and " +
                       std::to_string(vit.width * vit.mlp_ratio) + " MLP features");
    }
  }
  // What the mesh loop does not combine with yet.
  auto refuse = [&](bool set, const std::string& what, const std::string& fix) {
    if (set) throw UsageError(what + " with " + flags + " is not supported yet: " + fix);
  };
  refuse(o.zero.stage == 3,
         "ZeRO stage 3" +
             (o.deepspeed.empty() ? std::string(" (--zero-stage)") : " (from " + o.deepspeed + ")"),
         "stages 1 and 2 shard the pipeline's optimizer state and gradients over its dp group; "
         "use --zero-stage 1 or 2");
  refuse(std::holds_alternative<parallel::AsyncParameterServer>(sync_of(o)), "--sync " + o.sync,
         "the parameter server serves whole models; use --sync ddp, local-sgd:H or diloco:H");
  refuse(o.precision == "fp16", "--precision fp16", "use bf16 or fp32");
  // An elastic mesh shrinks and grows by whole replicas of pp x tp workers.
  if (o.min_workers % (o.pp * o.tp) != 0) {
    throw UsageError("--min-workers " + std::to_string(o.min_workers) + " with " + flags +
                     ": an elastic group keeps whole replicas of " + std::to_string(o.pp * o.tp) +
                     " workers; use a multiple of " + std::to_string(o.pp * o.tp));
  }
}

void train_loop_on_mesh(const Json& c) {
  auto& ctx = train::get_context();
  const auto& mesh = ctx.get_mesh();
  const auto& shape = mesh.shape();
  const bool rank0 = ctx.get_world_rank() == 0;
  const auto kind = pipeline::schedule_from_string(c["pipeline_schedule"].get<std::string>());
  // Per optimizer step: --gradient-accumulation-steps k batches of --batch-size rows, one
  // pipeline step over all their micro-batches (k times --micro-batches): the gradient of the
  // mean over their rows, as k accumulated batches without a mesh.
  const int micro_batches = c["micro_batches"].get<int>();
  const int64_t accumulation = c.value("gradient_accumulation_steps", int64_t{1});
  const parallel::ZeroOptions zero = zero_options_of(c);
  const parallel::SyncMode sync = sync_mode_of(c);
  const double clip = c.value("gradient_clipping", 0.0);
  const pipeline::PipelineLayout layout{.ranks = shape.pp,
                                        .virtual_stages = virtual_stages_of(kind)};

  // The whole model on every rank, the same weights (the same seed; the tensor-parallel slices
  // are the dense model's), cut into the stages of every rank.
  const auto seed = c["seed"].get<uint64_t>();
  const auto name = c["model"].get<std::string>();
  CheckpointedModel checkpointed;
  if (shape.tp > 1) {
    // The dense ViT that checkpoints hold, made first: after the same seed, the sliced model's
    // weights are its slices.
    torch::manual_seed(seed);
    checkpointed.dense = std::dynamic_pointer_cast<models::VisionTransformerImpl>(
        models::create_model(name, model_options_of(c)));
  }
  torch::manual_seed(seed);
  models::ModelOptions model_options = model_options_of(c);
  model_options.tensor_parallel_group = mesh.tp();
  auto model = models::create_model(name, model_options);
  model->to(ctx.get_device());
  checkpointed.model = model;
  auto layers = model->pipeline_layers();
  const auto all_stages = pipeline::split_sequential(
      layers, pipeline::even_split(static_cast<int>(layers->size()), layout.stages()));
  std::vector<pipeline::Stage> stages;
  for (int s : layout.stages_of(mesh.pp_index())) stages.emplace_back(all_stages[size_t(s)]);
  pipeline::Pipeline pipe(std::move(stages), mesh.pp(),
                          [](const at::Tensor& output, const at::Tensor& target) {
                            return torch::nn::functional::cross_entropy(output, target);
                          },
                          {.schedule = kind,
                           .micro_batches = micro_batches,
                           .virtual_stages = layout.virtual_stages,
                           .data_parallel_group = mesh.dp(),
                           .zero = zero,
                           .sync = sync});
  // With ZeRO, the engine that shards the optimizer over the dp group; with local SGD or
  // DiLoCo, the one that averages the replicas every H steps.
  auto optimizer = pipe.prepare_optimizer(make_optimizer(c, pipe.parameters()));
  name_parts(checkpointed, pipe, mesh);
  if (rank0) {
    std::cout << "mesh " << parallel::to_string(shape) << ": " << layers->size() << " layers in "
              << layout.stages() << " stages, " << to_string(kind) << " over " << micro_batches
              << " micro-batches, "
              << (zero.stage > 0                   ? "ZeRO stage " + std::to_string(zero.stage)
                  : parallel::is_synchronous(sync) ? std::string("DDP")
                                                   : parallel::to_string(sync))
              << " over dp" << std::endl;
  }

  int start_epoch = 0;
  int64_t steps = 0;
  ResumePoint resumed;
  if (auto checkpoint = train::get_checkpoint()) {
    load_mesh_checkpoint(*checkpoint, mesh, checkpointed, *optimizer, *pipe.module(),
                         to_string(kind));
    // From a group of another dp degree (--workers, or an elastic restart): the lr scaled.
    train::restore_run_state(*checkpoint, *optimizer);
    resumed = resume_point(*checkpoint);
    start_epoch = resumed.epoch;
    steps = resumed.steps;
  }
  bool stopping = false;  // a Ctrl-C asked to stop after a checkpoint
  // train::should_stop() is a collective: after every step, or at epoch ends with local SGD and
  // DiLoCo, whose replicas must not wait for each other every step.
  const bool stop_every_step = parallel::is_synchronous(sync);
  auto* local_sgd = dynamic_cast<parallel::LocalSgdOptimizer*>(optimizer.get());

  // This dp rank's shard (the same rows on every rank of a pipeline and of a tp group).
  auto train_stream = train::get_dataset_shard("train");
  // Rows per optimizer step on this dp rank.
  const int64_t step_rows = c["batch_size"].get<int64_t>() * accumulation;
  // Evaluation: every rank holds the whole model then; a tp group scores the same rows.
  data::DataLoader test_loader(
      test_set_of(c),
      {.batch_size = 500, .shuffle = false, .device = ctx.get_device(), .equal_shards = false},
      ctx.get_world_rank() / shape.tp, ctx.get_world_size() / shape.tp);
  const int epochs = c["epochs"].get<int>();
  const int64_t max_steps = c["max_steps"].get<int64_t>();
  const int64_t steps_per_epoch =
      (train_stream.dataset().num_source_rows() + step_rows - 1) / step_rows;
  optim::LrScheduler schedule(*optimizer, schedule_of(c, epochs * steps_per_epoch), steps);
  // Throughput over the steps after the first few (start-up, first-step probe).
  constexpr int64_t kWarmupSteps = 5;
  const int64_t first_step = steps;
  int64_t timed_samples = 0;
  double timed_seconds = 0;
  auto step_start = std::chrono::steady_clock::now();
  for (int epoch = start_epoch; epoch < epochs; ++epoch) {
    train_stream.set_epoch(epoch);
    step_start = std::chrono::steady_clock::now();  // not the evaluation's time
    double loss_sum = 0;
    int64_t loss_count = 0;
    const std::string label = "epoch " + std::to_string(epoch + 1) + "/" + std::to_string(epochs);
    int64_t step_in_epoch = 0;
    // Resumed inside this epoch: its first steps' batches were trained on already.
    int64_t skip = epoch == start_epoch ? resumed.epoch_steps_done : 0;
    for (auto& batch :
         train_stream.iter_batches({.batch_size = step_rows, .device = ctx.get_device()})) {
      const auto& images = batch["image"];
      // A last batch too small to split: every rank of the pipeline has the same rows, and
      // every dp rank as many: all skip it alike.
      if (images.size(0) < micro_batches) continue;
      if (skip > 0) {
        --skip;
        ++step_in_epoch;
        continue;
      }
      optimizer->zero_grad();
      at::Tensor loss;
      {
        // The pipeline times its forward and backward actions itself.
        optim::AutocastGuard autocast(ctx.get_precision(), ctx.get_device());
        loss = pipe.step(images, batch["label"]);
      }
      // By the norm of the whole model: every stage, slice and shard once.
      if (clip > 0) parallel::clip_grad_norm(mesh, *pipe.module(), *optimizer, clip);
      train::step_optimizer(*optimizer);
      schedule.step();
      ++steps;
      ++step_in_epoch;
      const auto now = std::chrono::steady_clock::now();
      if (steps > first_step + kWarmupSteps) {
        timed_seconds += std::chrono::duration<double>(now - step_start).count();
        timed_samples += images.size(0) * shape.dp;
      }
      step_start = now;
      if (loss.defined()) {
        loss_sum += loss.item<double>();
        ++loss_count;
      }
      Json progress{{"label", label},
                    {"step", step_in_epoch},
                    {"total", steps_per_epoch},
                    {"samples_per_s", timed_seconds > 0 ? timed_samples / timed_seconds : 0.0}};
      if (loss_count > 0) progress["loss"] = loss_sum / static_cast<double>(loss_count);
      train::report_progress(progress);
      if (max_steps > 0 && steps >= max_steps) break;
      if (stop_every_step && train::should_stop()) {
        stopping = true;
        break;
      }
    }
    // Local SGD and DiLoCo: the replicas agree at the end of every epoch too, so that the
    // evaluation and the checkpoint are of one model.
    if (local_sgd != nullptr) local_sgd->sync();
    if (!stop_every_step) stopping = train::should_stop();
    // The epoch's mean loss over the last stages' ranks.
    std::vector<at::Tensor> loss_stats{
        torch::tensor({loss_sum, static_cast<double>(loss_count)}, torch::kDouble)};
    ctx.get_process_group().allreduce(loss_stats);
    const double train_loss = loss_stats[0][0].item<double>() / loss_stats[0][1].item<double>();
    share_stages(all_stages, layout, mesh.pp());
    const auto eval = evaluate(
        *model, [&](torch::Tensor x) { return model->forward(std::move(x)); }, test_loader,
        ctx.get_process_group());
    const bool last = epoch + 1 == epochs || (max_steps > 0 && steps >= max_steps) || stopping;
    Json metrics{{"epoch", epoch + 1},
                 {"epochs", epoch + 1},
                 {"world_size", ctx.get_world_size()},
                 {"mesh", parallel::to_string(shape)},
                 {"steps", steps},
                 {"train_loss", train_loss},
                 {"test_loss", eval.loss},
                 {"test_accuracy", eval.accuracy},
                 {"lr", current_lr(*optimizer)},
                 {"samples_per_second", timed_seconds > 0 ? timed_samples / timed_seconds : 0.0}};
    if (stopping && step_in_epoch < steps_per_epoch) metrics[kEpochStepMetric] = step_in_epoch;
    report_with_checkpoint(metrics, mesh, checkpointed, *pipe.module(), *optimizer, to_string(kind),
                           zero.stage);
    if (last) break;
  }
}

}  // namespace cohort::cli

#include "training_job.h"

#include "cohort/cli/config_file.h"

#include <torch/torch.h>

#include <unistd.h>

#include <iostream>
#include <tuple>

#include "cohort/cohort.h"
#include "cohort/models/model_spec.h"
#include "cohort/models/zoo.h"
#include "cohort/runtime/heap.h"

namespace cohort::cli {
models::ZooModel model_shape_of(const TrainOptions& o) {
  auto options = model_options_of(o);
  options.deferred_init = true;
  return models::create_model(o.model, options);
}

models::ModelOptions model_options_of(const Json& c) {
  return c.value("model_options", Json::object()).get<models::ModelOptions>();
}

models::ModelOptions model_options_of(const TrainOptions& o) {
  models::ModelOptions options;
  options.depth = o.layers;
  options.width = o.width;
  options.heads = o.heads;
  options.context = o.context;
  options.tie_embeddings = !o.untie_embeddings;
  // MNIST-format data: the options' defaults (1x28x28, 10 classes), its files not read.
  if (o.data.data.empty()) return options;
  return models::options_for_data(o.data.open(o.loop.seed, o.context), options);
}

namespace {

// The model the workers build, as estimate_memory takes it.
train::ModelSpec estimated_spec(const models::ZooModel& model, const train::Plan& plan) {
  return {.module = model,
          .forward = [model](const at::Tensor& x) { return model->forward(x); },
          .layers = plan.pp > 1 ? models::pipeline_layers(*model, plan.pp)
                                : torch::nn::Sequential(nullptr)};
}

}  // namespace

void check_offload_room(const TrainOptions& o) {
  const auto plan = o.plan.plan(o.scaling.workers);
  if (plan.offload_optimizer.device != train::OptimizerOffload::Device::kDisk) return;
  const auto model = model_shape_of(o);
  const auto estimate = train::estimate_memory(estimated_spec(model, plan), plan,
                                               {.world_size = o.scaling.workers,
                                                .optimizer_states = o.optimizer.state_buffers(),
                                                .flat_optimizer = o.optimizer.flat,
                                                .gpu = o.scaling.use_gpu});
  // Every worker of this machine writes its state there.
  train::check_offload_room(plan.offload_optimizer, estimate.disk_bytes * o.scaling.workers);
}

train::MemoryEstimate estimate_of(const TrainOptions& o) {
  // Before the model: libtorch and this process, as a worker has them.
  const int64_t runtime = train::resident_bytes();
  const auto plan = o.plan.plan(o.scaling.workers);
  const auto options = model_options_of(o);
  // The model built and probed under a worker's heap policy: what the probe finds is what a
  // worker's steps add (its heap keeps freed activations for the next step).
  runtime::heap_for_setup();
  torch::manual_seed(o.loop.seed);
  auto model = models::create_model(o.model, options);
  if (plan.activation_checkpointing.enabled())
    parallel::apply_activation_checkpointing(*model, plan.activation_checkpointing,
                                             plan.unit_choice());
  runtime::heap_for_steps();
  const auto spec = estimated_spec(model, plan);
  // One micro-batch: the batch, or with a pipeline one of its micro-batches.
  const int64_t activations =
      models::measure_step_activations(*model, plan.micro_batch_rows(o.loop.batch_size),
                                       optim::precision_from_string(o.plan.precision));
  return train::estimate_memory(spec, plan,
                                {.world_size = o.scaling.workers,
                                 .optimizer_states = o.optimizer.state_buffers(),
                                 .flat_optimizer = o.optimizer.flat,
                                 .activation_bytes = activations,
                                 .runtime_bytes = runtime,
                                 .async_checkpoint = o.run.async_checkpoint,
                                 .snapshots = o.run.snapshot_every_steps.has_value(),
                                 .gpu = o.scaling.use_gpu});
}

void validate_mesh(const TrainOptions& o) {
  const auto plan = o.plan.plan();
  if (!plan.has_mesh()) return;
  plan.check_batch_size(o.loop.batch_size);
  models::check_plan(o.model, model_options_of(o), plan);
}

void validate(const TrainOptions& o) {
  // A language model reads tokens, the classifiers images or feature rows.
  const bool text = o.data.is_text();
  if (o.model == "gpt" && !text) {
    throw UsageError(
        "--model gpt reads tokens: give --data text:FILE (a file's bytes) or --data "
        "random-tokens:ROWS (for throughput)");
  }
  if (text && o.model != "gpt") {
    throw UsageError("--data " + o.data.data +
                     " is tokens, which only the language model reads: use "
                     "--model gpt");
  }
  // The data as the workers open it: its flags, its files and its shape.
  const auto labelled = o.data.open(o.loop.seed, o.context);
  std::string on_data, data_fix;  // what a model that does not fit the data is told
  if (!o.data.data.empty()) {
    if (labelled.kind == data::LabelledData::Kind::kCsv && o.model != "mlp") {
      throw UsageError("--data " + o.data.data + " with --model " + o.model +
                       ": a CSV's rows are feature vectors, which only the mlp reads; use "
                       "--model mlp");
    }
    // The model below is built for this data (a ViT's patches, the cnn's pooling).
    on_data = " on --data " + o.data.data + " (" + labelled.describe() + ")";
    if (labelled.kind == data::LabelledData::Kind::kImages)
      data_fix = "; choose another --image-size";
  }
  // The model the workers build, once: an unknown name lists the zoo, the data's shape and a
  // transformer's sizes (--layers, --width, --heads) are checked; after the plan, the units
  // --activation-checkpointing names, before any worker starts.
  models::ZooModel model;
  try {
    model = model_shape_of(o);
  } catch (const UsageError& e) {
    if (!on_data.empty())
      throw UsageError("--model " + o.model + on_data + ": " + e.what() + data_fix);
    if (o.model != "vit" && o.model != "gpt") throw;
    throw UsageError("--model " + o.model + " (--layers " + std::to_string(o.layers) +
                     ", --width " + std::to_string(o.width) + ", --heads " +
                     std::to_string(o.heads) + "): " + e.what());
  }
  check_offload_room(o);
  // The hyperparameters, checked as the workers will build them.
  try {
    optim::make_optimizer(o.optimizer, {torch::zeros({1}, torch::requires_grad())});
  } catch (const UsageError& e) {
    if (o.deepspeed.empty()) throw;
    throw UsageError(std::string(e.what()) + " (from --deepspeed " + o.deepspeed + ")");
  }
  o.loop.validate();
  train::Plan plan;
  try {
    plan = o.plan.plan(o.scaling.workers);
  } catch (const UsageError& e) {
    if (o.deepspeed.empty()) throw;
    throw UsageError(std::string(e.what()) + " (" + o.deepspeed +
                     " sets --zero-stage, --gradient-accumulation-steps and --gradient-clipping)");
  }
  parallel::checkpointed_units(*model, plan.activation_checkpointing, plan.unit_choice());
  // What the Trainer checks of the configs these flags fill (the worker counts, the parameter
  // servers, an elastic mesh, threads, GPUs, backend, umask, profiled steps), named by the flags.
  auto names = kRunFlagNames;
  names.insert(kScalingFlagNames.begin(), kScalingFlagNames.end());
  check_configs(scaling_of(o), run_config_of(o), names);
  validate_mesh(o);
  if (o.plan.cuda_graph && !o.optimizer.flat) {
    // A captured step's optimizer keeps its step count and learning rate on the device.
    throw UsageError(
        "--cuda-graph needs the flat optimizer (drop --no-flat-optimizer): torch::optim counts "
        "its steps on the host, which a replayed graph does not advance");
  }
  if (o.run.recovery == "live") {
    if (const auto refusal = o.plan.plan().live_recovery_refusal(o.scaling.workers);
        !refusal.empty())
      throw UsageError(refusal);
    const auto& zero = o.plan.plan().zero;
    if (!o.run.replace_lost && zero.stage > 0 && zero.shard_group_size > 1) {
      // The survivors of one loss are no multiple of the sharding group.
      throw UsageError("--recovery live --no-replace-lost with --shard-group-size " +
                       std::to_string(zero.shard_group_size) +
                       ": the survivors of a lost worker "
                       "are no multiple of " +
                       std::to_string(zero.shard_group_size) +
                       ", so their shards cannot be laid out again live; let a replacement take "
                       "its place (leave out --no-replace-lost), or use --recovery restart");
    }
  }
  const int64_t train_size = o.data.train_rows(labelled);
  if (o.scaling.workers > train_size) {
    throw UsageError("--workers " + std::to_string(o.scaling.workers) + " is more than the " +
                     std::to_string(train_size) +
                     " training examples (each worker needs a shard): use at most " +
                     std::to_string(train_size) + " workers");
  }
  // With a mesh the data is sharded over the data-parallel degree only.
  const int64_t shard = train_size / std::max(1, o.scaling.workers / (o.plan.pp * o.plan.tp));
  if (o.loop.batch_size > shard) {
    throw UsageError("--batch-size " + std::to_string(o.loop.batch_size) +
                     " is larger than a shard (" + std::to_string(train_size) + " examples / " +
                     std::to_string(o.scaling.workers) + " workers = " + std::to_string(shard) +
                     "): use a batch size <= " + std::to_string(shard) + " or fewer workers");
  }
}

std::map<std::string, data::Dataset> datasets_of(const TrainOptions& o) {
  return o.data.datasets(o.data.open(o.loop.seed, o.context), o.loop.seed);
}

Json to_json(const TrainOptions& o) {
  Json config{{"model", o.model}};
  // The loop's, the plan's and the optimizer's keys as LoopOptions, PlanOptions and
  // OptimizerOptions write them (the values the run uses: the optimizer's defaults where no flag
  // gave one): a user's own program reads the same.
  config.update(Json(o.loop));
  config["run"] = o.run;
  config.update(Json(o.plan));
  config.update(Json(o.optimizer));
  config.update(Json(o.data));
  auto model = model_options_of(o);
  model.deferred_init = o.deferred_init;
  config["model_options"] = model;
  return config;
}

void apply_deepspeed_config(TrainOptions& o) {
  if (o.deepspeed.empty()) return;
  const auto ds = load_deepspeed_config(o.deepspeed, o.scaling.workers, o.plan, o.optimizer);
  o.loop.batch_size = ds.micro_batch_size;
  o.loop.schedule = ds.schedule;
}

ScalingConfig scaling_of(const TrainOptions& o) {
  auto scaling = o.scaling.scaling_config(o.plan.plan());
  scaling.on_world_size_change = train::linear_lr_scaling;
  return scaling;
}

RunConfig run_config_of(const TrainOptions& o) {
  auto run = o.run.run_config(o.loop.max_steps);
  // The checkpoints kept besides the latest are the most accurate.
  run.checkpoint_config.checkpoint_score_attribute = "test_accuracy";
  run.checkpoint_config.checkpoint_score_order = "max";
  return run;
}

train::Plan plan_of(const Json& c) { return c.get<PlanOptions>().plan(); }

void train_loop(const Json& c) {
  const auto plan = plan_of(c);
  // This rank's shard of the Trainer's "train" dataset (with a mesh, its dp group's: the same rows
  // on every rank of a pipeline and of a tp group), shuffled each epoch, normalised in the
  // prefetch thread or by --data-workers preprocessing processes.
  auto train_stream = train::get_dataset_shard("train");
  // The data opened as the driver opened it: its columns and its test split.
  const auto data_options = c.get<DataOptions>();
  const auto model_options = model_options_of(c);
  const auto loop_options = c.get<LoopOptions>();
  const auto data = data_options.open(loop_options.seed, model_options.context);
  train::EpochLoopOptions loop{
      .input_column = data.input_column,
      .target_column = data.target_column,
      .test_set = data_options.test_set(data),
      // A language model's rows are sequences: its throughput is reported in tokens too.
      .tokens_per_row = data.kind == data::LabelledData::Kind::kText ? model_options.context : 0};
  loop_options.apply(loop);
  // The checkpoints' and snapshots' cadence, and asynchronous saves.
  c["run"].get<RunOptions>().apply(loop);
  // Every rank the same weights (the same seed; rank 0's), then the optimizer over them (with
  // ZeRO, the engine that shards it). The decay spans every epoch (--max-steps stops a run early
  // without changing its schedule, so that a run stopped and resumed follows the schedule of one
  // never stopped).
  auto model = train::parallelize(
      models::model_spec(c["model"], model_options, loop_options.seed),
      [&](std::vector<at::Tensor> params) {
        return optim::make_optimizer(c.get<optim::OptimizerOptions>(), std::move(params));
      },
      models::logits_cross_entropy, plan,
      loop_options.lr_schedule(loop.epochs *
                               train::steps_per_epoch(train_stream, loop.batch_size, plan)));
  if (train::get_context().get_world_rank() == 0 &&
      (plan.has_mesh() || plan.activation_checkpointing.enabled() ||
       plan.zero.shard_group_size > 0))
    std::cout << model.describe() << std::endl;
  train::run_epochs(model, train_stream, loop);
}

namespace {

// A flag whose default is in its help and in the effective options (config.json).
CLI::Option* add_bool_flag(CLI::App* cmd, const std::string& names, bool& value,
                           const std::string& help) {
  return cmd->add_flag(names, value, help)->default_str(value ? "true" : "false");
}

}  // namespace

void add_training_options(CLI::App* cmd, TrainOptions& o) {
  cmd->option_defaults()->group("Model and data");
  cmd->add_option("--model", o.model,
                  "mlp, cnn, resnet18, vit or gpt (a decoder-only language model: --data "
                  "text:FILE or random-tokens:ROWS)")
      ->capture_default_str();
  cmd->add_option("--layers", o.layers, "vit and gpt: transformer blocks")->capture_default_str();
  cmd->add_option("--width", o.width, "vit and gpt: embedding width (a multiple of --heads)")
      ->capture_default_str();
  cmd->add_option("--heads", o.heads, "vit and gpt: attention heads per block")
      ->capture_default_str();
  cmd->add_option("--context", o.context,
                  "gpt: the longest sequence in tokens, and the tokens per row of --data text:FILE")
      ->capture_default_str();
  add_bool_flag(cmd, "--deferred-init", o.deferred_init,
                "build the model's units without keeping their weights until the plan places "
                "them: with --zero-stage 3 each worker initialises only its shards, one unit at a "
                "time (the weights are those of an ordinary build, bit for bit)");
  add_bool_flag(cmd, "--untie-embeddings", o.untie_embeddings,
                "gpt: an output head of its own instead of the token embedding's weight (tied "
                "across --pp stages, the first and the last stage each step a copy, kept equal "
                "by summing their gradients)");
  add_data_options(cmd, o.data);
  add_scaling_options(cmd, o.scaling);
  add_loop_options(cmd, o.loop);
  add_optimizer_options(cmd, o.optimizer);
  cmd->add_option("--memory-budget", o.memory_budget_gb,
                  "GB per worker: refuse, before any worker starts, a plan that `cohort estimate` "
                  "says needs more, naming its largest item and the option that shrinks it (0: "
                  "no check)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  add_plan_options(cmd, o.plan);
  cmd->add_option("--deepspeed", o.deepspeed,
                  "a DeepSpeed JSON config: its batch sizes, optimizer, scheduler, fp16/bf16, "
                  "gradient_clipping and zero_optimization replace those options");
  cmd->option_defaults()->group("Run directory and recovery");
  add_config_option(cmd, o.config_file);
  add_run_options(cmd, o.run);
}

}  // namespace cohort::cli

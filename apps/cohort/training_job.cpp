#include "training_job.h"

#include "cohort/cli/config_file.h"

#include <torch/torch.h>

#include <unistd.h>

#include <iostream>
#include <tuple>

#include "cohort/cohort.h"
#include "cohort/models/model_spec.h"
#include "cohort/models/zoo.h"

namespace cohort::cli {
namespace {

std::filesystem::path data_dir_of(const TrainOptions& o) {
  if (!o.data_dir.empty()) return o.data_dir;
  if (o.dataset == "fashion-mnist") return data::default_fashion_mnist_dir();
  throw UsageError("--dataset " + o.dataset + " has no default location: pass --data-dir");
}

// The user's data of --data (a job's config, where its options are).
data::LabelledData labelled_data_of(const Json& c) {
  return data::open_labelled_data(c["data"].get<std::string>(),
                                  {.label_column = c.value("label", std::string()),
                                   .image_size = c.value("image_size", int64_t{28}),
                                   .context = c.value("context", models::ModelOptions{}.context),
                                   .test_size = c.value("test_size", 0.1),
                                   .seed = c["seed"].get<uint64_t>()});
}

// The zoo model's options for the data: its channels, image size and classes, or a text's
// vocabulary and context.
models::ModelOptions model_options_for(const data::LabelledData& labelled,
                                       models::ModelOptions options) {
  options.in_channels = labelled.channels;
  options.image_size = labelled.image_size;
  options.num_classes = labelled.num_classes;
  if (labelled.kind == data::LabelledData::Kind::kText) {
    options.vocab_size = labelled.num_classes;
    options.context = labelled.context;
  }
  return options;
}

Json data_to_json(const TrainOptions& o) {
  return {{"data", o.data},           {"label", o.label}, {"image_size", o.image_size},
          {"test_size", o.test_size}, {"seed", o.seed},   {"context", o.context}};
}

// The columns a batch of the job's data has after normalisation: the model's input and target.
std::pair<std::string, std::string> columns_of(const std::string& data) {
  if (is_text_data(data)) return {"tokens", "next_tokens"};
  return {"image", "label"};
}

}  // namespace

optim::LrScheduleOptions schedule_of(const Json& c, int64_t total_steps) {
  if (c.contains("lr_schedule")) {
    // A DeepSpeed scheduler: its own step counts.
    const auto& j = c["lr_schedule"];
    return optim::LrScheduleOptions{.warmup_steps = j["warmup_steps"].get<int64_t>(),
                                    .warmup_type = j["warmup_type"].get<std::string>(),
                                    .warmup_start_ratio = j["warmup_start_ratio"].get<double>(),
                                    .decay = j["decay"].get<std::string>(),
                                    .total_steps = j["total_steps"].get<int64_t>()};
  }
  optim::LrScheduleOptions schedule{.warmup_steps = c.value("warmup_steps", int64_t{0}),
                                    .decay = c.value("lr_decay", std::string("none")),
                                    .total_steps = total_steps};
  // A run shorter than its warmup decays over what is left: nothing.
  if (schedule.decay != "none" && schedule.total_steps <= schedule.warmup_steps)
    schedule.decay = "none";
  return schedule;
}

models::ZooModel model_shape_of(const TrainOptions& o) {
  auto options = model_options_of(o);
  options.deferred_init = true;
  return models::create_model(o.model, options);
}

bool is_text_data(const std::string& data) {
  return data.rfind("text:", 0) == 0 || data.rfind("random-tokens:", 0) == 0;
}

models::ModelOptions model_options_of(const Json& c) {
  models::ModelOptions options;
  if (c.contains("model_options")) {
    const auto& m = c["model_options"];
    options.in_channels = m.at("in_channels").get<int64_t>();
    options.image_size = m.at("image_size").get<int64_t>();
    options.num_classes = m.at("num_classes").get<int64_t>();
    options.depth = m.value("depth", options.depth);
    options.width = m.value("width", options.width);
    options.heads = m.value("heads", options.heads);
    options.vocab_size = m.value("vocab_size", options.vocab_size);
    options.context = m.value("context", options.context);
    options.tie_embeddings = m.value("tie_embeddings", options.tie_embeddings);
    options.deferred_init = m.value("deferred_init", options.deferred_init);
  }
  return options;
}

models::ModelOptions model_options_of(const TrainOptions& o) {
  models::ModelOptions options;
  options.depth = o.layers;
  options.width = o.width;
  options.heads = o.heads;
  options.context = o.context;
  options.tie_embeddings = !o.untie_embeddings;
  if (o.data.empty()) return options;
  return model_options_for(labelled_data_of(data_to_json(o)), options);
}

data::TensorDataset test_set_of(const Json& c) {
  data::TensorDataset test_set;
  if (c.contains("data")) {
    const auto labelled = labelled_data_of(c);
    test_set = data::materialize_labelled(labelled.test, labelled.normalize, labelled.input_column,
                                          labelled.target_column);
  } else {
    test_set = data::load_mnist(c["data_dir"].get<std::string>(), data::Split::kTest);
  }
  if (const int64_t n = c.value("test_examples", int64_t{0}); n > 0 && n < test_set.size()) {
    test_set.inputs = test_set.inputs.narrow(0, 0, n);
    test_set.targets = test_set.targets.narrow(0, 0, n);
  }
  return test_set;
}

namespace {

// The flags that fill ScalingConfig's and RunConfig's fields, for the library's checks of them.
OptionNames flag_names() {
  auto names = kRunFlagNames;
  names.insert({{"ScalingConfig.num_workers", "--workers"},
                {"ScalingConfig.min_workers", "--min-workers"},
                {"ScalingConfig.num_parameter_servers", "--parameter-servers"},
                {"ScalingConfig.mesh", "--pp/--tp"},
                {"ScalingConfig.mesh.pp", "--pp"},
                {"ScalingConfig.mesh.tp", "--tp"},
                {"ScalingConfig.resources_per_worker.cpu_threads", "--threads"}});
  return names;
}

// The model the workers build, as estimate_memory takes it.
train::ModelSpec estimated_spec(const models::ZooModel& model, const train::Plan& plan) {
  return {.module = model,
          .forward = [model](const at::Tensor& x) { return model->forward(x); },
          .layers = plan.pp > 1 ? model->pipeline_layers() : torch::nn::Sequential(nullptr)};
}

}  // namespace

void check_offload_room(const TrainOptions& o) {
  const auto plan = o.plan.plan(o.workers);
  if (plan.offload_optimizer.device != train::OptimizerOffload::Device::kDisk) return;
  const auto model = model_shape_of(o);
  const auto estimate = train::estimate_memory(estimated_spec(model, plan), plan,
                                               {.world_size = o.workers,
                                                .optimizer_states = o.optimizer.state_buffers(),
                                                .flat_optimizer = o.optimizer.flat});
  // Every worker of this machine writes its state there.
  train::check_offload_room(plan.offload_optimizer, estimate.disk_bytes * o.workers);
}

train::MemoryEstimate estimate_of(const TrainOptions& o) {
  // Before the model: libtorch and this process, as a worker has them.
  const int64_t runtime = train::resident_bytes();
  const auto plan = o.plan.plan(o.workers);
  const auto options = model_options_of(o);
  torch::manual_seed(o.seed);
  auto model = models::create_model(o.model, options);
  if (plan.activation_checkpointing.enabled())
    parallel::apply_activation_checkpointing(*model, plan.activation_checkpointing);
  const auto spec = estimated_spec(model, plan);
  // One micro-batch: the batch, or with a pipeline one of its micro-batches.
  int64_t rows = o.batch_size;
  if (plan.pp > 1) {
    const int64_t per_batch =
        plan.micro_batches_per_step() / std::max<int64_t>(plan.gradient_accumulation_steps, 1);
    rows = std::max<int64_t>(1, o.batch_size / std::max<int64_t>(per_batch, 1));
  }
  const auto [x, y] = model->sample_batch(rows);
  model->train();
  const auto precision = optim::precision_from_string(o.plan.precision);
  const int64_t activations = train::measure_step_memory(*model, [&] {
    at::Tensor loss;
    {
      optim::AutocastGuard autocast(precision, torch::kCPU);
      loss = models::logits_cross_entropy(model->forward(x), y);
    }
    loss.backward();
  });
  return train::estimate_memory(spec, plan,
                                {.world_size = o.workers,
                                 .optimizer_states = o.optimizer.state_buffers(),
                                 .flat_optimizer = o.optimizer.flat,
                                 .activation_bytes = activations,
                                 .runtime_bytes = runtime,
                                 .async_checkpoint = o.run.async_checkpoint,
                                 .snapshots = o.run.snapshot_every_steps.has_value()});
}

void validate_mesh(const TrainOptions& o) {
  const auto plan = o.plan.plan();
  if (!plan.has_mesh()) return;
  const int per_batch =
      plan.micro_batches_per_step() / static_cast<int>(o.plan.gradient_accumulation_steps);
  if (o.batch_size < per_batch) {
    throw UsageError("--batch-size " + std::to_string(o.batch_size) + " cannot be split into " +
                     std::to_string(per_batch) +
                     " micro-batches (--micro-batches): use a batch of at least " +
                     std::to_string(per_batch) + " rows");
  }
  const auto options = model_options_of(o);
  auto model = model_shape_of(o);
  if (const auto* gpt = dynamic_cast<const models::GptImpl*>(model.get()))
    gpt->check_pipeline_stages(o.plan.pp);
  const int stages = o.plan.pp * plan.virtual_stages();
  const auto layers = static_cast<int>(model->pipeline_layers()->size());
  if (layers < stages) {
    throw UsageError(
        o.model + " has " + std::to_string(layers) + " layers, too few for " +
        std::to_string(stages) + " pipeline stages (--pp " + std::to_string(o.plan.pp) +
        (plan.virtual_stages() > 1 ? ", 2 per worker with --schedule interleaved" : "") +
        "): use a smaller --pp or a deeper model (resnet18 has 10, vit and gpt --layers + 2)");
  }
  if (o.plan.tp > 1 && o.model != "vit" && o.model != "gpt") {
    throw UsageError("--tp " + std::to_string(o.plan.tp) + ": " + o.model +
                     " has no tensor-parallel layers; use --model vit or gpt, or --pp to cut " +
                     o.model + " into pipeline stages");
  }
  if (o.plan.tp > 1) {
    if (options.heads % o.plan.tp != 0 || (options.width * options.mlp_ratio) % o.plan.tp != 0) {
      throw UsageError("--tp " + std::to_string(o.plan.tp) + " must divide the " + o.model + "'s " +
                       std::to_string(options.heads) + " heads (--heads) and " +
                       std::to_string(options.width * options.mlp_ratio) +
                       " MLP features (4 x --width)");
    }
  }
}

void validate(const TrainOptions& o) {
  if (o.dataset != "fashion-mnist" && o.dataset != "mnist") {
    throw UsageError("unknown --dataset '" + o.dataset + "': choose fashion-mnist or mnist");
  }
  // A language model reads tokens, the classifiers images or feature rows.
  const bool text = is_text_data(o.data);
  if (o.model == "gpt" && !text) {
    throw UsageError(
        "--model gpt reads tokens: give --data text:FILE (a file's bytes) or --data "
        "random-tokens:ROWS (for throughput)");
  }
  if (text && o.model != "gpt") {
    throw UsageError("--data " + o.data +
                     " is tokens, which only the language model reads: use "
                     "--model gpt");
  }
  if (!o.label.empty() && o.data.rfind("csv:", 0) != 0)
    throw UsageError("--label " + o.label +
                     " names a CSV's class column: use it with --data csv:FILE");
  int64_t train_size = 0;
  std::string on_data, data_fix;  // what a model that does not fit the data is told
  if (!o.data.empty()) {
    if (!o.data_dir.empty()) {
      throw UsageError("--data " + o.data + " and --data-dir " + o.data_dir +
                       " both name the data: give one (--data-dir is for MNIST-format files)");
    }
    const auto labelled = labelled_data_of(data_to_json(o));
    if (labelled.kind == data::LabelledData::Kind::kCsv && o.model != "mlp") {
      throw UsageError("--data " + o.data + " with --model " + o.model +
                       ": a CSV's rows are feature vectors, which only the mlp reads; use "
                       "--model mlp");
    }
    // The model below is built for this data (a ViT's patches, the cnn's pooling).
    on_data = " on --data " + o.data + " (" + labelled.describe() + ")";
    if (labelled.kind == data::LabelledData::Kind::kImages)
      data_fix = "; choose another --image-size";
    train_size = labelled.train.num_source_rows();
  } else {
    if (o.image_size != TrainOptions{}.image_size || o.test_size != TrainOptions{}.test_size) {
      throw UsageError(
          "--image-size and --test-size shape the data of --data images:DIR or csv:FILE; "
          "MNIST-format data has 28x28 images and its own test split");
    }
    const auto dir = data_dir_of(o);
    data::check_mnist_dir(dir);
    train_size = data::inspect_idx(std::filesystem::exists(dir / "train-labels-idx1-ubyte")
                                       ? dir / "train-labels-idx1-ubyte"
                                       : dir / "train-labels-idx1-ubyte.gz")
                     .shape[0];
  }
  // The model the workers build, once: an unknown name lists the zoo, the data's shape and a
  // transformer's sizes (--layers, --width, --heads) are checked; then the units
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
  parallel::checkpointed_units(
      *model, parallel::parse_activation_checkpointing(o.plan.activation_checkpointing));
  check_offload_room(o);
  // The hyperparameters, checked as the workers will build them.
  try {
    optim::make_optimizer(o.optimizer, {torch::zeros({1}, torch::requires_grad())});
  } catch (const UsageError& e) {
    if (o.deepspeed.empty()) throw;
    throw UsageError(std::string(e.what()) + " (from --deepspeed " + o.deepspeed + ")");
  }
  const auto precision = optim::precision_from_string(o.plan.precision);
  if (!o.use_gpu) optim::check_precision_supported(precision, c10::Device(c10::kCPU));
  if (o.warmup_steps < 0)
    throw UsageError("--warmup-steps " + std::to_string(o.warmup_steps) + " must be >= 0");
  if (o.lr_decay != "none" && o.lr_decay != "cosine" && o.lr_decay != "linear")
    throw UsageError("unknown --lr-decay '" + o.lr_decay + "': choose none, cosine or linear");
  if (o.gpus_per_worker < 0) {
    throw UsageError("--gpus-per-worker " + std::to_string(o.gpus_per_worker) + " must be >= 0");
  }
  if (o.gpus_per_worker > 0 && !o.use_gpu) {
    throw UsageError("--gpus-per-worker " + std::to_string(o.gpus_per_worker) + " needs --use-gpu");
  }
  if (o.epochs < 1) throw UsageError("--epochs " + std::to_string(o.epochs) + " must be >= 1");
  if (o.batch_size < 1) {
    throw UsageError("--batch-size " + std::to_string(o.batch_size) + " must be >= 1");
  }
  if (o.max_steps < 0) throw UsageError("--max-steps must be >= 0 (0: no limit)");
  if (o.train_examples < 0) throw UsageError("--train-examples must be >= 0 (0: all)");
  const auto sync = o.plan.sync_mode();
  try {
    o.plan.plan(o.workers);
  } catch (const UsageError& e) {
    if (o.deepspeed.empty()) throw;
    throw UsageError(std::string(e.what()) + " (" + o.deepspeed +
                     " sets --zero-stage, --gradient-accumulation-steps and --gradient-clipping)");
  }
  // What the Trainer checks of the configs these flags fill (the worker counts, the parameter
  // servers, an elastic mesh, threads, backend, umask, profiled steps), named by the flags.
  check_configs(scaling_of(o), run_config_of(o), flag_names());
  validate_mesh(o);
  if (o.plan.cuda_graph) {
    // What a captured step needs besides the plan's: a GPU, NCCL, and an optimizer whose step
    // count and learning rate live on the device.
    const auto refuse = [](const std::string& why) { throw UsageError("--cuda-graph " + why); };
    if (!o.use_gpu) refuse("needs --use-gpu: CUDA graphs capture GPU work (drop --cuda-graph)");
    if (!o.optimizer.flat)
      refuse(
          "needs the flat optimizer (drop --no-flat-optimizer): torch::optim counts its steps "
          "on the host, which a replayed graph does not advance");
    if (o.backend == "gloo")
      refuse("needs NCCL's collectives (--backend auto or nccl): Gloo's cannot be captured");
  }
  if (o.parameter_servers > 0 && !std::holds_alternative<parallel::AsyncParameterServer>(sync)) {
    throw UsageError("--parameter-servers " + std::to_string(o.parameter_servers) +
                     " with --sync " + o.plan.sync +
                     ": parameter servers serve only --sync async-ps:K (K: steps a worker may "
                     "run ahead of the slowest)");
  }
  if (o.test_examples < 0) {
    throw UsageError("--test-examples " + std::to_string(o.test_examples) +
                     " must be >= 0 (0: all)");
  }
  if (o.data_workers < -1)
    throw UsageError("--data-workers must be >= 0, or -1 for one per free CPU");
  if (o.run.recovery == "live") {
    if (const auto refusal = o.plan.plan().live_recovery_refusal(); !refusal.empty())
      throw UsageError(refusal);
  }
  if (o.train_examples > 0) train_size = std::min(train_size, o.train_examples);
  if (o.workers > train_size) {
    throw UsageError("--workers " + std::to_string(o.workers) + " is more than the " +
                     std::to_string(train_size) +
                     " training examples (each worker needs a shard): use at most " +
                     std::to_string(train_size) + " workers");
  }
  // With a mesh the data is sharded over the data-parallel degree only.
  const int64_t shard = train_size / std::max(1, o.workers / (o.plan.pp * o.plan.tp));
  if (o.batch_size > shard) {
    throw UsageError("--batch-size " + std::to_string(o.batch_size) + " is larger than a shard (" +
                     std::to_string(train_size) + " examples / " + std::to_string(o.workers) +
                     " workers = " + std::to_string(shard) +
                     "): use a batch size <= " + std::to_string(shard) + " or fewer workers");
  }
}

std::string describe_data(const TrainOptions& o) {
  const auto labelled = labelled_data_of(data_to_json(o));
  if (labelled.kind == data::LabelledData::Kind::kText) return labelled.describe();
  std::string classes;
  for (size_t c = 0; c < labelled.class_names.size() && c < 10; ++c)
    classes += (c ? ", " : "") + labelled.class_names[c];
  if (labelled.class_names.size() > 10) classes += ", ...";
  return labelled.describe() + " (" + classes + ")";
}

std::map<std::string, data::Dataset> datasets_of(const TrainOptions& o) {
  data::Dataset train;
  data::BatchFn normalize;
  if (!o.data.empty()) {
    auto labelled = labelled_data_of(data_to_json(o));
    train = labelled.train;
    normalize = labelled.normalize;
  } else {
    train = data::Dataset::from_mnist(data_dir_of(o), data::Split::kTrain);
    const data::MnistOptions stats;
    normalize = data::Normalize{.mean = {stats.mean}, .std = {stats.std}};
  }
  if (o.train_examples > 0) train = train.limit(o.train_examples);
  return {{"train", train.random_shuffle(o.seed).map_batches(
                        normalize,
                        {.name = "normalize", .batch_size = 256, .num_workers = o.data_workers})}};
}

Json to_json(const TrainOptions& o) {
  Json config{{"model", o.model},
              {"epochs", o.epochs},
              {"batch_size", o.batch_size},
              {"seed", o.seed},
              {"max_steps", o.max_steps},
              {"train_examples", o.train_examples},
              {"test_examples", o.test_examples},
              {"warmup_steps", o.warmup_steps},
              {"lr_decay", o.lr_decay},
              {"run", o.run}};
  // The plan's and the optimizer's keys as PlanOptions and OptimizerOptions write them (the
  // values the run uses: the optimizer's defaults where no flag gave one): a user's own program
  // reads the same.
  config.update(Json(o.plan));
  config.update(Json(o.optimizer));
  if (o.data.empty()) {
    config["data_dir"] = data_dir_of(o).string();
  } else {
    config.update(data_to_json(o));
  }
  const auto model = model_options_of(o);
  config["model_options"] = {{"in_channels", model.in_channels},
                             {"image_size", model.image_size},
                             {"num_classes", model.num_classes},
                             {"depth", model.depth},
                             {"width", model.width},
                             {"heads", model.heads},
                             {"vocab_size", model.vocab_size},
                             {"context", model.context},
                             {"tie_embeddings", model.tie_embeddings},
                             {"deferred_init", o.deferred_init}};
  if (o.schedule) {
    config["lr_schedule"] = {{"warmup_steps", o.schedule->warmup_steps},
                             {"warmup_type", o.schedule->warmup_type},
                             {"warmup_start_ratio", o.schedule->warmup_start_ratio},
                             {"decay", o.schedule->decay},
                             {"total_steps", o.schedule->total_steps}};
  }
  return config;
}

void apply_deepspeed_config(TrainOptions& o) {
  if (o.deepspeed.empty()) return;
  const auto ds = load_deepspeed_config(o.deepspeed, o.workers, o.plan, o.optimizer);
  o.batch_size = ds.micro_batch_size;
  o.schedule = ds.schedule;
}

ScalingConfig scaling_of(const TrainOptions& o) {
  return ScalingConfig{
      .num_workers = o.workers,
      .min_workers = o.min_workers,
      .use_gpu = o.use_gpu,
      .resources_per_worker = {.cpu_threads = o.threads, .gpus = o.gpus_per_worker},
      .backend = o.backend,
      .on_world_size_change = train::linear_lr_scaling,
      .num_parameter_servers = o.parameter_servers,
      .mesh = {.pp = o.plan.pp, .tp = o.plan.tp}};
}

RunConfig run_config_of(const TrainOptions& o) {
  auto run = o.run.run_config(o.max_steps);
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
  const auto data = c.value("data", std::string());
  const auto [input_column, target_column] = columns_of(data);
  train::EpochLoopOptions loop{
      .epochs = c["epochs"].get<int>(),
      .batch_size = c["batch_size"].get<int64_t>(),
      .input_column = input_column,
      .target_column = target_column,
      .max_steps = c["max_steps"].get<int64_t>(),
      .test_set = test_set_of(c),
      // A language model's rows are sequences: its throughput is reported in tokens too.
      .tokens_per_row = is_text_data(data) ? model_options_of(c).context : 0};
  // The checkpoints' and snapshots' cadence, and asynchronous saves.
  c["run"].get<RunOptions>().apply(loop);
  // Every rank the same weights (the same seed; rank 0's), then the optimizer over them (with
  // ZeRO, the engine that shards it). The decay spans every epoch (--max-steps stops a run early
  // without changing its schedule, so that a run stopped and resumed follows the schedule of one
  // never stopped).
  auto model = train::parallelize(
      models::model_spec(c["model"], model_options_of(c), c["seed"].get<uint64_t>()),
      [&](std::vector<at::Tensor> params) {
        return optim::make_optimizer(c.get<optim::OptimizerOptions>(), std::move(params));
      },
      models::logits_cross_entropy, plan,
      schedule_of(c, loop.epochs * train::steps_per_epoch(train_stream, loop.batch_size, plan)));
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
                "gpt: an output head of its own instead of the token embedding's weight (needed "
                "to cut it into pipeline stages with --pp)");
  cmd->add_option("--dataset", o.dataset, "fashion-mnist or mnist")->capture_default_str();
  cmd->add_option("--data-dir", o.data_dir,
                  "folder with the four IDX files (default for fashion-mnist: " +
                      data::default_fashion_mnist_dir().string() + ")");
  cmd->add_option("--data", o.data,
                  "your own data instead: images:DIR (a sub-folder per class, or train/ and "
                  "test/ folders of them), csv:FILE (numbers, a header line; with --label); for "
                  "--model gpt text:FILE (its bytes as tokens, the last --test-size held out) or "
                  "random-tokens:ROWS");
  cmd->add_option("--label", o.label, "with --data csv:FILE: the class column (0, 1, ...)");
  cmd->add_option("--image-size", o.image_size,
                  "with --data images:DIR: each image resized to this square")
      ->capture_default_str();
  cmd->add_option("--test-size", o.test_size,
                  "with --data: the fraction held out for evaluation where the data has no "
                  "test split (seeded by --seed)")
      ->capture_default_str();
  cmd->option_defaults()->group("Workers and devices");
  cmd->add_option("--workers", o.workers, "worker processes")->capture_default_str();
  cmd->add_option(
         "--min-workers", o.min_workers,
         "elastic: after a failure restart with as few as this many workers (the lr scaled "
         "linearly), growing back when slots are free; with --pp/--tp a multiple of pp x tp; "
         "0: always --workers")
      ->capture_default_str();
  cmd->add_option("--threads", o.threads, "CPU threads per worker")->capture_default_str();
  add_bool_flag(cmd, "--use-gpu", o.use_gpu,
                "train on GPUs: each worker gets its own (CUDA_VISIBLE_DEVICES)");
  cmd->add_option("--gpus-per-worker", o.gpus_per_worker,
                  "GPUs of each worker with --use-gpu (0: 1)")
      ->capture_default_str();
  cmd->add_option(
         "--backend", o.backend,
         "collectives: auto (Gloo for CPU tensors, NCCL for CUDA ones), gloo (also for CUDA "
         "tensors, e.g. workers sharing a GPU) or nccl")
      ->capture_default_str();
  cmd->option_defaults()->group("Training");
  cmd->add_option("--epochs", o.epochs, "passes over the training set")->capture_default_str();
  cmd->add_option("--batch-size", o.batch_size, "examples per step per worker")
      ->capture_default_str();
  add_optimizer_options(cmd, o.optimizer);
  cmd->add_option("--warmup-steps", o.warmup_steps, "linear lr warmup over this many steps")
      ->capture_default_str();
  cmd->add_option("--lr-decay", o.lr_decay,
                  "after the warmup: none, cosine or linear (to 0 at the end of the last epoch)")
      ->capture_default_str();
  cmd->add_option("--seed", o.seed, "seed for weights and data order")->capture_default_str();
  cmd->add_option("--max-steps", o.max_steps,
                  "stop after this many optimizer steps in all (0: no limit), with a checkpoint "
                  "that a run with more steps resumes from")
      ->capture_default_str();
  cmd->add_option("--memory-budget", o.memory_budget_gb,
                  "GB per worker: refuse, before any worker starts, a plan that `cohort estimate` "
                  "says needs more, naming its largest item and the option that shrinks it (0: "
                  "no check)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--train-examples", o.train_examples,
                  "train on the first N examples only (0: all)")
      ->capture_default_str()
      ->group("Model and data");
  cmd->add_option("--test-examples", o.test_examples,
                  "evaluate on the first N test examples only (0: all)")
      ->capture_default_str()
      ->group("Model and data");
  add_plan_options(cmd, o.plan);
  cmd->add_option("--parameter-servers", o.parameter_servers,
                  "with --sync async-ps:K: parameter servers, each holding a shard of the "
                  "parameters and optimizer state, in the first workers' processes (1 to "
                  "--workers; 0: one)")
      ->capture_default_str();
  cmd->add_option("--deepspeed", o.deepspeed,
                  "a DeepSpeed JSON config: its batch sizes, optimizer, scheduler, fp16/bf16, "
                  "gradient_clipping and zero_optimization replace those options");
  cmd->add_option(
         "--data-workers", o.data_workers,
         "preprocessing processes per worker for the training data (0: the worker's own prefetch "
         "thread; -1: one per CPU the workers leave free)")
      ->capture_default_str()
      ->group("Model and data");
  cmd->option_defaults()->group("Run directory and recovery");
  add_config_option(cmd, o.config_file);
  add_run_options(cmd, o.run);
}

}  // namespace cohort::cli

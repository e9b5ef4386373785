#include "cohort/cli/plan_options.h"

#include <iostream>

#include "cli/bool_flag.h"
#include "cohort/error.h"
#include "cohort/json.h"
#include "cohort/parallel/activation_checkpointing_policy.h"

namespace cohort::cli {

parallel::SyncMode PlanOptions::sync_mode() const {
  auto mode = parallel::parse_sync_mode(sync);
  auto* diloco = std::get_if<parallel::DiLoCo>(&mode);
  if (diloco == nullptr && (outer_lr || outer_momentum || !nesterov)) {
    throw UsageError(
        "--outer-lr, --outer-momentum and --no-nesterov set DiLoCo's outer optimizer: use them "
        "with --sync diloco:H, not --sync " +
        sync);
  }
  if (diloco != nullptr) {
    if (outer_lr) diloco->outer_lr = *outer_lr;
    if (outer_momentum) diloco->outer_momentum = *outer_momentum;
    diloco->nesterov = nesterov;
  }
  try {
    parallel::validate(mode);
  } catch (const UsageError& e) {
    throw UsageError("--sync " + sync + " with --outer-lr / --outer-momentum: " + e.what());
  }
  return mode;
}

train::DeepSpeedConfig load_deepspeed_config(const std::string& file, int world_size,
                                             PlanOptions& options) {
  auto ds = train::DeepSpeedConfig::load(file, world_size);
  if (!ds.unknown_keys.empty()) {
    std::string keys;
    for (const auto& k : ds.unknown_keys) keys += (keys.empty() ? "" : ", ") + k;
    std::cerr << "warning: " << file
              << ": ignoring keys cohort does not know or cannot honour: " << keys << std::endl;
  }
  options.gradient_accumulation_steps = ds.gradient_accumulation_steps;
  options.precision = ds.precision;
  options.loss_scaler = ds.loss_scaler;
  options.gradient_clipping = ds.gradient_clipping;
  options.zero = ds.zero;
  if (ds.offload_optimizer != "none" && options.offload_optimizer == "none")
    options.offload_optimizer = ds.offload_optimizer;
  // The block checkpoints every unit, unless the options chose.
  if (ds.activation_checkpointing.enabled() && options.activation_checkpointing == "none")
    options.activation_checkpointing = parallel::to_string(ds.activation_checkpointing);
  return ds;
}

train::Plan PlanOptions::plan(int world_size) const {
  train::Plan plan{.pp = pp,
                   .tp = tp,
                   .zero = zero,
                   .sync = sync_mode(),
                   .precision = optim::precision_from_string(precision),
                   .loss_scaler = loss_scaler,
                   .gradient_accumulation_steps = gradient_accumulation_steps,
                   .gradient_clipping = gradient_clipping,
                   .cuda_graph = cuda_graph,
                   .schedule = parallel::pipeline::schedule_from_string(schedule),
                   .micro_batches = micro_batches,
                   .activation_checkpointing =
                       parallel::parse_activation_checkpointing(activation_checkpointing),
                   .offload_optimizer = train::parse_optimizer_offload(offload_optimizer)};
  plan.validate(world_size);
  return plan;
}

void to_json(Json& j, const PlanOptions& o) {
  j = Json{{"pp", o.pp},
           {"tp", o.tp},
           {"micro_batches", o.micro_batches},
           {"schedule", o.schedule},
           {"zero",
            {{"stage", o.zero.stage},
             {"reduce_bucket_size", o.zero.reduce_bucket_size},
             {"allgather_bucket_size", o.zero.allgather_bucket_size},
             {"overlap_comm", o.zero.overlap_comm},
             {"prefetch_bucket_size", o.zero.prefetch_bucket_size},
             {"max_live_parameters", o.zero.max_live_parameters},
             {"param_persistence_threshold", o.zero.param_persistence_threshold},
             {"shard_group_size", o.zero.shard_group_size}}},
           {"sync", o.sync},
           {"nesterov", o.nesterov},
           {"gradient_accumulation_steps", o.gradient_accumulation_steps},
           {"gradient_clipping", o.gradient_clipping},
           {"cuda_graph", o.cuda_graph},
           {"precision", o.precision},
           {"activation_checkpointing", o.activation_checkpointing},
           {"offload_optimizer", o.offload_optimizer},
           {"loss_scaler", o.loss_scaler}};
  if (o.outer_lr) j["outer_lr"] = *o.outer_lr;
  if (o.outer_momentum) j["outer_momentum"] = *o.outer_momentum;
}

void from_json(const Json& j, PlanOptions& o) {
  const PlanOptions d;
  o.pp = json_field(j, "pp", d.pp);
  o.tp = json_field(j, "tp", d.tp);
  o.micro_batches = json_field(j, "micro_batches", d.micro_batches);
  o.schedule = json_field(j, "schedule", d.schedule);
  const Json zero = j.contains("zero") ? j["zero"] : Json::object();
  o.zero.stage = json_field(zero, "stage", d.zero.stage);
  o.zero.reduce_bucket_size = json_field(zero, "reduce_bucket_size", d.zero.reduce_bucket_size);
  o.zero.allgather_bucket_size =
      json_field(zero, "allgather_bucket_size", d.zero.allgather_bucket_size);
  o.zero.overlap_comm = json_field(zero, "overlap_comm", d.zero.overlap_comm);
  o.zero.prefetch_bucket_size =
      json_field(zero, "prefetch_bucket_size", d.zero.prefetch_bucket_size);
  o.zero.max_live_parameters = json_field(zero, "max_live_parameters", d.zero.max_live_parameters);
  o.zero.param_persistence_threshold =
      json_field(zero, "param_persistence_threshold", d.zero.param_persistence_threshold);
  o.zero.shard_group_size = json_field(zero, "shard_group_size", d.zero.shard_group_size);
  o.sync = json_field(j, "sync", d.sync);
  if (j.contains("outer_lr")) o.outer_lr = json_field(j, "outer_lr", 0.0);
  if (j.contains("outer_momentum")) o.outer_momentum = json_field(j, "outer_momentum", 0.0);
  o.nesterov = json_field(j, "nesterov", d.nesterov);
  o.gradient_accumulation_steps =
      json_field(j, "gradient_accumulation_steps", d.gradient_accumulation_steps);
  o.gradient_clipping = json_field(j, "gradient_clipping", d.gradient_clipping);
  o.cuda_graph = json_field(j, "cuda_graph", d.cuda_graph);
  o.precision = json_field(j, "precision", d.precision);
  o.loss_scaler = json_field(j, "loss_scaler", d.loss_scaler);
  o.activation_checkpointing =
      json_field(j, "activation_checkpointing", d.activation_checkpointing);
  o.offload_optimizer = json_field(j, "offload_optimizer", d.offload_optimizer);
}

void add_plan_options(CLI::App* cmd, PlanOptions& o) {
  cmd->option_defaults()->group("Training");
  cmd->add_option("--precision", o.precision,
                  "fp32, bf16 (CPU or GPU: bfloat16 autocast) or fp16 (GPU: float16 autocast with "
                  "dynamic loss scaling)")
      ->capture_default_str();
  cmd->add_option("--gradient-accumulation-steps", o.gradient_accumulation_steps,
                  "micro-batches of --batch-size per optimizer step, communicating after the "
                  "last only (with --pp/--tp: one pipeline step over all their micro-batches)")
      ->capture_default_str();
  cmd->add_option("--gradient-clipping", o.gradient_clipping,
                  "clip the gradients' global L2 norm to this (0: no clipping)")
      ->capture_default_str();
  cmd->add_option(
         "--activation-checkpointing", o.activation_checkpointing,
         "recompute the forward of the model's units in backward instead of keeping "
         "their activations: none, every:K (every K-th unit; every:1 all of them but, without a "
         "pipeline, the last, which backward would recompute at once) or "
         "layers:NAME[,NAME...] (units by name, e.g. layers.3, or type, e.g. "
         "BasicBlock); less memory for about one more forward per step")
      ->capture_default_str();
  cmd->add_option("--offload-optimizer", o.offload_optimizer,
                  "where the optimizer state lives: none (with the parameters), cpu (host "
                  "memory, updated there while the parameters stay on the GPU; on CPU runs it is "
                  "there already) or disk:PATH (files in the folder "
                  "PATH, streamed through a chunk at a time: state larger than memory steps; "
                  "checked for room before any worker starts)")
      ->capture_default_str();
  add_bool_flag(
      cmd, "--cuda-graph", o.cuda_graph,
      "capture each training step (forward, backward, all-reduce, optimizer) as one CUDA graph "
      "and replay it: GPU, NCCL, the flat optimizer, one micro-batch per step; a step that "
      "cannot be captured runs eagerly, its reason printed");
  cmd->option_defaults()->group("Parallelism and synchronisation");
  cmd->add_option("--zero-stage", o.zero.stage,
                  "ZeRO: 0 (DDP), 1 (optimizer state sharded over the workers), 2 (gradients "
                  "too) or 3 (parameters too: the model's layers gathered around their forward "
                  "and backward); with --pp/--tp, over each stage's data-parallel group")
      ->capture_default_str();
  cmd->add_option("--shard-group-size", o.zero.shard_group_size,
                  "with --zero-stage 1-3 (HSDP): shard over groups of this many data-parallel "
                  "workers and replicate across the groups (a reduce-scatter inside a group, an "
                  "all-reduce across); 0: shard over all of them. Must divide the data-parallel "
                  "workers")
      ->capture_default_str();
  cmd->add_option("--sync", o.sync,
                  "how the workers agree: ddp (gradients averaged every step), local-sgd:H "
                  "(parameters averaged every H steps) or diloco:H (every H steps an outer "
                  "Nesterov SGD step on the averaged parameter change); H >= 1; or async-ps:K "
                  "(an asynchronous parameter server: workers push gradients and pull "
                  "parameters without waiting for each other, at most K steps ahead of the "
                  "slowest; K >= 0). All but ddp also synchronise at the end of every epoch")
      ->capture_default_str();
  cmd->add_option(
      "--outer-lr", o.outer_lr,
      "DiLoCo's outer learning rate (default: " + Json(parallel::DiLoCo{}.outer_lr).dump() + ")");
  cmd->add_option(
      "--outer-momentum", o.outer_momentum,
      "DiLoCo's outer momentum (default: " + Json(parallel::DiLoCo{}.outer_momentum).dump() + ")");
  add_bool_flag(cmd, "--nesterov,!--no-nesterov", o.nesterov,
                "DiLoCo's outer momentum: Nesterov's (default) or plain");
  cmd->add_option("--pp", o.pp,
                  "pipeline parallelism: cut the model into this many stages, each on its own "
                  "worker; the workers form pipelines of --pp x --tp")
      ->capture_default_str();
  cmd->add_option("--tp", o.tp,
                  "tensor parallelism: cut the model's tensor-parallel layers over this many "
                  "workers; --workers / (pp x tp) pipelines train data-parallel, the global "
                  "batch --batch-size x that")
      ->capture_default_str();
  cmd->add_option("--micro-batches", o.micro_batches,
                  "micro-batches each batch is split into along a pipeline (0: 2 x --pp)")
      ->capture_default_str();
  cmd->add_option("--schedule", o.schedule,
                  "the pipeline schedule: gpipe, 1f1b, interleaved (2 stages per worker) or "
                  "zero-bubble (backward split into input and weight gradients)")
      ->capture_default_str();
}

train::DeepSpeedConfig load_deepspeed_config(const std::string& file, int world_size,
                                             PlanOptions& options,
                                             optim::OptimizerOptions& optimizer) {
  auto ds = load_deepspeed_config(file, world_size, options);
  if (ds.optimizer) optimizer.algorithm = *ds.optimizer;
  if (ds.lr) optimizer.lr = *ds.lr;
  if (ds.weight_decay) optimizer.weight_decay = ds.weight_decay;
  if (ds.momentum) optimizer.momentum = *ds.momentum;
  optimizer.nesterov = ds.nesterov;
  if (ds.betas) optimizer.betas = ds.betas;
  if (ds.eps) optimizer.eps = ds.eps;
  return ds;
}

void add_optimizer_options(CLI::App* cmd, optim::OptimizerOptions& o) {
  const auto group = cmd->option_defaults()->get_group();
  cmd->option_defaults()->group("Training");
  cmd->add_option("--optimizer", o.algorithm, "sgd (with momentum), adam or adamw")
      ->capture_default_str();
  cmd->add_option("--lr", o.lr, "learning rate (default: 0.02 for sgd, 0.001 for adam and adamw)");
  cmd->add_option("--momentum", o.momentum, "SGD momentum")->capture_default_str();
  add_bool_flag(cmd, "--sgd-nesterov", o.nesterov, "SGD with Nesterov momentum");
  cmd->add_option("--weight-decay", o.weight_decay,
                  "weight decay (default: 0; for adamw 0.01, decoupled)");
  add_bool_flag(cmd, "--flat-optimizer,!--no-flat-optimizer", o.flat,
                "step with cohort's flat optimizer (parameters, gradients and state in contiguous "
                "buffers; default) or libtorch's torch::optim");
  cmd->option_defaults()->group(group);
}

}  // namespace cohort::cli

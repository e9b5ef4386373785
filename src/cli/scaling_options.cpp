#include "cohort/cli/scaling_options.h"

#include <variant>

#include "cli/bool_flag.h"
#include "cohort/error.h"
#include "cohort/optim/precision.h"

namespace cohort::cli {

const OptionNames kScalingFlagNames{
    {"ScalingConfig.num_workers", "--workers"},
    {"ScalingConfig.min_workers", "--min-workers"},
    {"ScalingConfig.num_parameter_servers", "--parameter-servers"},
    {"ScalingConfig.mesh", "--pp/--tp"},
    {"ScalingConfig.mesh.pp", "--pp"},
    {"ScalingConfig.mesh.tp", "--tp"},
    {"ScalingConfig.resources_per_worker.cpu_threads", "--threads"}};

ScalingConfig ScalingOptions::scaling_config(const train::Plan& plan) const {
  const auto& o = *this;
  if (o.gpus_per_worker < 0) {
    throw UsageError("--gpus-per-worker " + std::to_string(o.gpus_per_worker) + " must be >= 0");
  }
  if (o.gpus_per_worker > 0 && !o.use_gpu) {
    throw UsageError("--gpus-per-worker " + std::to_string(o.gpus_per_worker) + " needs --use-gpu");
  }
  if (!o.use_gpu && plan.precision)
    optim::check_precision_supported(*plan.precision, c10::Device(c10::kCPU));
  if (plan.cuda_graph) {
    // What a captured step needs of the workers: a GPU and NCCL.
    if (!o.use_gpu) {
      throw UsageError(
          "--cuda-graph needs --use-gpu: CUDA graphs capture GPU work (drop --cuda-graph)");
    }
    if (o.backend == "gloo") {
      throw UsageError(
          "--cuda-graph needs NCCL's collectives (--backend auto or nccl): Gloo's cannot be "
          "captured");
    }
  }
  if (o.parameter_servers > 0 &&
      !std::holds_alternative<parallel::AsyncParameterServer>(plan.sync)) {
    throw UsageError("--parameter-servers " + std::to_string(o.parameter_servers) +
                     " with --sync " + parallel::to_string(plan.sync) +
                     ": parameter servers serve only --sync async-ps:K (K: steps a worker may "
                     "run ahead of the slowest)");
  }
  ScalingConfig scaling{
      .num_workers = o.workers,
      .min_workers = o.min_workers,
      .use_gpu = o.use_gpu,
      .resources_per_worker = {.cpu_threads = o.threads, .gpus = o.gpus_per_worker},
      .backend = o.backend,
      .num_parameter_servers = o.parameter_servers,
      .mesh = {.pp = plan.pp, .tp = plan.tp}};
  check_configs(scaling, RunConfig{}, kScalingFlagNames);
  return scaling;
}

void add_scaling_options(CLI::App* cmd, ScalingOptions& o) {
  const auto group = "Workers and devices";
  cmd->add_option("--workers", o.workers, "worker processes")->capture_default_str()->group(group);
  cmd->add_option(
         "--min-workers", o.min_workers,
         "elastic: after a failure restart with as few as this many workers (the lr scaled "
         "linearly), growing back when slots are free; with --pp/--tp a multiple of pp x tp; "
         "0: always --workers")
      ->capture_default_str()
      ->group(group);
  cmd->add_option("--threads", o.threads, "CPU threads per worker")
      ->capture_default_str()
      ->group(group);
  add_bool_flag(cmd, "--use-gpu", o.use_gpu,
                "train on GPUs: each worker gets its own (CUDA_VISIBLE_DEVICES)")
      ->group(group);
  cmd->add_option("--gpus-per-worker", o.gpus_per_worker,
                  "GPUs of each worker with --use-gpu (0: 1)")
      ->capture_default_str()
      ->group(group);
  cmd->add_option(
         "--backend", o.backend,
         "collectives: auto (Gloo for CPU tensors, NCCL for CUDA ones), gloo (also for CUDA "
         "tensors, e.g. workers sharing a GPU) or nccl")
      ->capture_default_str()
      ->group(group);
  cmd->add_option("--parameter-servers", o.parameter_servers,
                  "with --sync async-ps:K: parameter servers, each holding a shard of the "
                  "parameters and optimizer state, in the first workers' processes (1 to "
                  "--workers; 0: one)")
      ->capture_default_str()
      ->group(group);
}

}  // namespace cohort::cli

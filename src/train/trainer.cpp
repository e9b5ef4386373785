#include "cohort/train/trainer.h"

#include <algorithm>

#include "cohort/comm/process_group.h"
#include "cohort/data/data_iterator.h"
#include "cohort/error.h"
#include "cohort/runtime/gpus.h"
#include "cohort/runtime/worker_info.h"
#include "train/driver.h"

namespace cohort {

void check_configs(const ScalingConfig& scaling, const RunConfig& run, const OptionNames& names) {
  // The option's name in messages: the program's, else `shown` (default: the field).
  const auto name = [&names](const std::string& field, const std::string& shown = "") {
    const auto it = names.find(field);
    return it != names.end() ? it->second : shown.empty() ? field : shown;
  };
  const auto workers =
      name("ScalingConfig.num_workers") + " " + std::to_string(scaling.num_workers);
  if (scaling.num_workers < 1) throw UsageError(workers + " must be >= 1");
  if (scaling.min_workers < 0 || scaling.min_workers > scaling.num_workers) {
    throw UsageError(name("ScalingConfig.min_workers") + " " + std::to_string(scaling.min_workers) +
                     " must be between 1 and " + workers + " (0: a fixed-size group)");
  }
  if (scaling.num_parameter_servers < 0 || scaling.num_parameter_servers > scaling.num_workers) {
    throw UsageError(name("ScalingConfig.num_parameter_servers") + " " +
                     std::to_string(scaling.num_parameter_servers) + " must be between 0 and " +
                     workers +
                     ": the servers run in the worker processes, at most one per worker (0: one)");
  }
  if (const auto& mesh = scaling.mesh; mesh.pp < 1 || mesh.tp < 1 || mesh.dp < 0) {
    throw UsageError(name("ScalingConfig.mesh") + " " + parallel::to_string(mesh) +
                     ": pp and tp must be >= 1, dp >= 0 (0: the workers that pp x tp leave)");
  } else if (const int replica = mesh.pp * mesh.tp; replica > 1 && scaling.min_workers > 0) {
    // An elastic mesh shrinks and grows by whole model replicas: only its dp degree changes.
    const auto min_workers =
        name("ScalingConfig.min_workers") + " " + std::to_string(scaling.min_workers);
    if (mesh.dp > 0) {
      throw UsageError(min_workers + " with the mesh " + parallel::to_string(mesh) +
                       ": an elastic group changes its dp degree; leave mesh.dp at 0 (the "
                       "workers that pp x tp leave)");
    }
    if (scaling.min_workers % replica != 0) {
      throw UsageError(min_workers + " with " + name("ScalingConfig.mesh.pp", "pp") + " " +
                       std::to_string(mesh.pp) + " x " + name("ScalingConfig.mesh.tp", "tp") + " " +
                       std::to_string(mesh.tp) + ": an elastic group keeps whole replicas of " +
                       std::to_string(replica) + " workers; use a multiple of " +
                       std::to_string(replica));
    }
  }
  if (scaling.resources_per_worker.cpu_threads < 1) {
    throw UsageError(name("ScalingConfig.resources_per_worker.cpu_threads") + " " +
                     std::to_string(scaling.resources_per_worker.cpu_threads) + " must be >= 1");
  }
  comm::backend_from_string(scaling.backend);
  {
    const auto precision = optim::precision_from_string(scaling.precision);
    if (!scaling.use_gpu) optim::check_precision_supported(precision, c10::Device(c10::kCPU));
    scaling.loss_scaler.validate();
  }
  if (scaling.resources_per_worker.gpus < 0 ||
      (!scaling.use_gpu && scaling.resources_per_worker.gpus > 0)) {
    runtime::check_gpu_request(scaling.use_gpu, scaling.resources_per_worker.gpus, 0, {});
  }
  if (run.umask < 0 || run.umask > 0777) {
    char octal[32];
    std::snprintf(octal, sizeof octal, "%o", static_cast<unsigned>(run.umask));
    throw UsageError(name("RunConfig.umask") + " 0" + std::string(octal) +
                     " is no umask: give permission bits between 0 and 0777 (octal, e.g. 077 to "
                     "keep the run private, 022 to let others read it)");
  }
  if (run.setup_timeout.count() <= 0 || run.collective_timeout.count() <= 0) {
    throw UsageError(name("RunConfig.setup_timeout") + " and " +
                     name("RunConfig.collective_timeout") + " must be > 0");
  }
  if (const auto& p = run.profile_steps;
      !(p.first == 0 && p.last == 0) && !(p.first >= 1 && p.last >= p.first)) {
    throw UsageError(name("RunConfig.profile_steps") + " {" + std::to_string(p.first) + ", " +
                     std::to_string(p.last) +
                     "}: give 1 <= first <= last (e.g. {100, 110}), or {0, 0} for none");
  }
  if (run.log_every_steps < 0) {
    throw UsageError(name("RunConfig.log_every_steps") + " " + std::to_string(run.log_every_steps) +
                     " must be >= 0 (0: about every 15 seconds)");
  }
  if (run.failure_config.max_failures < -1) {
    throw UsageError(name("FailureConfig.max_failures") + " " +
                     std::to_string(run.failure_config.max_failures) +
                     " must be >= 0, or -1 for unlimited");
  }
  if (const auto& failure = run.failure_config;
      failure.recovery == FailureConfig::Recovery::kLive && !failure.replace_lost &&
      (scaling.min_workers == 0 || scaling.min_workers >= scaling.num_workers)) {
    // Without replacements the group can only shrink, which a fixed-size group never does.
    const int fewer = std::max(1, scaling.num_workers - 1);
    throw UsageError(name("FailureConfig.recovery") + " live with " +
                     name("FailureConfig.replace_lost", "FailureConfig.replace_lost false") +
                     " goes on with fewer workers: give " + name("ScalingConfig.min_workers") +
                     " below " + workers + " (e.g. " + name("ScalingConfig.min_workers") + " " +
                     std::to_string(fewer) +
                     "), or let a replacement take the lost worker's place");
  }
  if (run.failure_config.heartbeat_timeout.count() <= 0) {
    throw UsageError(name("FailureConfig.heartbeat_timeout") + " must be > 0 (got " +
                     std::to_string(run.failure_config.heartbeat_timeout.count()) + " ms)");
  }
}

Trainer::Trainer(TrainLoop train_loop, ScalingConfig scaling_config, RunConfig run_config,
                 Json train_loop_config, std::map<std::string, data::Dataset> datasets)
    : train_loop_(std::move(train_loop)),
      scaling_(scaling_config),
      run_(std::move(run_config)),
      config_(std::move(train_loop_config)),
      datasets_(std::move(datasets)) {
  if (!train_loop_) throw UsageError("Trainer: the train loop function is empty");
  check_configs(scaling_, run_);
}

bool is_driver(const RunConfig& run) {
  const auto role = runtime::spawned_role();
  if (role == runtime::kJobHostRole) return true;
  if (role == runtime::kWorkerRole || role == runtime::kDataWorkerRole) return false;
  if (const auto launch = runtime::detect_launch())
    return launch->world_rank == 0 && !train::job_host_keeps_run(run, *launch);
  return true;  // the local driver, or a Tuner's trial, which drives its Trainer
}

Result Trainer::fit() {
  if (runtime::spawned_role() == data::kDataRole) train::serve_dataset_shard(datasets_);
  if (runtime::is_spawned_worker()) train::run_worker(train_loop_, scaling_, datasets_);
  if (runtime::spawned_role() == runtime::kJobHostRole)
    return train::host_launched_run(scaling_, run_, config_);
  if (auto launch = runtime::detect_launch()) {
    return train::run_launched(train_loop_, scaling_, run_, config_, datasets_, *launch);
  }
  // Under a launcher the world's size is the launcher's: the worker checks the mesh against it.
  parallel::resolve_mesh(scaling_.mesh, scaling_.num_workers);
  return train::run_driver(scaling_, run_, config_);
}

}  // namespace cohort

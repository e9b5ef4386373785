#include "train/worker_spec.h"

#include <unistd.h>

#include <cstdlib>
#include <type_traits>

#include "cohort/error.h"
#include "cohort/runtime/environment.h"
#include "cohort/runtime/process.h"

namespace cohort::train {
namespace {

constexpr int kFormat = 2;

template <typename T>
T field(const Json& spec, const char* key) {
  if (!spec.contains(key)) {
    throw UsageError(std::string("worker spec: field '") + key + "' is missing");
  }
  if constexpr (std::is_arithmetic_v<T>) {
    // Checked for its type and range: nlohmann's get() would narrow a number that does not fit
    // (undefined for a float past the integer's range).
    if (!spec.at(key).is_null()) {
      try {
        return json_field<T>(spec, key, T{});
      } catch (const UsageError& e) {
        throw UsageError(std::string("worker spec: ") + e.what());
      }
    }
  }
  try {
    return spec.at(key).get<T>();
  } catch (const UsageError& e) {  // a field of an object, named by its own reader
    throw UsageError(std::string("worker spec: field '") + key + "': " + e.what());
  } catch (const std::exception&) {
    throw UsageError(std::string("worker spec: field '") + key + "' has the wrong type (" +
                     spec.at(key).dump() + ")");
  }
}

// An integer field that must be at least `least`.
template <typename T>
T at_least(const Json& spec, const char* key, T least) {
  const auto value = field<T>(spec, key);
  if (value < least) {
    throw UsageError(std::string("worker spec: ") + key + " = " + std::to_string(value) +
                     ": it must be >= " + std::to_string(least));
  }
  return value;
}

}  // namespace

SessionScaling session_scaling_of(const ScalingConfig& scaling) {
  return {.mesh = scaling.mesh,
          .precision = scaling.precision,
          .loss_scaler = scaling.loss_scaler,
          .num_parameter_servers = scaling.num_parameter_servers,
          .remote_preprocessing_dataset = scaling.remote_preprocessing_dataset};
}

std::string to_text(const WorkerSpec& s) {
  return Json{{"format", kFormat},
              {"build", s.build},
              {"driver_pid", s.driver_pid},
              {"run_token", s.run_token},
              {"config", s.config},
              {"name", s.name},
              {"run_dir", s.run_dir},
              {"run_start_ns", s.run_start_ns},
              {"cpu_threads", s.cpu_threads},
              {"setup_timeout_ms", s.setup_timeout.count()},
              {"collective_timeout_ms", s.collective_timeout.count()},
              {"heartbeat_interval_ms", s.heartbeat.interval.count()},
              {"heartbeat_timeout_ms", s.heartbeat.timeout.count()},
              {"gpus_per_worker", s.gpus_per_worker},
              {"backend", s.backend},
              {"resume_from", s.resume_from},
              {"resume", s.resume},
              {"snapshot_path", s.snapshot_path},
              {"live_recovery", s.live_recovery},
              {"live_round", s.live_round},
              {"live_source", s.live_source},
              {"next_checkpoint_index", s.next_checkpoint_index},
              {"slot", s.slot},
              {"tensorboard_histograms", s.tensorboard_histograms},
              {"profile_first", s.profile_first},
              {"profile_last", s.profile_last},
              {"log_every_steps", s.log_every_steps},
              {"umask", s.umask},
              {"mesh_pp", s.scaling.mesh.pp},
              {"mesh_tp", s.scaling.mesh.tp},
              {"precision", s.scaling.precision},
              {"loss_scaler", s.scaling.loss_scaler},
              {"num_parameter_servers", s.scaling.num_parameter_servers},
              {"remote_preprocessing_dataset", s.scaling.remote_preprocessing_dataset}}
      .dump();
}

WorkerSpec worker_spec_from_text(const std::string& text) {
  Json j;
  try {
    j = Json::parse(text);
  } catch (const std::exception& e) {
    throw UsageError(std::string("worker spec (") + runtime::kWorkerSpecVar +
                     ") is not JSON: " + e.what());
  }
  if (!j.is_object())
    throw UsageError(std::string(runtime::kWorkerSpecVar) + " is not a JSON object");
  if (const int format = field<int>(j, "format"); format != kFormat) {
    throw UsageError("worker spec: format " + std::to_string(format) + ", this program reads " +
                     std::to_string(kFormat) + ": the driver runs another build");
  }
  WorkerSpec s;
  s.build = field<std::string>(j, "build");
  if (const std::string mine = runtime::program_build_id(); s.build != mine) {
    throw UsageError("worker spec: build " + s.build + " is not this program's (" + mine +
                     "): the driver runs another build of the program");
  }
  s.driver_pid = field<int>(j, "driver_pid");
  if (s.driver_pid != ::getppid()) {
    throw UsageError("worker spec: driver_pid " + std::to_string(s.driver_pid) +
                     " is not this process's parent (" + std::to_string(::getppid()) +
                     "): the spec belongs to another run");
  }
  s.run_token = field<std::string>(j, "run_token");
  s.config = field<Json>(j, "config");
  s.name = field<std::string>(j, "name");
  s.run_dir = field<std::string>(j, "run_dir");
  s.run_start_ns = at_least<int64_t>(j, "run_start_ns", 0);
  s.cpu_threads = at_least(j, "cpu_threads", 1);
  s.setup_timeout = std::chrono::milliseconds(at_least<int64_t>(j, "setup_timeout_ms", 1));
  s.collective_timeout =
      std::chrono::milliseconds(at_least<int64_t>(j, "collective_timeout_ms", 1));
  s.heartbeat.interval = std::chrono::milliseconds(field<int64_t>(j, "heartbeat_interval_ms"));
  s.heartbeat.timeout = std::chrono::milliseconds(field<int64_t>(j, "heartbeat_timeout_ms"));
  s.heartbeat.validate();
  s.gpus_per_worker = at_least(j, "gpus_per_worker", 0);
  s.backend = field<std::string>(j, "backend");
  s.resume_from = field<std::string>(j, "resume_from");
  s.resume = field<bool>(j, "resume");
  s.snapshot_path = field<std::string>(j, "snapshot_path");
  s.live_recovery = field<bool>(j, "live_recovery");
  s.live_round = at_least(j, "live_round", 0);
  s.live_source = at_least(j, "live_source", 0);
  s.next_checkpoint_index = at_least<int64_t>(j, "next_checkpoint_index", 0);
  s.slot = at_least(j, "slot", 0);
  s.tensorboard_histograms = field<bool>(j, "tensorboard_histograms");
  s.profile_first = at_least<int64_t>(j, "profile_first", 0);
  s.profile_last = at_least<int64_t>(j, "profile_last", s.profile_first);
  s.log_every_steps = at_least<int64_t>(j, "log_every_steps", 0);
  s.umask = field<int>(j, "umask");
  if (s.umask < 0 || s.umask > 0777) {
    throw UsageError("worker spec: umask = " + std::to_string(s.umask) +
                     ": it must be between 0 and 0777");
  }
  auto& scaling = s.scaling;
  scaling.mesh = {.pp = field<int>(j, "mesh_pp"), .tp = field<int>(j, "mesh_tp")};
  if (scaling.mesh.pp < 1 || scaling.mesh.tp < 1) {
    throw UsageError("worker spec: mesh_pp = " + std::to_string(scaling.mesh.pp) +
                     ", mesh_tp = " + std::to_string(scaling.mesh.tp) + ": both must be >= 1");
  }
  scaling.precision = field<std::string>(j, "precision");
  scaling.loss_scaler = field<optim::LossScalerOptions>(j, "loss_scaler");
  try {  // what the session makes of them, checked here with the rest
    optim::precision_from_string(scaling.precision);
    scaling.loss_scaler.validate();
  } catch (const UsageError& e) {
    throw UsageError(std::string("worker spec: ") + e.what());
  }
  scaling.num_parameter_servers = at_least(j, "num_parameter_servers", 0);
  scaling.remote_preprocessing_dataset = field<std::string>(j, "remote_preprocessing_dataset");
  return s;
}

WorkerSpec worker_spec_from_env() {
  const char* text = std::getenv(runtime::kWorkerSpecVar);
  if (text == nullptr || *text == '\0') {
    throw UsageError(std::string(runtime::kWorkerSpecVar) +
                     " is not set: worker processes are started by cohort's driver");
  }
  return worker_spec_from_text(text);
}

}  // namespace cohort::train

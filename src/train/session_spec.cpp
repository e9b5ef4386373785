#include "train/session_spec.h"

#include "cohort/error.h"
#include "runtime/worker_spec.h"

namespace cohort::train {

SessionScaling session_scaling_of(const ScalingConfig& scaling) {
  return {.mesh = scaling.mesh,
          .precision = scaling.precision,
          .loss_scaler = scaling.loss_scaler,
          .num_parameter_servers = scaling.num_parameter_servers,
          .remote_preprocessing_dataset = scaling.remote_preprocessing_dataset};
}

Json to_json(const SessionSpec& s) {
  return Json{{"config", s.config},
              {"name", s.name},
              {"run_dir", s.run_dir},
              {"run_start_ns", s.run_start_ns},
              {"resume_from", s.resume_from},
              {"resume", s.resume},
              {"snapshot_path", s.snapshot_path},
              {"live_recovery", s.live_recovery},
              {"live_round", s.live_round},
              {"live_source", s.live_source},
              {"next_checkpoint_index", s.next_checkpoint_index},
              {"tensorboard_histograms", s.tensorboard_histograms},
              {"profile_first", s.profile_first},
              {"profile_last", s.profile_last},
              {"log_every_steps", s.log_every_steps},
              {"mesh_pp", s.scaling.mesh.pp},
              {"mesh_tp", s.scaling.mesh.tp},
              {"precision", s.scaling.precision},
              {"loss_scaler", s.scaling.loss_scaler},
              {"num_parameter_servers", s.scaling.num_parameter_servers},
              {"remote_preprocessing_dataset", s.scaling.remote_preprocessing_dataset}};
}

SessionSpec session_spec_from_json(const Json& j) {
  const runtime::SpecFields fields(j, "worker spec: session");
  SessionSpec s;
  s.config = fields.get<Json>("config");
  s.name = fields.get<std::string>("name");
  s.run_dir = fields.get<std::string>("run_dir");
  s.run_start_ns = fields.at_least<int64_t>("run_start_ns", 0);
  s.resume_from = fields.get<std::string>("resume_from");
  s.resume = fields.get<bool>("resume");
  s.snapshot_path = fields.get<std::string>("snapshot_path");
  s.live_recovery = fields.get<bool>("live_recovery");
  s.live_round = fields.at_least("live_round", 0);
  s.live_source = fields.at_least("live_source", 0);
  s.next_checkpoint_index = fields.at_least<int64_t>("next_checkpoint_index", 0);
  s.tensorboard_histograms = fields.get<bool>("tensorboard_histograms");
  s.profile_first = fields.at_least<int64_t>("profile_first", 0);
  s.profile_last = fields.at_least<int64_t>("profile_last", s.profile_first);
  s.log_every_steps = fields.at_least<int64_t>("log_every_steps", 0);
  auto& scaling = s.scaling;
  scaling.mesh = {.pp = fields.get<int>("mesh_pp"), .tp = fields.get<int>("mesh_tp")};
  if (scaling.mesh.pp < 1 || scaling.mesh.tp < 1) {
    throw fields.error("mesh_pp = " + std::to_string(scaling.mesh.pp) +
                       ", mesh_tp = " + std::to_string(scaling.mesh.tp) + ": both must be >= 1");
  }
  scaling.precision = fields.get<std::string>("precision");
  scaling.loss_scaler = fields.get<optim::LossScalerOptions>("loss_scaler");
  try {  // what the session makes of them, checked here with the rest
    optim::precision_from_string(scaling.precision);
    scaling.loss_scaler.validate();
  } catch (const UsageError& e) {
    throw fields.error(e.what());
  }
  scaling.num_parameter_servers = fields.at_least("num_parameter_servers", 0);
  scaling.remote_preprocessing_dataset = fields.get<std::string>("remote_preprocessing_dataset");
  return s;
}

}  // namespace cohort::train

#include "runtime/worker_spec.h"

#include <unistd.h>

#include <cstdlib>

#include "cohort/runtime/environment.h"
#include "cohort/runtime/process.h"

namespace cohort::runtime {
namespace {

// 3: the loop's settings moved into "session".
constexpr int kFormat = 3;

}  // namespace

std::string to_text(const WorkerSpec& s) {
  return Json{{"format", kFormat},
              {"build", s.build},
              {"driver_pid", s.driver_pid},
              {"run_token", s.run_token},
              {"slot", s.slot},
              {"cpu_threads", s.cpu_threads},
              {"setup_timeout_ms", s.setup_timeout.count()},
              {"collective_timeout_ms", s.collective_timeout.count()},
              {"heartbeat_interval_ms", s.heartbeat.interval.count()},
              {"heartbeat_timeout_ms", s.heartbeat.timeout.count()},
              {"gpus_per_worker", s.gpus_per_worker},
              {"backend", s.backend},
              {"umask", s.umask},
              {"session", s.session}}
      .dump();
}

WorkerSpec worker_spec_from_text(const std::string& text) {
  Json j;
  try {
    j = Json::parse(text);
  } catch (const std::exception& e) {
    throw UsageError(std::string("worker spec (") + kWorkerSpecVar + ") is not JSON: " + e.what());
  }
  if (!j.is_object()) throw UsageError(std::string(kWorkerSpecVar) + " is not a JSON object");
  const SpecFields fields(j, "worker spec");
  if (const int format = fields.get<int>("format"); format != kFormat) {
    throw fields.error("format " + std::to_string(format) + ", this program reads " +
                       std::to_string(kFormat) + ": the driver runs another build");
  }
  WorkerSpec s;
  s.build = fields.get<std::string>("build");
  if (const std::string mine = program_build_id(); s.build != mine) {
    throw fields.error("build " + s.build + " is not this program's (" + mine +
                       "): the driver runs another build of the program");
  }
  s.driver_pid = fields.get<int>("driver_pid");
  if (s.driver_pid != ::getppid()) {
    throw fields.error("driver_pid " + std::to_string(s.driver_pid) +
                       " is not this process's parent (" + std::to_string(::getppid()) +
                       "): the spec belongs to another run");
  }
  s.run_token = fields.get<std::string>("run_token");
  s.slot = fields.at_least("slot", 0);
  s.cpu_threads = fields.at_least("cpu_threads", 1);
  s.setup_timeout = std::chrono::milliseconds(fields.at_least<int64_t>("setup_timeout_ms", 1));
  s.collective_timeout =
      std::chrono::milliseconds(fields.at_least<int64_t>("collective_timeout_ms", 1));
  s.heartbeat.interval = std::chrono::milliseconds(fields.get<int64_t>("heartbeat_interval_ms"));
  s.heartbeat.timeout = std::chrono::milliseconds(fields.get<int64_t>("heartbeat_timeout_ms"));
  s.heartbeat.validate();
  s.gpus_per_worker = fields.at_least("gpus_per_worker", 0);
  s.backend = fields.get<std::string>("backend");
  s.umask = fields.get<int>("umask");
  if (s.umask < 0 || s.umask > 0777) {
    throw fields.error("umask = " + std::to_string(s.umask) + ": it must be between 0 and 0777");
  }
  s.session = fields.get<Json>("session");
  if (!s.session.is_object()) throw fields.error("field 'session' is not a JSON object");
  return s;
}

WorkerSpec worker_spec_from_env() {
  const char* text = std::getenv(kWorkerSpecVar);
  if (text == nullptr || *text == '\0') {
    throw UsageError(std::string(kWorkerSpecVar) +
                     " is not set: worker processes are started by cohort's driver");
  }
  return worker_spec_from_text(text);
}

}  // namespace cohort::runtime

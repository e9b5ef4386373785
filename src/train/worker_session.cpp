#include "train/worker_session.h"

#include <chrono>

#include "cohort/error.h"
#include "cohort/runtime/control_channel.h"
#include "cohort/train/prepare.h"
#include "cohort/train/report.h"

namespace cohort::train {
namespace {

std::unique_ptr<WorkerSession>& session_slot() {
  static std::unique_ptr<WorkerSession> session;
  return session;
}

WorkerSession& require_session(const char* what) {
  auto* session = current_session();
  if (session == nullptr) {
    throw RuntimeError(std::string(what) +
                       " was called outside a train loop: call it inside the function given to "
                       "cohort::Trainer");
  }
  return *session;
}

}  // namespace

WorkerSession* current_session() { return session_slot().get(); }

void set_current_session(std::unique_ptr<WorkerSession> session) {
  session_slot() = std::move(session);
}

TrainContext& get_context() { return require_session("cohort::train::get_context()").context; }

void prepare_module(const std::shared_ptr<torch::nn::Module>& module,
                    const PrepareModelOptions& options) {
  auto& session = require_session("cohort::train::prepare_model()");
  if (!module) throw UsageError("prepare_model: the model is null");
  for (const auto& ddp : session.models) {
    if (ddp->module() == module) {
      throw UsageError("prepare_model: this model was already prepared; prepare it once");
    }
  }
  if (options.move_to_device) module->to(session.context.device);
  session.models.push_back(std::make_unique<parallel::DistributedDataParallel>(
      module, session.context.process_group, options.ddp));
}

parallel::DistributedDataParallel& get_ddp(const std::shared_ptr<torch::nn::Module>& module) {
  auto& session = require_session("cohort::train::get_ddp()");
  for (auto& ddp : session.models) {
    if (ddp->module() == module) return *ddp;
  }
  throw UsageError("this model was not passed to cohort::train::prepare_model");
}

data::DataLoader prepare_data_loader(data::TensorDataset dataset, data::DataLoaderOptions options) {
  auto& session = require_session("cohort::train::prepare_data_loader()");
  options.device = session.context.device;
  return data::DataLoader(std::move(dataset), options, session.context.world_rank,
                          session.context.world_size);
}

void report(const Json& metrics) {
  auto& session = require_session("cohort::train::report()");
  if (!metrics.is_object()) {
    throw UsageError("report: metrics must be a JSON object of name -> value, got " + metrics.dump());
  }
  ++session.reports;
  if (!runtime::has_control_channel()) return;
  Json message{{"type", "report"},
               {"rank", session.context.world_rank},
               {"index", session.reports},
               {"metrics", metrics}};
  runtime::send_control_message(message.dump());
}

void report_progress(const Json& progress) {
  auto& session = require_session("cohort::train::report_progress()");
  if (session.context.world_rank != 0 || !runtime::has_control_channel()) return;
  using Clock = std::chrono::steady_clock;
  static Clock::time_point last{};
  const auto now = Clock::now();
  const bool final_step = progress.contains("step") && progress.contains("total") &&
                          progress["step"] == progress["total"];
  if (now - last < std::chrono::milliseconds(200) && !final_step) return;
  last = now;
  runtime::send_control_message(Json{{"type", "progress"}, {"progress", progress}}.dump());
}

}  // namespace cohort::train

#include "train/launched_run.h"

#include <unistd.h>

#include "cohort/error.h"
#include "cohort/runtime/control_channel.h"
#include "cohort/runtime/node_launcher.h"
#include "cohort/runtime/process.h"
#include "cohort/runtime/worker_info.h"
#include "train/driver.h"
#include "train/flight_records.h"
#include "train/worker_session.h"

namespace cohort::train {

std::string program_identity() {
  return runtime::program_build_id() + " on " + runtime::host_name();
}

void check_same_program(const std::string& who, const std::string& identity,
                        const std::string& rank0_identity) {
  if (identity.substr(0, identity.find(' ')) !=
      rank0_identity.substr(0, rank0_identity.find(' '))) {
    throw UsageError(who + " runs a different program (" + identity + ") than rank 0 (" +
                     rank0_identity + "): deploy the same build on every node");
  }
}

void say_at_once(const std::string& line) {
  const std::string said = line + "\n";
  [[maybe_unused]] const auto written = ::write(2, said.data(), said.size());
}

comm::Store join_launched_job(const runtime::LaunchedJobInfo& job, const std::string& who,
                              std::chrono::milliseconds timeout) {
  const auto secret = runtime::job_secret_from_env();
  if (!secret) {
    throw UsageError(who + " got no " + runtime::kJobSecretVar +
                     ": it is started by cohort launch, which passes the job's secret");
  }
  return comm::Store::connect({.host = job.etcd ? job.etcd->host : job.master_addr,
                               .port = job.etcd ? job.etcd->port : job.store_port,
                               .is_server = false,
                               .timeout = timeout,
                               .job_id = job.job_id,
                               .secret = *secret,
                               .etcd = job.etcd.has_value()});
}

LaunchedRun::LaunchedRun(const RunConfig& run, const Json& config, LaunchedRunOptions options)
    : run_(run),
      options_(std::move(options)),
      began_on_disk_(std::filesystem::file_time_type::clock::now()),
      started_wall_(std::chrono::system_clock::now()),
      heartbeat_(heartbeat_options(run)),
      console_(run.verbose) {
  const bool live = run.failure_config.recovery == FailureConfig::Recovery::kLive;
  if (live && options_.rank0_in_process) {
    throw RuntimeError(
        "live recovery under a launcher is kept by cohort launch's job host, not by rank 0");
  }
  recorder_.emplace(run, run.name.empty() ? default_run_name() : run.name, config, console_);
  resume_from_ = recorder_->resume_point(/*restarted=*/options_.restart_round > 0);
  token_ = options_.job_id + "-" + std::to_string(options_.restart_round) + "-" + new_run_token();
  runtime::CoordinatorServerOptions coordinator_options{
      .bind_address = options_.bind_address,
      .world_size = options_.world_size,
      .rank0_in_process = options_.rank0_in_process,
      .heartbeat = heartbeat_,
      .token = token_,
      .secret = options_.store.secret()};
  if (live) {
    LaunchedRegroupsOptions live_options{.store = options_.store.connect_again(),
                                         .world_size = options_.world_size,
                                         .launch_round = options_.restart_round,
                                         .token = token_,
                                         .min_workers = options_.min_workers,
                                         .replace_lost = run.failure_config.replace_lost,
                                         .deadline = run.setup_timeout,
                                         .verbose = run.verbose};
    live_options.next_checkpoint = [this] {
      std::lock_guard lock(bookkeeping_);
      return recorder_->next_checkpoint_index();
    };
    live_options.say = say_at_once;
    regroups_.emplace(std::move(live_options));
    coordinator_options.live = regroups_->hooks();
  }
  coordinator_options.on_message = [this](int index, const Json& message) {
    if (regroups_) regroups_->on_message(index, message);
    if (options_.on_message)
      options_.on_message(regroups_ ? regroups_->rank_of(index) : index, message);
  };
  coordinator_ = std::make_unique<runtime::CoordinatorServer>(std::move(coordinator_options),
                                                              options_.on_verdict);
  if (regroups_) regroups_->attach(coordinator_.get());
}

void LaunchedRun::publish() {
  const std::string round = "job/" + std::to_string(options_.restart_round) + "/";
  options_.store.set(round + "run",
                     Json{{"name", recorder_->name()},
                          {"run_dir", recorder_->run_dir().string()},
                          {"resume_from", resume_from_ ? resume_from_->path().string() : ""},
                          {"next_checkpoint", recorder_->next_checkpoint_index()},
                          {"token", token_},
                          {"coordinator", coordinator_->address()},
                          {"start_ns", std::chrono::duration_cast<std::chrono::nanoseconds>(
                                           started_wall_.time_since_epoch())
                                           .count()}}
                         .dump());
  // The launchers go on without a rank that a signal ends, and start its replacement.
  if (regroups_) options_.store.set(runtime::launch_live_key(options_.restart_round), "1");
  if (run_.verbose >= 1) {
    console_.message(
        "cohort: " +
        (options_.rank0_in_process
             ? "rank 0 of " + std::to_string(options_.world_size) + " (" + options_.launcher + ")"
             : "the job host (pid " + std::to_string(::getpid()) + " on " + runtime::host_name() +
                   ", for " + std::to_string(options_.world_size) + " ranks of " +
                   options_.launcher + ")") +
        " keeps the run directory " + recorder_->run_dir().string());
  }
}

bool LaunchedRun::records(const Json& message) {
  const auto type = message.value("type", std::string{});
  return type == "report" || type == "checkpoint" || type == "restored" || type == "step" ||
         type == "progress";
}

std::string LaunchedRun::record(const Json& message) {
  std::string broken;
  std::lock_guard lock(bookkeeping_);
  if (finished_) return broken;
  const auto type = message.value("type", std::string{});
  if (type == "report") {
    recorder_->on_report(message, broken);
  } else if (type == "checkpoint") {
    recorder_->on_checkpoint(message);
  } else if (type == "restored") {
    recorder_->on_restored(message);
  } else if (type == "step") {
    recorder_->on_step(message);
  } else if (type == "progress") {
    console_.progress(message["progress"]);
  }
  return broken;
}

int LaunchedRun::world_size() { return regroups_ ? regroups_->world_size() : options_.world_size; }

std::optional<Result> LaunchedRun::finish(const std::optional<std::string>& error, int world_size) {
  std::lock_guard lock(bookkeeping_);
  if (finished_) return std::nullopt;
  finished_ = true;
  return write_result(error, world_size);
}

std::optional<Result> LaunchedRun::finish_after(const runtime::Coordinator::Verdict& verdict) {
  {
    std::lock_guard lock(bookkeeping_);
    if (finished_) return std::nullopt;  // the run ended first, taking the verdict as its error
    finished_ = true;
  }
  // Said at once: a launcher may end this process as soon as another rank failed.
  say_at_once("cohort: the coordinator stops the job: " + verdict.reason);
  // Told to stop, every rank writes its flight recorder (rank 0 here, when it is in this
  // process); what they say goes into the error.
  if (options_.rank0_in_process)
    runtime::dump_flight_recorder("the coordinator stops the job: " + verdict.reason);
  const int ranks = world_size();
  const std::string flights =
      flight_report_once_written(run_dir(), ranks, began_on_disk_, flight_dump_grace(heartbeat_));
  if (!flights.empty()) say_at_once("cohort: " + flights);
  std::lock_guard lock(bookkeeping_);
  return write_result(verdict.reason + (flights.empty() ? "" : "; " + flights), ranks);
}

Result LaunchedRun::write_result(const std::optional<std::string>& error, int world_size) {
  coordinator_->finish();
  console_.tick(/*flush_all=*/true);
  if (regroups_) {
    for (const auto& failure : regroups_->failures())
      recorder_->result().failures.push_back(failure);
  }
  return recorder_->finish(
      error, world_size,
      std::chrono::duration<double>(std::chrono::steady_clock::now() - options_.started).count());
}

}  // namespace cohort::train

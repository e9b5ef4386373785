#include "train/driver.h"

#include <torch/cuda.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <set>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <iostream>

#include "cohort/comm/store.h"
#include "cohort/error.h"
#include "cohort/runtime/control_channel.h"
#include "cohort/runtime/worker_group.h"
#include "cohort/runtime/worker_info.h"
#include "train/progress.h"
#include "train/worker_session.h"

namespace cohort::train {
namespace {

using Clock = std::chrono::steady_clock;

std::string default_name() {
  std::time_t now = std::time(nullptr);
  char buffer[64];
  std::strftime(buffer, sizeof buffer, "cohort_%Y-%m-%d_%H-%M-%S", std::localtime(&now));
  return buffer;
}

std::filesystem::path prepare_run_dir(const RunConfig& run, const std::string& name) {
  if (name.find('/') != std::string::npos || name == "." || name == "..") {
    throw UsageError("RunConfig.name '" + name + "' must be a plain folder name (no '/')");
  }
  auto dir = run.storage_path / name;
  std::error_code ec;
  std::filesystem::create_directories(dir / "logs", ec);
  if (ec) {
    throw UsageError("storage path " + run.storage_path.string() + " is not usable (" +
                     ec.message() + "): give a writable --storage-path / RunConfig.storage_path");
  }
  // create_directories succeeds on an existing read-only folder; a real write tells.
  auto probe = dir / ".write_test";
  {
    std::ofstream out(probe);
    out << "ok";
    if (!out) {
      throw UsageError("storage path " + dir.string() +
                       " is not writable: give a writable --storage-path / RunConfig.storage_path");
    }
  }
  std::filesystem::remove(probe, ec);
  return dir;
}

// Written to a temporary name, flushed and renamed: a reader never sees half a file.
void write_file_atomically(const std::filesystem::path& path, const std::string& content) {
  auto tmp = path;
  tmp += ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << content;
    out.flush();
    if (!out) throw RuntimeError("cannot write " + tmp.string());
  }
  std::filesystem::rename(tmp, path);
}

Json result_json(const Result& result) {
  Json out = Json::object();
  for (const auto& [key, value] : result.metrics.items()) out[key] = value;
  out["workers"] = result.workers;
  out["wall_seconds"] = result.wall_seconds;
  out["path"] = result.path.string();
  out["error"] = result.error ? Json(*result.error) : Json(nullptr);
  return out;
}

// The cause first: a rank killed from outside (its peers then fail in their collectives), else
// the first rank whose own code threw, else the first bad exit. The other failures follow.
std::string describe_failure(const runtime::GroupOutcome& outcome,
                             const std::map<int, std::string>& worker_errors,
                             const std::vector<int>& error_order) {
  std::vector<std::string> causes;
  for (const auto& e : outcome.exits) {
    if (e.signal != 0 && !e.stopped_by_driver) causes.push_back(e.describe());
  }
  for (int rank : error_order) {
    causes.push_back("rank " + std::to_string(rank) + " failed: " + worker_errors.at(rank));
  }
  if (causes.empty()) causes.push_back(outcome.failure_reason);
  std::string text = causes.front();
  for (size_t i = 1; i < causes.size(); ++i) text += (i == 1 ? " (then " : "; ") + causes[i];
  return causes.size() > 1 ? text + ")" : text;
}

}  // namespace

Result run_driver(const ScalingConfig& scaling, const RunConfig& run, const Json& config) {
  const auto started = Clock::now();
  const auto started_wall = std::chrono::system_clock::now();
  if (scaling.use_gpu && !torch::cuda::is_available()) {
    throw UsageError("ScalingConfig.use_gpu is set but this libtorch sees no CUDA device: "
                     "unset use_gpu or use a CUDA build of libtorch on a GPU host");
  }
  if (scaling.use_gpu &&
      torch::cuda::device_count() < static_cast<size_t>(scaling.num_workers)) {
    throw UsageError("ScalingConfig.use_gpu with " + std::to_string(scaling.num_workers) +
                     " workers needs that many GPUs; this host has " +
                     std::to_string(torch::cuda::device_count()));
  }
  const std::string name = run.name.empty() ? default_name() : run.name;
  const auto run_dir = prepare_run_dir(run, name);

  auto store = comm::Store::connect(
      {.host = "127.0.0.1", .port = 0, .is_server = true, .timeout = run.setup_timeout});

  runtime::WorkerGroupOptions options;
  options.num_workers = scaling.num_workers;
  options.log_dir = run_dir / "logs";
  const std::string threads = std::to_string(scaling.resources_per_worker.cpu_threads);
  options.env = {
      {kConfigVar, config.dump()},
      {kNameVar, name},
      {kRunDirVar, std::filesystem::absolute(run_dir).string()},
      {kRunStartVar,
       std::to_string(std::chrono::duration_cast<std::chrono::nanoseconds>(
                          started_wall.time_since_epoch())
                          .count())},
      {kThreadsVar, threads},
      {"OMP_NUM_THREADS", threads},
      {"MKL_NUM_THREADS", threads},
      {kSetupTimeoutVar, std::to_string(run.setup_timeout.count())},
      {kCollectiveTimeoutVar, std::to_string(run.collective_timeout.count())},
      {kUseGpuVar, scaling.use_gpu ? "1" : "0"},
  };
  const int port = store.port();
  const int world = scaling.num_workers;
  options.rank_env = [port, world](int rank) {
    runtime::WorkerInfo info{.world_rank = rank,
                             .local_rank = rank,
                             .node_rank = 0,
                             .world_size = world,
                             .local_world_size = world,
                             .master_addr = "127.0.0.1",
                             .master_port = port};
    return runtime::worker_env(info);
  };

  Result result;
  result.path = run_dir;
  result.workers = world;
  Console console(run.verbose);
  std::ofstream metrics_log(run_dir / "metrics.jsonl", std::ios::trunc);
  std::map<int, std::string> worker_errors;
  std::vector<int> error_order;
  std::set<int> consequences;

  runtime::WorkerGroupHandlers handlers;
  handlers.on_output = [&](int rank, int pid, bool is_stderr, const std::string& line) {
    if (run.verbose >= 1 || is_stderr) console.worker_line(rank, pid, is_stderr, line);
  };
  handlers.on_control = [&](int rank, const std::string& line) {
    Json message;
    try {
      message = Json::parse(line);
    } catch (const std::exception& e) {
      console.message("cohort: ignoring a malformed control message from rank " +
                      std::to_string(rank) + ": " + e.what());
      return;
    }
    const auto type = message.value("type", std::string{});
    if (type == "report" && rank == 0) {
      Json record = message["metrics"];
      record["training_iteration"] = message.value("index", int64_t{0});
      record["timestamp"] = std::time(nullptr);
      metrics_log << record.dump() << '\n';
      metrics_log.flush();
      result.metrics_history.push_back(record);
      console.report(message.value("index", int64_t{0}), message["metrics"]);
    } else if (type == "progress") {
      console.progress(message["progress"]);
    } else if (type == "error") {
      if (!worker_errors.count(rank)) {
        error_order.push_back(rank);
        if (message.value("consequence", false)) consequences.insert(rank);
      }
      worker_errors[rank] = message.value("message", std::string{"unknown error"});
    }
  };

  runtime::WorkerGroup group(std::move(options));
  group.start();
  if (run.verbose >= 1) {
    std::string pids;
    for (int pid : group.pids()) pids += (pids.empty() ? "" : " ") + std::to_string(pid);
    console.message("cohort: started " + std::to_string(world) + " worker(s) [pids " + pids +
                    "], run directory " + run_dir.string());
  }
  auto outcome = group.wait(handlers);

  if (!result.metrics_history.empty()) result.metrics = result.metrics_history.back();
  result.wall_seconds = std::chrono::duration<double>(Clock::now() - started).count();
  if (!outcome.success) {
    std::stable_partition(error_order.begin(), error_order.end(),
                          [&](int rank) { return !consequences.count(rank); });
    result.error = describe_failure(outcome, worker_errors, error_order);
  }
  write_file_atomically(run_dir / "result.json", result_json(result).dump(2) + "\n");
  if (outcome.interrupted_by != 0) {
    // Ctrl-C or SIGTERM stops the whole program, as the user asked, now that nothing is left
    // running and the result is on disk.
    std::cout.flush();
    std::signal(outcome.interrupted_by, SIG_DFL);
    std::raise(outcome.interrupted_by);
  }
  return result;
}

namespace {

long env_long(const char* name, long fallback) {
  const char* value = std::getenv(name);
  return value ? std::atol(value) : fallback;
}

}  // namespace

void run_worker(const std::function<void(const Json&)>& train_loop) {
  int code = 0;
  int rank = -1;
  try {
    auto info = runtime::worker_info_from_env();
    if (!info) throw RuntimeError("worker started without RANK/WORLD_SIZE");
    rank = info->world_rank;
    const int threads = static_cast<int>(env_long(kThreadsVar, 1));
    torch::set_num_threads(threads);
    try {
      torch::set_num_interop_threads(1);
    } catch (const std::exception&) {
      // Already fixed by earlier torch use in this process; harmless.
    }
    const std::chrono::milliseconds setup_timeout{env_long(kSetupTimeoutVar, 60'000)};
    const std::chrono::milliseconds collective_timeout{env_long(kCollectiveTimeoutVar, 300'000)};
    auto store = comm::Store::connect({.host = info->master_addr,
                                       .port = info->master_port,
                                       .is_server = false,
                                       .timeout = setup_timeout});
    auto session = std::make_unique<WorkerSession>();
    auto& ctx = session->context;
    ctx.world_rank = info->world_rank;
    ctx.local_rank = info->local_rank;
    ctx.node_rank = info->node_rank;
    ctx.world_size = info->world_size;
    ctx.local_world_size = info->local_world_size;
    ctx.experiment_name = std::getenv(kNameVar) ? std::getenv(kNameVar) : "";
    ctx.storage_path = std::getenv(kRunDirVar) ? std::getenv(kRunDirVar) : "";
    ctx.run_start = std::chrono::system_clock::time_point(
        std::chrono::duration_cast<std::chrono::system_clock::duration>(
            std::chrono::nanoseconds(std::atoll(std::getenv(kRunStartVar) ? std::getenv(kRunStartVar) : "0"))));
    ctx.device = env_long(kUseGpuVar, 0) != 0 ? c10::Device(c10::DeviceType::CUDA, info->local_rank)
                                              : c10::Device(c10::DeviceType::CPU);
    ctx.process_group = comm::ProcessGroup::create(store, info->world_rank, info->world_size,
                                                   {.setup_timeout = setup_timeout,
                                                    .timeout = collective_timeout,
                                                    .prefix = "train"});
    set_current_session(std::move(session));
    const char* config_text = std::getenv(kConfigVar);
    const Json config = config_text ? Json::parse(config_text) : Json::object();
    train_loop(config);
  } catch (const std::exception& e) {
    code = 1;
    std::cerr << "error: " << e.what() << std::endl;
    // A collective that failed or timed out because of a peer is a consequence of that peer's
    // failure; the driver names the cause first.
    const bool consequence = dynamic_cast<const PeerFailureError*>(&e) != nullptr ||
                             dynamic_cast<const TimeoutError*>(&e) != nullptr;
    if (runtime::has_control_channel()) {
      try {
        runtime::send_control_message(Json{{"type", "error"},
                                           {"rank", rank},
                                           {"message", e.what()},
                                           {"consequence", consequence}}
                                          .dump());
      } catch (...) {
      }
    }
  }
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  // Skip static destructors: the process group's threads may still be blocked on a dead peer,
  // and nothing after the loop needs them.
  std::_Exit(code);
}

}  // namespace cohort::train

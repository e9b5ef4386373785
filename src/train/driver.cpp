#include "train/driver.h"

#include <torch/cuda.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <iostream>
#include <random>
#include <set>

#include "cohort/comm/store.h"
#include "cohort/error.h"
#include "cohort/runtime/control_channel.h"
#include "cohort/runtime/worker_group.h"
#include "cohort/runtime/worker_info.h"
#include "train/checkpoint_manager.h"
#include "train/progress.h"
#include "train/run_files.h"
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

std::string random_token() {
  std::random_device device;
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%08x%08x", device(), device());
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
  try {
    write_atomically(dir / ".write_test", "ok");
  } catch (const std::exception&) {
    throw UsageError("storage path " + dir.string() +
                     " is not writable: give a writable --storage-path / RunConfig.storage_path");
  }
  std::filesystem::remove(dir / ".write_test", ec);
  // Half-assembled checkpoints of a start that crashed are never valid.
  std::filesystem::remove_all(dir / kStagingDir, ec);
  return dir;
}

std::vector<Json> read_history(const std::filesystem::path& file) {
  std::vector<Json> history;
  std::ifstream in(file);
  for (std::string line; std::getline(in, line);) {
    try {
      history.push_back(Json::parse(line));
    } catch (const std::exception&) {
      // A line cut by a crash mid-write: the history ends before it.
      break;
    }
  }
  return history;
}

std::string csv_cell(const Json& value) {
  std::string text = value.is_string() ? value.get<std::string>() : value.dump();
  if (text.find_first_of(",\"\n") == std::string::npos) return text;
  std::string quoted = "\"";
  for (char c : text) quoted += c == '"' ? std::string("\"\"") : std::string(1, c);
  return quoted + "\"";
}

void write_metrics_csv(const std::filesystem::path& file, const std::vector<Json>& history) {
  std::vector<std::string> columns;
  for (const auto& record : history) {
    for (const auto& [key, value] : record.items()) {
      if (std::find(columns.begin(), columns.end(), key) == columns.end()) columns.push_back(key);
    }
  }
  write_atomically(file, [&](std::ostream& out) {
    for (size_t c = 0; c < columns.size(); ++c) out << (c ? "," : "") << csv_cell(columns[c]);
    out << '\n';
    for (const auto& record : history) {
      for (size_t c = 0; c < columns.size(); ++c) {
        out << (c ? "," : "") << (record.contains(columns[c]) ? csv_cell(record[columns[c]]) : "");
      }
      out << '\n';
    }
  });
}

Json result_json(const Result& result) {
  Json out = Json::object();
  for (const auto& [key, value] : result.metrics.items()) out[key] = value;
  out["workers"] = result.workers;
  out["wall_seconds"] = result.wall_seconds;
  out["path"] = result.path.string();
  out["checkpoint"] = result.checkpoint ? Json(result.checkpoint->path().string()) : Json(nullptr);
  Json best = Json::array();
  for (const auto& [checkpoint, metrics] : result.best_checkpoints) {
    best.push_back({{"path", checkpoint.path().string()}, {"metrics", metrics}});
  }
  out["best_checkpoints"] = best;
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

// Every rank must call report() equally often: a rank that finished with fewer calls than
// another made would leave that one waiting for it.
class ReportCounter {
 public:
  explicit ReportCounter(int world) : counts_(static_cast<size_t>(world), 0), finished_(static_cast<size_t>(world), false) {}

  // Returns a reason to stop, or "".
  std::string on_report(int rank, int64_t index) {
    counts_[static_cast<size_t>(rank)] = index;
    for (size_t r = 0; r < counts_.size(); ++r) {
      if (finished_[r] && counts_[r] < index) return mismatch(static_cast<int>(r), rank, index);
    }
    return "";
  }
  std::string on_clean_exit(int rank) {
    finished_[static_cast<size_t>(rank)] = true;
    for (size_t r = 0; r < counts_.size(); ++r) {
      if (counts_[r] > counts_[static_cast<size_t>(rank)]) return mismatch(rank, static_cast<int>(r), counts_[r]);
    }
    return "";
  }

 private:
  std::string mismatch(int finished, int other, int64_t index) const {
    return "rank " + std::to_string(finished) + " finished after " +
           std::to_string(counts_[static_cast<size_t>(finished)]) + " report() calls while rank " +
           std::to_string(other) + " made call #" + std::to_string(index) +
           ": every rank must call report() the same number of times";
  }
  std::vector<int64_t> counts_;
  std::vector<bool> finished_;
};

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
  const auto run_dir = std::filesystem::absolute(prepare_run_dir(run, name));
  Console console(run.verbose);

  CheckpointManager checkpoints(run_dir, run.checkpoint_config);
  Result result;
  result.path = run_dir;
  result.workers = scaling.num_workers;
  std::optional<Checkpoint> resume_from;
  if (run.resume) {
    for (const auto& warning : checkpoints.adopt_existing()) console.message("cohort: warning: " + warning);
    resume_from = checkpoints.latest();
    if (resume_from) {
      result.metrics_history = read_history(run_dir / kMetricsFile);
      console.message("cohort: resuming from " + resume_from->path().string());
    }
  }
  // The history on disk is exactly what the Result holds: rewritten whole, then appended to.
  std::ofstream metrics_log(run_dir / kMetricsFile, std::ios::trunc);
  for (const auto& record : result.metrics_history) metrics_log << record.dump() << '\n';
  metrics_log.flush();

  auto store = comm::Store::connect(
      {.host = "127.0.0.1", .port = 0, .is_server = true, .timeout = run.setup_timeout});

  runtime::WorkerGroupOptions options;
  options.num_workers = scaling.num_workers;
  options.log_dir = run_dir / "logs";
  const std::string threads = std::to_string(scaling.resources_per_worker.cpu_threads);
  options.env = {
      {kConfigVar, config.dump()},
      {kNameVar, name},
      {kRunDirVar, run_dir.string()},
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
      {kRunTokenVar, random_token()},
      {kResumeCheckpointVar, resume_from ? resume_from->path().string() : ""},
      {kNextCheckpointVar, std::to_string(checkpoints.next_index())},
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

  runtime::WorkerGroup group(std::move(options));
  std::map<int, std::string> worker_errors;
  std::vector<int> error_order;
  std::set<int> consequences;
  std::string driver_error;  // a rule the run broke, found by the driver
  ReportCounter report_counter(world);
  auto stop_because = [&](const std::string& reason) {
    if (reason.empty() || !driver_error.empty()) return;
    driver_error = reason;
    group.request_stop(reason);
  };

  runtime::WorkerGroupHandlers handlers;
  handlers.on_output = [&](int rank, int pid, bool is_stderr, const std::string& line) {
    if (run.verbose >= 1 || is_stderr) console.worker_line(rank, pid, is_stderr, line);
  };
  handlers.on_tick = [&] { console.tick(); };
  handlers.on_exit = [&](const runtime::WorkerExit& exit) {
    if (exit.ok()) stop_because(report_counter.on_clean_exit(exit.rank));
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
    if (type == "report_begin") {
      stop_because(report_counter.on_report(rank, message.value("index", int64_t{0})));
    } else if (type == "report" && rank == 0) {
      const int64_t index = message.value("index", int64_t{0});
      const Json& metrics = message["metrics"];
      if (index == 1) {
        try {
          checkpoints.check_score_attribute(metrics);
        } catch (const UsageError& e) {
          stop_because(e.what());
        }
      }
      Json record = metrics;
      record["training_iteration"] = static_cast<int64_t>(result.metrics_history.size()) + 1;
      record["timestamp"] = std::time(nullptr);
      if (message.contains("checkpoint")) {
        record["checkpoint"] = message["checkpoint"];
        checkpoints.add(message["checkpoint"].get<std::string>(), metrics);
      }
      metrics_log << record.dump() << '\n';
      metrics_log.flush();
      result.metrics_history.push_back(record);
      console.report(record["training_iteration"].get<int64_t>(), metrics);
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

  group.start();
  if (run.verbose >= 1) {
    std::string pids;
    for (int pid : group.pids()) pids += (pids.empty() ? "" : " ") + std::to_string(pid);
    console.message("cohort: started " + std::to_string(world) + " worker(s) [pids " + pids +
                    "], run directory " + run_dir.string());
  }
  auto outcome = group.wait(handlers);
  console.tick(/*flush_all=*/true);

  if (!result.metrics_history.empty()) result.metrics = result.metrics_history.back();
  result.checkpoint = checkpoints.latest();
  result.best_checkpoints = checkpoints.best();
  result.wall_seconds = std::chrono::duration<double>(Clock::now() - started).count();
  if (!driver_error.empty()) {
    result.error = driver_error;
  } else if (!outcome.success) {
    std::stable_partition(error_order.begin(), error_order.end(),
                          [&](int rank) { return !consequences.count(rank); });
    result.error = describe_failure(outcome, worker_errors, error_order);
  }
  write_metrics_csv(run_dir / kMetricsCsvFile, result.metrics_history);
  write_atomically(run_dir / kResultFile, result_json(result).dump(2) + "\n");
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
  return value && *value ? std::atol(value) : fallback;
}

std::string env_string(const char* name) {
  const char* value = std::getenv(name);
  return value ? value : "";
}

}  // namespace

void run_worker(const std::function<void(const Json&)>& train_loop,
                const std::map<std::string, data::TensorDataset>& datasets) {
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
    auto session = std::make_unique<WorkerSession>();
    session->store = comm::Store::connect({.host = info->master_addr,
                                           .port = info->master_port,
                                           .is_server = false,
                                           .timeout = setup_timeout});
    session->run_token = env_string(kRunTokenVar);
    session->collective_timeout = collective_timeout;
    session->datasets = datasets;
    session->next_checkpoint_index = env_long(kNextCheckpointVar, 0);
    if (!env_string(kResumeCheckpointVar).empty()) {
      session->resume_from = Checkpoint::from_directory(env_string(kResumeCheckpointVar));
    }
    auto& ctx = session->context;
    ctx.world_rank = info->world_rank;
    ctx.local_rank = info->local_rank;
    ctx.node_rank = info->node_rank;
    ctx.world_size = info->world_size;
    ctx.local_world_size = info->local_world_size;
    ctx.experiment_name = env_string(kNameVar);
    ctx.storage_path = env_string(kRunDirVar);
    ctx.run_start = std::chrono::system_clock::time_point(
        std::chrono::duration_cast<std::chrono::system_clock::duration>(
            std::chrono::nanoseconds(std::atoll(env_string(kRunStartVar).c_str()))));
    ctx.device = env_long(kUseGpuVar, 0) != 0 ? c10::Device(c10::DeviceType::CUDA, info->local_rank)
                                              : c10::Device(c10::DeviceType::CPU);
    ctx.process_group = comm::ProcessGroup::create(session->store, info->world_rank, info->world_size,
                                                   {.setup_timeout = setup_timeout,
                                                    .timeout = collective_timeout,
                                                    .prefix = "train/" + session->run_token});
    set_current_session(std::move(session));
    const std::string config_text = env_string(kConfigVar);
    const Json config = config_text.empty() ? Json::object() : Json::parse(config_text);
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

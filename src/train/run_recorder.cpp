#include "train/run_recorder.h"

#include <algorithm>
#include <cstdio>
#include <ctime>
#include <fstream>

#include "cohort/error.h"
#include "cohort/train/parallel_model.h"
#include "train/run_files.h"
#include "train/worker_session.h"

namespace cohort::train {

std::string default_run_name() {
  std::time_t now = std::time(nullptr);
  char buffer[64];
  std::strftime(buffer, sizeof buffer, "cohort_%Y-%m-%d_%H-%M-%S", std::localtime(&now));
  return buffer;
}

namespace {

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
  // A folder of an earlier start, or made before the run's mask applied, takes it now.
  apply_umask(dir, run.umask);
  apply_umask(dir / "logs", run.umask);
  return dir;
}

Json result_json(const Result& result) {
  Json out = Json::object();
  for (const auto& [key, value] : result.metrics.items()) out[key] = value;
  out["workers"] = result.workers;
  out["wall_seconds"] = result.wall_seconds;
  out["path"] = result.path.string();
  out["config"] = result.config;
  out["checkpoint"] = result.checkpoint ? Json(result.checkpoint->path().string()) : Json(nullptr);
  Json best = Json::array();
  for (const auto& [checkpoint, metrics] : result.best_checkpoints) {
    best.push_back({{"path", checkpoint.path().string()}, {"metrics", metrics}});
  }
  out["best_checkpoints"] = best;
  out["failures"] = result.failures;
  out["resizes"] = result.resizes;
  out["interrupted"] = result.interrupted;
  out["error"] = result.error ? Json(*result.error) : Json(nullptr);
  return out;
}

}  // namespace

std::optional<std::string> straggler_line(const Json& metrics) {
  const auto number = [&](const char* key) -> std::optional<double> {
    if (!metrics.contains(key) || !metrics[key].is_number()) return std::nullopt;
    return metrics[key].get<double>();
  };
  const auto slowest = number("slowest_rank");
  const auto max = number("step_time_ms_max");
  const auto median = number("step_time_ms_median");
  if (!slowest || !max || !median || *max <= kStragglerRatio * *median ||
      *max - *median < kStragglerMinMs)
    return std::nullopt;
  char more[32] = "";
  if (*median > 0) std::snprintf(more, sizeof more, ", %.0f%% more", 100 * (*max / *median - 1));
  char line[256];
  std::snprintf(line, sizeof line,
                "cohort: straggler: rank %d takes %.1f ms per step against the median rank's "
                "%.1f ms%s (waits for peers not counted)",
                static_cast<int>(*slowest), *max, *median, more);
  return std::string(line);
}

RunRecorder::RunRecorder(const RunConfig& run, const std::string& name, const Json& config,
                         Console& console)
    : name_(name),
      run_dir_(std::filesystem::absolute(prepare_run_dir(run, name))),
      resume_(run.resume),
      tensorboard_config_(run.tensorboard),
      console_(console),
      lock_(run_dir_, [&console](const std::string& line) { console.message(line); }),
      checkpoints_(run_dir_, run.checkpoint_config),
      on_report_(run.on_report) {
  // Ours now: half-assembled checkpoints of a start that crashed are never valid.
  remove_tree(run_dir_ / kStagingDir);
  write_extra_files(run_dir_, run.extra_files);
  result_.path = run_dir_;
  result_.config = config;
}

namespace {

// Whether a non-empty file's last byte is not a newline.
bool ends_inside_a_line(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary | std::ios::ate);
  if (!in || in.tellg() <= 0) return false;
  in.seekg(-1, std::ios::end);
  char last = '\n';
  in.get(last);
  return last != '\n';
}

}  // namespace

std::optional<Checkpoint> RunRecorder::resume_point(bool restarted) {
  std::optional<Checkpoint> resume_from;
  bool continues = false;  // the history on disk goes on
  if (resume_) {
    for (const auto& warning : checkpoints_.adopt_existing())
      console_.message("cohort: warning: " + warning);
    resume_from = checkpoints_.latest();
    continues = resume_from || restarted;
    if (continues) result_.metrics_history = read_jsonl(run_dir_ / kMetricsFile);
    if (resume_from) console_.message("cohort: resuming from " + resume_from->path().string());
  }
  for (const char* file : {kMetricsFile, kStepsFile}) {
    const auto log = run_dir_ / file;
    if (continues) {
      // Append-only: the history on disk is never rewritten, so a crash now loses none of it. A
      // line a crash cut short (read_jsonl skips it) is ended, so the next record has its own.
      // Steps a resumed run takes again are read as the later record's (read_steps).
      if (ends_inside_a_line(log)) append_line(log, "");
    } else {
      std::ofstream(log, std::ios::trunc);  // a new run's history
    }
  }
  steps_log_.open(run_dir_ / kStepsFile, std::ios::app);
  if (tensorboard_config_.enabled) {
    tensorboard_.emplace(run_dir_, tensorboard_config_, result_.config,
                         result_.metrics_history.empty());
  }
  return resume_from;
}

std::optional<Checkpoint> RunRecorder::latest_on_disk() {
  for (const auto& warning : checkpoints_.adopt_existing())
    console_.message("cohort: warning: " + warning);
  return checkpoints_.latest();
}

void RunRecorder::on_report(const Json& message, std::string& driver_error) {
  const Json& metrics = message["metrics"];
  // The score is checked at the first report that is not one inside an epoch (which may lack an
  // evaluation's metrics: a checkpoint every N steps).
  if (!score_checked_ && !metrics.contains(kEpochStepMetric)) {
    score_checked_ = true;
    try {
      checkpoints_.check_score_attribute(metrics);
    } catch (const UsageError& e) {
      driver_error = e.what();
    }
  }
  Json record = metrics;
  record["training_iteration"] = static_cast<int64_t>(result_.metrics_history.size()) + 1;
  record["timestamp"] = std::time(nullptr);
  if (message.contains("checkpoint")) {
    record["checkpoint"] = message["checkpoint"];
    checkpoints_.add(message["checkpoint"].get<std::string>(), metrics);
  }
  append_line(run_dir_ / kMetricsFile, record.dump());  // on disk before the next report
  result_.metrics_history.push_back(record);
  if (tensorboard_) tensorboard_->on_report(record, message.value("histograms", Json()));
  console_.report(record["training_iteration"].get<int64_t>(), metrics);
  if (const auto line = straggler_line(metrics)) console_.message(*line);
  if (on_report_) on_report_(record);
}

void RunRecorder::on_checkpoint(const Json& message) {
  const auto path = message.at("checkpoint").get<std::string>();
  checkpoints_.add(path, message.value("metrics", Json::object()));
  console_.info("cohort: " + std::filesystem::path(path).filename().string() +
                " committed (written behind the loop)");
}

void RunRecorder::on_restored(const Json& message) {
  console_.message("cohort: " + message.value("why", std::string{}));
  if (result_.failures.empty()) return;
  auto& failure = result_.failures.back();
  failure["restored_from"] = message.value("source", std::string{});
  failure["restored_checkpoint"] = message.value("checkpoint", std::string{});
}

void RunRecorder::on_step(const Json& message) {
  const Json metrics = message.value("metrics", Json::object());
  const int64_t step = message.value("step", int64_t{0});
  Json record = metrics;
  record["step"] = step;
  record["timestamp"] = std::time(nullptr);
  steps_log_ << record.dump() << '\n';
  steps_log_.flush();
  if (tensorboard_) tensorboard_->on_step(step, metrics);
}

Result RunRecorder::finish(const std::optional<std::string>& error, int workers,
                           double wall_seconds) {
  if (!result_.metrics_history.empty()) result_.metrics = result_.metrics_history.back();
  result_.checkpoint = checkpoints_.latest();
  result_.best_checkpoints = checkpoints_.best();
  result_.wall_seconds = wall_seconds;
  result_.workers = workers;
  result_.error = error;
  write_csv(run_dir_ / kMetricsCsvFile, result_.metrics_history);
  if (tensorboard_) tensorboard_->on_finish(!error);
  write_atomically(run_dir_ / kResultFile, result_json(result_).dump(2) + "\n");
  return result_;
}

}  // namespace cohort::train

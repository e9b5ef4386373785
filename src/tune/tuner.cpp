#include "cohort/tune/tuner.h"

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <thread>

#include "cohort/error.h"
#include "cohort/runtime/control_channel.h"
#include "cohort/runtime/environment.h"
#include "cohort/runtime/worker_group.h"
#include "cohort/runtime/worker_info.h"
#include "train/run_files.h"
#include "train/run_recorder.h"
#include "train/tensorboard_log.h"
#include "tune/status_table.h"

namespace cohort::tune {
namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kStateFile = "experiment_state.json";
constexpr const char* kParamsFile = "params.json";
constexpr const char* kTrialLogFile = "trial.log";
constexpr const char* kTrialResultsFile = "tune_results.jsonl";
constexpr const char* kTrialsCsvFile = "trials.csv";
constexpr const char* kPending = "PENDING";
constexpr const char* kRunning = "RUNNING";
constexpr const char* kTerminated = "TERMINATED";
constexpr const char* kError = "ERROR";

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Objects merge key by key; anything else replaces.
void merge_into(Json& base, const Json& overlay) {
  if (!base.is_object() || !overlay.is_object()) {
    base = overlay;
    return;
  }
  for (const auto& [key, value] : overlay.items()) merge_into(base[key], value);
}

void apply_scaling(ScalingConfig& scaling, const Json& value) {
  if (!value.is_object()) {
    throw UsageError(
        "param_space/scaling_config must be an object of num_workers, min_workers, cpu_threads, "
        "use_gpu; got " +
        value.dump());
  }
  for (const auto& [key, v] : value.items()) {
    try {
      if (key == "num_workers") {
        scaling.num_workers = v.get<int>();
      } else if (key == "min_workers") {
        scaling.min_workers = v.get<int>();
      } else if (key == "cpu_threads") {
        scaling.resources_per_worker.cpu_threads = v.get<int>();
      } else if (key == "use_gpu") {
        scaling.use_gpu = v.get<bool>();
      } else {
        throw UsageError("param_space/scaling_config/" + key +
                         " is not a tunable ScalingConfig field (num_workers, min_workers, "
                         "cpu_threads, use_gpu)");
      }
    } catch (const Json::exception& e) {
      throw UsageError("param_space/scaling_config/" + key + "=" + v.dump() +
                       " has the wrong type: " + e.what());
    }
  }
}

// What a trial runs: the base Trainer with the trial's config applied.
Trainer trial_trainer(const Trainer& base, const Json& config, RunConfig run) {
  ScalingConfig scaling = base.scaling_config();
  Json loop_config = base.train_loop_config();
  for (const auto& [key, value] : config.items()) {
    if (key == "scaling_config") {
      apply_scaling(scaling, value);
    } else if (key == "train_loop_config") {
      merge_into(loop_config, value);
    } else {
      if (!loop_config.is_object()) loop_config = Json::object();
      merge_into(loop_config[key], value);
    }
  }
  return Trainer(base.train_loop(), scaling, std::move(run), loop_config, base.datasets());
}

int requested_threads(const Trainer& trainer) {
  return trainer.scaling_config().num_workers *
         trainer.scaling_config().resources_per_worker.cpu_threads;
}

// The hparams plugin's session of a trial: every value of its config by path ("lr",
// "scaling_config/num_workers"); the experiment's summary picks the searched ones as columns.
Json trial_hparams(const Json& config) {
  Json out = Json::object();
  if (!config.is_object() || config.empty()) return out;
  const Json leaves = config.flatten();
  for (const auto& [pointer, value] : leaves.items())
    if (!pointer.empty() && value.is_primitive() && !value.is_null())
      out[pointer.substr(1)] = value;
  return out;
}

// The hparams plugin's domains of the searched parameters: the values of a grid or a choice, the
// bounds of the others.
Json hparam_domains(const Json& param_space, const std::vector<std::string>& parameters) {
  Json out = Json::object();
  for (const auto& path : parameters) {
    const Json& domain = param_space.at(Json::json_pointer("/" + path));
    const std::string kind = domain.begin().key();
    const Json& args = domain.begin().value();
    if (kind == "grid_search" || kind == "choice") {
      const bool plain = std::all_of(args.begin(), args.end(), [](const Json& v) {
        return v.is_number() || v.is_string() || v.is_boolean();
      });
      out[path] = plain ? Json{{"values", args}} : Json::object();
    } else {
      out[path] = {{"min", args[0]}, {"max", args[1]}};
    }
  }
  return out;
}

// In a trial process (and its workers): run the trial's Trainer, then end the process.
[[noreturn]] void run_trial(const Trainer& base, const std::filesystem::path& trial_dir) {
  const Json config = read_json(trial_dir / kParamsFile);
  RunConfig run = base.run_config();
  run.storage_path = trial_dir.parent_path();
  run.name = trial_dir.filename().string();
  run.verbose = 0;  // the Tuner's status table speaks for the trials
  run.resume = true;
  run.tensorboard.hparams = trial_hparams(config);
  run.on_report = [user = run.on_report](const Json& record) {
    if (user) user(record);
    if (runtime::has_control_channel()) {
      runtime::send_control_message(Json{{"type", "result"}, {"record", record}}.dump());
    }
  };
  Trainer trainer = trial_trainer(base, config, run);
  // The Tuner stops a trial with SIGTERM. Held for the whole run, this scope makes that a request
  // the trial's driver acts on (stop the workers, write result.json) at any moment, also while it
  // starts or finishes, instead of a death that leaves the run directory half written.
  std::optional<runtime::InterruptScope> interrupts;
  if (runtime::spawned_role() == runtime::kTrialRole) interrupts.emplace();
  const Result result = trainer.fit();  // in a worker of the trial, never returns
  std::cout.flush();
  std::cerr.flush();
  std::_Exit(result.ok() ? 0 : 1);
}

Json trial_to_json(const TrialInfo& t) {
  return Json{{"trial_id", t.trial_id},
              {"name", t.name},
              {"config", t.config},
              {"status", t.status},
              {"stopped_early", t.stopped_early},
              {"cpu_threads", t.cpu_threads},
              {"iterations", t.iterations},
              {"time_total_s", t.time_total_s},
              {"last_result", t.last_result},
              {"error", t.error ? Json(*t.error) : Json(nullptr)}};
}

TrialInfo trial_from_json(const Json& j) {
  TrialInfo t;
  t.trial_id = j.at("trial_id").get<std::string>();
  t.name = j.at("name").get<std::string>();
  t.config = j.at("config");
  t.status = j.at("status").get<std::string>();
  t.stopped_early = j.value("stopped_early", false);
  t.cpu_threads = j.value("cpu_threads", 1);
  t.iterations = j.value("iterations", int64_t{0});
  t.time_total_s = j.value("time_total_s", 0.0);
  t.last_result = j.value("last_result", Json::object());
  if (j.contains("error") && j["error"].is_string()) t.error = j["error"].get<std::string>();
  return t;
}

Json tune_config_to_json(const TuneConfig& c, const TrialScheduler& scheduler) {
  return Json{{"metric", c.metric},
              {"mode", c.mode},
              {"num_samples", c.num_samples},
              {"max_concurrent_trials", c.max_concurrent_trials},
              {"time_budget_s", c.time_budget_s},
              {"seed", c.seed},
              {"max_cpu_threads", c.max_cpu_threads},
              {"metric_columns", c.metric_columns},
              {"scheduler", scheduler.to_json()}};
}

TuneConfig tune_config_from_json(const Json& j) {
  TuneConfig c;
  c.metric = j.value("metric", "");
  c.mode = j.value("mode", "");
  c.num_samples = j.value("num_samples", 1);
  c.max_concurrent_trials = j.value("max_concurrent_trials", 0);
  c.time_budget_s = j.value("time_budget_s", 0.0);
  c.seed = j.value("seed", uint64_t{0});
  c.max_cpu_threads = j.value("max_cpu_threads", 0);
  c.metric_columns = j.value("metric_columns", std::vector<std::string>{});
  return c;
}

void validate(const TuneConfig& c) {
  if (c.num_samples < 1)
    throw UsageError("TuneConfig.num_samples=" + std::to_string(c.num_samples) + " must be >= 1");
  if (c.max_concurrent_trials < 0)
    throw UsageError("TuneConfig.max_concurrent_trials must be >= 0 (0: no limit)");
  if (c.max_cpu_threads < 0)
    throw UsageError("TuneConfig.max_cpu_threads must be >= 0 (0: this host's CPUs)");
  if (c.time_budget_s < 0) throw UsageError("TuneConfig.time_budget_s must be >= 0 (0: none)");
  if (!c.mode.empty() && c.mode != "max" && c.mode != "min") {
    throw UsageError("TuneConfig.mode='" + c.mode + "' must be \"max\" or \"min\"");
  }
  if (!c.metric.empty() && c.mode.empty()) {
    throw UsageError("TuneConfig.metric='" + c.metric +
                     "' needs TuneConfig.mode: \"max\" or \"min\"");
  }
}

// Runs an experiment: creates trials from the searcher, starts them as trial processes within
// the CPU budget, follows their results, lets the scheduler stop them, and keeps the experiment
// state on disk after every change.
class Experiment {
 public:
  Experiment(const Trainer& base, bool function_trainable, Json param_space, TuneConfig config,
             const RunConfig& run, std::filesystem::path dir, bool restoring)
      : base_(base),
        function_trainable_(function_trainable),
        param_space_(std::move(param_space)),
        config_(std::move(config)),
        dir_(std::move(dir)),
        verbose_(run.verbose),
        reporter_(run.verbose) {
    const unsigned cpus = std::max(1u, std::thread::hardware_concurrency());
    threads_limit_ = config_.max_cpu_threads > 0 ? config_.max_cpu_threads : static_cast<int>(cpus);
    scheduler_ = config_.scheduler ? config_.scheduler : std::make_shared<FIFOScheduler>();
    scheduler_->set_search_properties(config_.metric, config_.mode);
    if (config_.search_alg) {
      searcher_ = config_.search_alg;
    } else {
      searcher_ = std::make_shared<BasicVariantGenerator>(config_.seed, config_.num_samples);
    }
    searcher_->set_search_properties(config_.metric, config_.mode, param_space_);
    parameters_ = searched_parameters(param_space_);
    std::filesystem::create_directories(dir_);
    apply_umask(dir_, run.umask);  // the experiment's trials inside are its user's alone
    write_extra_files(dir_, run.extra_files);
    if (base_.run_config().tensorboard.enabled) {
      // The hparams plugin's table: the searched parameters and the ranked metrics as columns,
      // one row per trial folder (each trial's own files hold its values).
      std::vector<std::string> metrics;
      if (!config_.metric.empty()) metrics.push_back(config_.metric);
      for (const auto& m : config_.metric_columns)
        if (m != config_.metric) metrics.push_back(m);
      train::SummaryWriter writer(dir_ / train::kTensorBoardDir);
      writer.add_hparams_experiment(hparam_domains(param_space_, parameters_), metrics);
      writer.flush();
    }
    if (restoring) load();
  }

  ResultGrid run();

 private:
  struct Live {
    std::unique_ptr<runtime::WorkerGroup> group;
    runtime::WorkerGroupHandlers handlers;
    Clock::time_point started;
    double time_before = 0;
    bool stop_requested = false;
    Clock::time_point stop_requested_at;
    std::ofstream log;
    std::deque<std::string> stderr_tail;
  };

  std::filesystem::path trial_dir(const TrialInfo& t) const { return dir_ / t.name; }
  int threads_in_use() const {
    int used = 0;
    for (const auto& [index, live] : live_) used += trials_[index].cpu_threads;
    return used;
  }
  StatusView view() const {
    return StatusView{.experiment_path = dir_,
                      .running_for_s = seconds_since(started_),
                      .scheduler = scheduler_->describe(),
                      .threads_used = threads_in_use(),
                      .threads_limit = threads_limit_,
                      .metric = config_.metric,
                      .mode = config_.mode,
                      .trials = &trials_,
                      .parameters = parameters_,
                      .metric_columns = config_.metric_columns,
                      .total_trials = searcher_->total_trials()};
  }

  void load();
  void persist();
  bool create_trial();
  void start_trials();
  void start(size_t index);
  void on_result(size_t index, const Json& record);
  void conclude(size_t index, const runtime::GroupOutcome& outcome);
  ResultGrid grid() const;

  Trainer base_;
  bool function_trainable_;
  Json param_space_;
  TuneConfig config_;
  std::filesystem::path dir_;
  int verbose_;
  StatusReporter reporter_;
  std::shared_ptr<TrialScheduler> scheduler_;
  std::shared_ptr<Searcher> searcher_;
  std::vector<std::string> parameters_;
  int threads_limit_ = 1;
  std::vector<TrialInfo> trials_;
  std::map<size_t, Live> live_;
  int64_t suggested_ = 0;
  bool searcher_finished_ = false;
  bool budget_hit_ = false;
  Clock::time_point started_ = Clock::now();
};

void Experiment::persist() {
  Json trials = Json::array();
  for (const auto& t : trials_) trials.push_back(trial_to_json(t));
  write_atomically(dir_ / kStateFile,
                   Json{{"version", 1},
                        {"function_trainable", function_trainable_},
                        {"param_space", param_space_},
                        {"tune_config", tune_config_to_json(config_, *scheduler_)},
                        {"verbose", verbose_},
                        {"suggested", suggested_},
                        {"searcher_finished", searcher_finished_},
                        {"trials", trials}}
                           .dump(2) +
                       "\n");
}

// Restores the trials and replays their results into the searcher and the scheduler, so that
// both decide as if the experiment had never stopped.
void Experiment::load() {
  const Json state = read_json(dir_ / kStateFile);
  for (const auto& j : state.at("trials")) trials_.push_back(trial_from_json(j));
  suggested_ = state.value("suggested", int64_t{0});
  searcher_finished_ = state.value("searcher_finished", false);
  // The searcher starts over from its seed: skip what it already suggested.
  for (int64_t i = 0; i < suggested_; ++i) {
    if (!searcher_->suggest(trials_.size() > static_cast<size_t>(i)
                                ? trials_[static_cast<size_t>(i)].trial_id
                                : "")) {
      break;
    }
  }
  for (auto& t : trials_) {
    scheduler_->on_trial_add(t.trial_id);
    const bool finished = t.status == kTerminated || t.status == kError;
    TrialDecision last = TrialDecision::kContinue;
    for (const auto& result : read_jsonl(trial_dir(t) / kTrialResultsFile)) {
      searcher_->on_trial_result(t.trial_id, result);
      last = scheduler_->on_trial_result(t.trial_id, result);
    }
    if (finished) {
      if (t.status == kTerminated && !t.stopped_early)
        scheduler_->on_trial_complete(t.trial_id, t.last_result);
      else
        scheduler_->on_trial_remove(t.trial_id);
      searcher_->on_trial_complete(t.trial_id, t.last_result, t.status == kError);
    } else if (last != TrialDecision::kContinue) {
      // The scheduler had stopped it when the driver died.
      t.status = kTerminated;
      t.stopped_early = last == TrialDecision::kStop;
      if (t.stopped_early)
        scheduler_->on_trial_remove(t.trial_id);
      else
        scheduler_->on_trial_complete(t.trial_id, t.last_result);
      searcher_->on_trial_complete(t.trial_id, t.last_result, false);
    } else {
      t.status = kPending;  // resumes from its latest checkpoint
    }
  }
  int finished = 0;
  for (const auto& t : trials_) finished += t.status == kTerminated || t.status == kError;
  reporter_.event("cohort: restoring experiment " + dir_.string() + ": " +
                  std::to_string(finished) + " finished trial(s) kept, " +
                  std::to_string(trials_.size() - static_cast<size_t>(finished)) +
                  " to run or resume");
}

// Creates the searcher's next trial; false when it has no more.
bool Experiment::create_trial() {
  char id[24];  // any size_t
  std::snprintf(id, sizeof id, "%05zu", trials_.size());
  auto config = searcher_->suggest(id);
  if (!config) {
    searcher_finished_ = true;
    return false;
  }
  ++suggested_;
  TrialInfo t;
  t.trial_id = id;
  t.name = std::string("trial_") + id;
  t.config = std::move(*config);
  t.status = kPending;
  try {
    t.cpu_threads = requested_threads(trial_trainer(base_, t.config, base_.run_config()));
    if (t.cpu_threads > threads_limit_) {
      throw UsageError("it requests " + std::to_string(t.cpu_threads) +
                       " CPU threads (num_workers x cpu_threads), more than the " +
                       std::to_string(threads_limit_) +
                       " the Tuner may use: lower them or raise TuneConfig.max_cpu_threads");
    }
  } catch (const UsageError& e) {
    t.status = kError;
    t.error = e.what();
  }
  std::filesystem::create_directories(trial_dir(t));
  write_atomically(trial_dir(t) / kParamsFile, t.config.dump(2) + "\n");
  scheduler_->on_trial_add(t.trial_id);
  trials_.push_back(std::move(t));
  const auto& added = trials_.back();
  if (added.status == kError) {
    reporter_.event(added.name + " ERROR before it started: " + *added.error);
    searcher_->on_trial_complete(added.trial_id, added.last_result, true);
  }
  persist();
  return true;
}

void Experiment::start_trials() {
  while (true) {
    const bool concurrency_left = config_.max_concurrent_trials == 0 ||
                                  static_cast<int>(live_.size()) < config_.max_concurrent_trials;
    if (!concurrency_left) return;
    auto pending = std::find_if(trials_.begin(), trials_.end(),
                                [](const TrialInfo& t) { return t.status == kPending; });
    if (pending == trials_.end()) {
      if (searcher_finished_ || threads_in_use() >= threads_limit_) return;
      if (!create_trial()) {
        persist();
        return;
      }
      continue;
    }
    // First come, first served: a trial that does not fit yet waits, and so do those after it.
    if (threads_in_use() + pending->cpu_threads > threads_limit_) {
      if (!live_.empty()) return;
      // Nothing runs and it still does not fit (a restore on a host with fewer CPUs): it never
      // will.
      pending->status = kError;
      pending->error = "it requests " + std::to_string(pending->cpu_threads) +
                       " CPU threads, more than the " + std::to_string(threads_limit_) +
                       " the Tuner may use: raise TuneConfig.max_cpu_threads";
      reporter_.event(pending->name + " ERROR before it started: " + *pending->error);
      scheduler_->on_trial_remove(pending->trial_id);
      searcher_->on_trial_complete(pending->trial_id, pending->last_result, true);
      persist();
      continue;
    }
    start(static_cast<size_t>(pending - trials_.begin()));
  }
}

void Experiment::start(size_t index) {
  auto& t = trials_[index];
  auto& live = live_[index];
  live.log.open(trial_dir(t) / kTrialLogFile, std::ios::app);
  live.time_before = t.time_total_s;
  live.handlers.on_output = [this, index](int, int, bool is_stderr, const std::string& line) {
    auto& l = live_[index];
    l.log << line << '\n';
    if (!is_stderr) return;
    l.stderr_tail.push_back(line);
    if (l.stderr_tail.size() > 8) l.stderr_tail.pop_front();
  };
  live.handlers.on_control = [this, index](int, const std::string& line) {
    Json message;
    try {
      message = Json::parse(line);
    } catch (const std::exception&) {
      return;
    }
    if (message.value("type", "") == "result") on_result(index, message["record"]);
  };
  runtime::WorkerGroupOptions options;
  options.num_workers = 1;
  options.role = runtime::kTrialRole;
  options.env = {{runtime::kTrialDirVar, trial_dir(t).string()}};
  // The trial's driver stops its own workers within its grace period first.
  options.stop_grace = std::chrono::seconds(15);
  live.group = std::make_unique<runtime::WorkerGroup>(options);
  live.group->start();
  live.started = Clock::now();
  t.status = kRunning;
  reporter_.event(
      t.name + " RUNNING with " + describe_parameters(t.config, parameters_) +
      (t.iterations > 0 ? " (resuming after iteration " + std::to_string(t.iterations) + ")" : ""));
  persist();
}

void Experiment::on_result(size_t index, const Json& record) {
  auto& t = trials_[index];
  auto& live = live_[index];
  Json result = record;
  result["time_total_s"] = live.time_before + seconds_since(live.started);
  result["trial_id"] = t.trial_id;
  t.iterations = result.value("training_iteration", t.iterations + 1);
  t.time_total_s = result["time_total_s"].get<double>();
  t.last_result = result;
  append_line(trial_dir(t) / kTrialResultsFile, result.dump());
  searcher_->on_trial_result(t.trial_id, result);
  std::string metrics;
  for (const auto& [key, value] : result.items()) {
    const bool shown = config_.metric_columns.empty()
                           ? !is_bookkeeping(key)
                           : std::find(config_.metric_columns.begin(), config_.metric_columns.end(),
                                       key) != config_.metric_columns.end();
    if (value.is_number() && shown) metrics += " " + key + "=" + format_value(value);
  }
  reporter_.progress(t.name + " iter " + std::to_string(t.iterations) + ":" + metrics);
  if (live.stop_requested) return;
  const TrialDecision decision = scheduler_->on_trial_result(t.trial_id, result);
  if (decision == TrialDecision::kContinue) return;
  live.stop_requested = true;
  live.stop_requested_at = Clock::now();
  live.group->request_stop("stopped by the scheduler");
  if (decision == TrialDecision::kFinish) return;
  t.stopped_early = true;
  reporter_.event(t.name + " stopped early by the scheduler after iteration " +
                  std::to_string(t.iterations) +
                  (config_.metric.empty() || !result.contains(config_.metric)
                       ? ""
                       : " (" + config_.metric + "=" + format_value(result[config_.metric]) + ")"));
}

void Experiment::conclude(size_t index, const runtime::GroupOutcome& outcome) {
  auto& t = trials_[index];
  {
    auto& live = live_[index];
    t.time_total_s = std::max(t.time_total_s, live.time_before + seconds_since(live.started));
    if (outcome.success) t.stopped_early = false;  // it finished before the stop reached it
    if (!outcome.success && !live.stop_requested && outcome.interrupted_by != 0) {
      t.status = kPending;  // Ctrl-C: Tuner::restore resumes it
    } else if (outcome.success || live.stop_requested) {
      t.status = kTerminated;
      if (t.stopped_early) {
        scheduler_->on_trial_remove(t.trial_id);
      } else {
        scheduler_->on_trial_complete(t.trial_id, t.last_result);
      }
      searcher_->on_trial_complete(t.trial_id, t.last_result, false);
      reporter_.event(
          t.name + " TERMINATED after " + std::to_string(t.iterations) + " iteration(s)" +
          (t.stopped_early ? " (stopped early; its processes ended " +
                                 format_value(Json(seconds_since(live.stop_requested_at))) +
                                 " s after the stop)"
                           : ""));
    } else {
      t.status = kError;
      std::string error = outcome.failure_reason;
      if (std::filesystem::exists(trial_dir(t) / kResultFile)) {
        const Result result = Result::from_path(trial_dir(t));
        if (result.error) error = *result.error;
      } else if (!live.stderr_tail.empty()) {
        error += ": " + live.stderr_tail.back();
      }
      t.error = error;
      scheduler_->on_trial_remove(t.trial_id);
      searcher_->on_trial_complete(t.trial_id, t.last_result, true);
      reporter_.event(t.name + " ERROR: " + error +
                      " (log: " + (trial_dir(t) / kTrialLogFile).string() + ")");
    }
  }
  live_.erase(index);
  persist();
}

ResultGrid Experiment::run() {
  runtime::InterruptScope interrupts;
  persist();
  while (true) {
    const int interrupted = runtime::InterruptScope::signal();
    if (!budget_hit_ && config_.time_budget_s > 0 &&
        seconds_since(started_) > config_.time_budget_s) {
      budget_hit_ = true;
      reporter_.event("cohort: the time budget of " + format_value(Json(config_.time_budget_s)) +
                      " s is spent: stopping " + std::to_string(live_.size()) +
                      " running trial(s), starting no more");
      for (auto& [index, live] : live_) {
        live.stop_requested = true;
        live.stop_requested_at = Clock::now();
        trials_[index].stopped_early = true;
        live.group->request_stop("the experiment's time budget is spent");
      }
    }
    if (interrupted == 0 && !budget_hit_) start_trials();
    if (live_.empty()) break;  // nothing runs and nothing more can start
    const auto wait =
        std::chrono::milliseconds(std::max<int64_t>(10, 100 / static_cast<int64_t>(live_.size())));
    std::vector<size_t> running;
    for (const auto& [index, live] : live_) running.push_back(index);
    for (size_t index : running) {
      auto& live = live_[index];
      if (auto outcome = live.group->poll(live.handlers, wait)) conclude(index, *outcome);
    }
    reporter_.refresh(view());
  }
  persist();
  reporter_.refresh(view(), /*force=*/true);
  ResultGrid results = grid();
  results.write_csv(dir_ / kTrialsCsvFile);
  if (const int sig = runtime::InterruptScope::signal(); sig != 0) {
    std::cout << "cohort: interrupted; the experiment is saved in " << dir_.string()
              << ": Tuner::restore (or the same cohort tune command) continues it" << std::endl;
    std::signal(sig, SIG_DFL);
    std::raise(sig);
  }
  return results;
}

ResultGrid Experiment::grid() const {
  std::vector<TrialInfo> ran;
  std::vector<Result> results;
  for (const auto& t : trials_) {
    if (t.status != kTerminated && t.status != kError) continue;
    Result result;
    const auto dir = trial_dir(t);
    if (std::filesystem::exists(dir / kMetricsFile) || std::filesystem::exists(dir / kResultFile)) {
      result = Result::from_path(dir);
    }
    result.path = std::filesystem::absolute(dir);
    result.config = t.config;
    if (t.status == kTerminated) result.error.reset();  // stopped early is not an error
    if (t.status == kError) result.error = t.error.value_or("unknown error");
    ran.push_back(t);
    results.push_back(std::move(result));
  }
  return ResultGrid(dir_, std::move(ran), std::move(results), config_.metric, config_.mode);
}

}  // namespace

Tuner::Tuner(Trainer trainable, bool function_trainable)
    : trainable_(std::move(trainable)), function_trainable_(function_trainable) {}

Tuner::Tuner(Trainer trainable, Json param_space, TuneConfig tune_config, RunConfig run_config)
    : Tuner(std::move(trainable), false) {
  param_space_ = std::move(param_space);
  config_ = std::move(tune_config);
  run_ = std::move(run_config);
}

Tuner::Tuner(TrainLoop trainable, Json param_space, TuneConfig tune_config, RunConfig run_config,
             WorkerResources resources)
    : Tuner(Trainer(std::move(trainable),
                    ScalingConfig{.num_workers = 1, .resources_per_worker = resources}),
            true) {
  param_space_ = std::move(param_space);
  config_ = std::move(tune_config);
  run_ = std::move(run_config);
}

bool Tuner::can_restore(const std::filesystem::path& experiment_path) {
  return std::filesystem::exists(experiment_path / kStateFile);
}

Tuner Tuner::restore(const std::filesystem::path& experiment_path, Trainer trainable,
                     TuneConfig objects) {
  Tuner tuner(std::move(trainable), false);
  tuner.restore_from_ = experiment_path;
  tuner.config_ = std::move(objects);
  return tuner;
}

Tuner Tuner::restore(const std::filesystem::path& experiment_path, TrainLoop trainable,
                     TuneConfig objects, WorkerResources resources) {
  Tuner tuner(Trainer(std::move(trainable),
                      ScalingConfig{.num_workers = 1, .resources_per_worker = resources}),
              true);
  tuner.restore_from_ = experiment_path;
  tuner.config_ = std::move(objects);
  return tuner;
}

ResultGrid Tuner::fit() {
  // A trial process, or a worker of one.
  if (const std::string trial_dir = runtime::env_string(runtime::kTrialDirVar);
      !trial_dir.empty() && !runtime::spawned_role().empty()) {
    run_trial(trainable_, trial_dir);
  }
  if (!runtime::spawned_role().empty()) {
    throw UsageError(
        "Tuner::fit() reached in a worker that belongs to no trial: call Tuner::fit() before any "
        "Trainer::fit() in the program, or in a separate one");
  }
  if (runtime::detect_launch()) {
    throw UsageError(
        "cohort::tune::Tuner runs its trials on this host and cannot run under a launcher (srun, "
        "mpirun, "
        "torchrun-style variables): start the program directly");
  }
  if (!restore_from_.empty()) {
    const auto dir = std::filesystem::absolute(restore_from_);
    if (!can_restore(dir)) {
      throw UsageError("Tuner::restore: " + dir.string() + " holds no experiment (" + kStateFile +
                       " is missing)");
    }
    const Json state = read_json(dir / kStateFile);
    if (state.value("function_trainable", false) != function_trainable_) {
      throw UsageError(
          "Tuner::restore: " + dir.string() + " was run with a " +
          (state.value("function_trainable", false) ? "function trainable" : "Trainer") +
          "; restore it with the same kind");
    }
    TuneConfig config = tune_config_from_json(state.at("tune_config"));
    config.scheduler = config_.scheduler;
    config.search_alg = config_.search_alg;
    const Json& saved_scheduler = state.at("tune_config").at("scheduler");
    if (!config.scheduler && !saved_scheduler.is_null())
      config.scheduler = scheduler_from_json(saved_scheduler);
    if (!config.scheduler && saved_scheduler.is_null()) {
      throw UsageError(
          "Tuner::restore: the experiment used a custom scheduler, which cannot be saved: pass it "
          "again in "
          "the TuneConfig argument");
    }
    RunConfig run{.name = dir.filename().string(),
                  .storage_path = dir.parent_path(),
                  .verbose = state.value("verbose", 1)};
    Experiment experiment(trainable_, function_trainable_, state.at("param_space"),
                          std::move(config), run, dir, true);
    return experiment.run();
  }
  validate(config_);
  validate_param_space(param_space_);
  const std::string name = run_.name.empty() ? train::default_run_name() : run_.name;
  const auto dir = std::filesystem::absolute(run_.storage_path / name);
  if (can_restore(dir)) {
    throw UsageError("an experiment already exists in " + dir.string() +
                     ": continue it with Tuner::restore, or give another RunConfig.name");
  }
  Experiment experiment(trainable_, function_trainable_, param_space_, config_, run_, dir, false);
  return experiment.run();
}

}  // namespace cohort::tune

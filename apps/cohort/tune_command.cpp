#include "tune_command.h"

#include "cohort/cli/config_file.h"

#include <iostream>
#include <set>

#include "cohort/cohort.h"

namespace cohort::cli {
namespace {

// --param NAME=DOMAIN into a param space over the job's train_loop_config; "workers" and
// "threads" tune the trial's ScalingConfig.
Json param_space_of(const TuneOptions& o) {
  const Json base = to_json(o.job);
  // Where the data is, how it is read and the model's shape that follows from it are not
  // searched over (how much of it is: --train-examples, --test-examples).
  const auto fixed = [](const std::string& key) {
    return key == "model_options" ||
           (Json(DataOptions{}).contains(key) && key != "train_examples" && key != "test_examples");
  };
  Json space = Json::object();
  for (const auto& param : o.params) {
    const auto eq = param.find('=');
    if (eq == std::string::npos || eq == 0) {
      throw UsageError("--param '" + param +
                       "' must be NAME=DOMAIN, such as lr=loguniform:1e-4:1e-1");
    }
    const std::string name = param.substr(0, eq);
    Json domain = tune::parse_domain(param.substr(eq + 1));
    if (name == "workers") {
      space["scaling_config"]["num_workers"] = std::move(domain);
    } else if (name == "threads") {
      space["scaling_config"]["cpu_threads"] = std::move(domain);
    } else if (base.contains(name) && !fixed(name)) {
      if (space.contains(name)) throw UsageError("--param " + name + " is given twice");
      space[name] = std::move(domain);
    } else {
      std::string names;
      for (const auto& [key, value] : base.items()) {
        if (!fixed(key)) names += key + ", ";
      }
      throw UsageError("--param " + name + ": not a tunable option; tunable are " + names +
                       "workers and threads");
    }
  }
  if (space.empty()) throw UsageError("give at least one --param NAME=DOMAIN to search over");
  tune::validate_param_space(space);
  return space;
}

std::shared_ptr<tune::TrialScheduler> scheduler_of(const TuneOptions& o) {
  if (o.scheduler == "fifo") return std::make_shared<tune::FIFOScheduler>();
  if (o.scheduler == "asha") {
    return std::make_shared<tune::ASHAScheduler>(
        tune::ASHAOptions{.max_t = static_cast<double>(o.job.loop.epochs),
                          .grace_period = o.grace_period,
                          .reduction_factor = o.reduction_factor});
  }
  if (o.scheduler == "median") {
    return std::make_shared<tune::MedianStoppingRule>(
        tune::MedianStoppingOptions{.grace_period = o.grace_period});
  }
  throw UsageError("unknown --scheduler '" + o.scheduler + "': choose fifo, asha or median");
}

}  // namespace

CLI::App* add_tune_command(CLI::App& app, TuneOptions& o) {
  auto* cmd = app.add_subcommand(
      "tune", "Search the hyperparameters of a training job (each trial a worker group)");
  add_training_options(cmd, o.job);
  cmd->option_defaults()->group("Search");
  cmd->add_option(
      "--param", o.params,
      "NAME=DOMAIN, repeatable; DOMAIN is loguniform:LO:HI, uniform:LO:HI, quniform:LO:HI:Q, "
      "randint:LO:HI, choice:A,B,C, grid:A,B,C or a constant; NAME a training option "
      "(lr, batch_size, momentum, optimizer, model, ...) or workers/threads");
  cmd->add_option("--samples", o.samples, "trials drawn (with grid: repetitions of the grid)")
      ->capture_default_str();
  cmd->add_option("--scheduler", o.scheduler, "fifo, asha or median")->capture_default_str();
  cmd->add_option("--max-concurrent", o.max_concurrent,
                  "trials at once (0: as many as --cpus allow)")
      ->capture_default_str();
  cmd->add_option("--metric", o.metric, "the reported metric that ranks trials")
      ->capture_default_str();
  cmd->add_option("--mode", o.mode, "max or min")->capture_default_str();
  cmd->add_option("--grace-period", o.grace_period,
                  "asha/median: epochs before a trial may be stopped")
      ->capture_default_str();
  cmd->add_option("--reduction-factor", o.reduction_factor,
                  "asha: 1/this of the trials go on at each rung")
      ->capture_default_str();
  cmd->add_option("--cpus", o.cpus,
                  "CPU threads all running trials may use together (0: this host's)")
      ->capture_default_str();
  cmd->add_option("--time-budget", o.time_budget, "seconds; then running trials stop (0: none)")
      ->capture_default_str();
  cmd->add_option("--search-seed", o.search_seed, "seed of the sampling of the param space")
      ->capture_default_str();
  return cmd;
}

int run_tune_command(TuneOptions o, const CLI::App& cmd) {
  apply_deepspeed_config(o.job);
  validate(o.job);
  if (o.samples < 1) throw UsageError("--samples " + std::to_string(o.samples) + " must be >= 1");
  if (o.max_concurrent < 0) throw UsageError("--max-concurrent must be >= 0 (0: no limit)");
  if (o.mode != "max" && o.mode != "min")
    throw UsageError("--mode '" + o.mode + "' must be max or min");
  const Json space = param_space_of(o);
  RunConfig trial_run = run_config_of(o.job);
  trial_run.name.clear();
  // One dashboard for the experiment, served here: each trial's driver must not start its own.
  const auto dashboard_options = trial_run.dashboard;
  trial_run.dashboard.reset();
  std::optional<train::Dashboard> dashboard;
  // In the experiment's own process only (fit() runs this program again for each trial).
  if (dashboard_options && runtime::spawned_role().empty()) {
    std::filesystem::create_directories(o.job.run.storage_path);
    dashboard.emplace(o.job.run.storage_path, *dashboard_options);
    std::cout << "dashboard at " << dashboard->url() << std::endl;
  }
  Trainer trainer(train_loop, scaling_of(o.job), trial_run, to_json(o.job), datasets_of(o.job));
  const std::string name =
      o.job.run.name.empty() ? "tune_" + std::to_string(std::time(nullptr)) : o.job.run.name;
  const auto experiment = std::filesystem::path(o.job.run.storage_path) / name;
  tune::ResultGrid grid = [&] {
    if (o.job.run.resume && tune::Tuner::can_restore(experiment))
      return tune::Tuner::restore(experiment, trainer).fit();
    // Set field by field: GCC 12 takes a designated initializer of RunConfig's nested members for
    // a read of uninitialized memory (-Wmaybe-uninitialized).
    RunConfig run;
    run.name = name;
    run.storage_path = o.job.run.storage_path;
    run.verbose = o.job.run.quiet ? 0 : 1;
    run.extra_files = {{kConfigFile, effective_options(&cmd).dump(2) + "\n"}};
    return tune::Tuner(
               trainer, space,
               tune::TuneConfig{.metric = o.metric,
                                .mode = o.mode,
                                .num_samples = o.samples,
                                .max_concurrent_trials = o.max_concurrent,
                                .scheduler = scheduler_of(o),
                                .time_budget_s = o.time_budget,
                                .seed = o.search_seed,
                                .max_cpu_threads = o.cpus,
                                .metric_columns = {o.metric, "train_loss", "epoch", "steps"}},
               run)
        .fit();
  }();
  int64_t steps = 0, stopped = 0;
  for (size_t i = 0; i < grid.size(); ++i) {
    steps += grid[i].metrics.value("steps", int64_t{0});
    stopped += grid.trials()[i].stopped_early;
  }
  std::cout << "trials " << grid.size() << " | terminated " << grid.num_terminated()
            << " (stopped early " << stopped << ") | errored " << grid.num_errors()
            << " | training steps " << steps << "\n";
  for (const auto& error : grid.errors()) std::cerr << "error: " << error << "\n";
  if (grid.num_terminated() == 0) return 1;
  try {
    const Result best = grid.get_best_result(o.metric, o.mode);
    std::cout << "best " << o.metric << " " << best.metrics.value(o.metric, 0.0) << " | trial "
              << best.path.filename().string() << " | config " << best.config.dump() << "\n";
  } catch (const UsageError& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  std::cout << "trials: " << (grid.experiment_path() / "trials.csv").string() << std::endl;
  return 0;
}

}  // namespace cohort::cli

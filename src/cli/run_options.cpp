#include "cohort/cli/run_options.h"

#include <stdexcept>

#include "cli/bool_flag.h"
#include "cohort/comm/address.h"
#include "cohort/error.h"

namespace cohort::cli {
namespace {

// --umask: octal permission bits, as the shell's umask.
int umask_of(const std::string& text) {
  const bool octal =
      !text.empty() && text.size() <= 4 && text.find_first_not_of("01234567") == std::string::npos;
  const int mask = octal ? std::stoi(text, nullptr, 8) : -1;
  if (mask < 0 || mask > 0777) {
    throw UsageError("unknown --umask '" + text +
                     "': give octal permission bits such as 077 (the run is yours alone, the "
                     "default) or 022 (others may read it)");
  }
  return mask;
}

// --profile-steps "A-B" or "N" (steps count from 1; A <= B; not past `max_steps`).
RunConfig::ProfileSteps profile_steps_of(const std::string& text, int64_t max_steps) {
  if (text.empty()) return {};
  const auto fail = [&](const std::string& why) {
    return UsageError("--profile-steps '" + text + "': " + why +
                      "; give the steps to trace as A-B (e.g. 100-110) or N, counted from 1");
  };
  RunConfig::ProfileSteps steps;
  const auto dash = text.find('-', 1);
  try {
    size_t used = 0;
    steps.first = std::stoll(text.substr(0, dash), &used);
    if (used != text.substr(0, dash).size()) throw std::invalid_argument(text);
    steps.last = steps.first;
    if (dash != std::string::npos) {
      const std::string last = text.substr(dash + 1);
      steps.last = std::stoll(last, &used);
      if (used != last.size()) throw std::invalid_argument(text);
    }
  } catch (const std::logic_error&) {
    throw fail("not a step range");
  }
  if (steps.first < 1) throw fail("steps count from 1");
  if (steps.last < steps.first) throw fail("the last step is before the first");
  if (max_steps > 0 && steps.first > max_steps) {
    throw fail("the run stops after --max-steps " + std::to_string(max_steps) + ", before step " +
               std::to_string(steps.first));
  }
  return steps;
}

// The dashboard of --dashboard [PORT], or none.
std::optional<DashboardOptions> dashboard_of(const RunOptions& o) {
  if (!o.dashboard) return std::nullopt;
  DashboardOptions options{.host = o.dashboard_host};
  if (!o.dashboard->empty()) {
    try {
      size_t used = 0;
      options.port = std::stoi(*o.dashboard, &used);
      if (used != o.dashboard->size()) throw std::invalid_argument(*o.dashboard);
    } catch (const std::logic_error&) {
      throw UsageError("--dashboard '" + *o.dashboard +
                       "' is not a port: give a number such as 8265, or 0 for a free port");
    }
    if (options.port < 0 || options.port > 65535) {
      throw UsageError("--dashboard " + *o.dashboard +
                       " is out of range: give a port from 1 to 65535, or 0 for a free one");
    }
  }
  return options;
}

}  // namespace

const OptionNames kRunFlagNames{{"RunConfig.umask", "--umask"},
                                {"RunConfig.profile_steps", "--profile-steps"},
                                {"RunConfig.log_every_steps", "--log-every-steps"},
                                {"FailureConfig.max_failures", "--max-failures"},
                                {"FailureConfig.heartbeat_timeout", "--heartbeat-timeout"},
                                {"FailureConfig.recovery", "--recovery"},
                                {"FailureConfig.replace_lost", "--no-replace-lost"}};

RunConfig RunOptions::run_config(int64_t max_steps) const {
  const auto& o = *this;
  if (!(o.heartbeat_timeout_s > 0)) {  // before it is converted to milliseconds
    throw UsageError("--heartbeat-timeout " + std::to_string(o.heartbeat_timeout_s) +
                     " must be > 0 seconds");
  }
  if (!o.rdzv.empty()) comm::parse_etcd_endpoint(o.rdzv, "--rdzv");
  if (o.num_to_keep < 0) throw UsageError("--num-to-keep must be >= 0 (0: keep all)");
  if (o.checkpoint_every_steps && *o.checkpoint_every_steps < 1) {
    throw UsageError("--checkpoint-every-steps " + std::to_string(*o.checkpoint_every_steps) +
                     " must be >= 1 (leave it out to checkpoint at each epoch's end only)");
  }
  if (o.snapshot_every_steps && *o.snapshot_every_steps < 1) {
    throw UsageError("--snapshot-every-steps " + std::to_string(*o.snapshot_every_steps) +
                     " must be >= 1 (leave it out to keep no in-memory snapshots)");
  }
  if (o.checkpoint_when_busy != "wait" && o.checkpoint_when_busy != "skip") {
    throw UsageError("unknown --checkpoint-when-busy '" + o.checkpoint_when_busy +
                     "': choose wait or skip");
  }
  if (o.checkpoint_when_busy == "skip" && !o.async_checkpoint) {
    throw UsageError(
        "--checkpoint-when-busy skip needs --async-checkpoint: only an asynchronous save can "
        "still be in flight at the next checkpoint");
  }
  if (o.snapshot_every_steps && o.snapshot_dir.empty()) {
    throw UsageError(
        "--snapshot-every-steps needs a --snapshot-dir: memory-backed storage of "
        "each node (e.g. /dev/shm/cohort-snapshots)");
  }
  if (o.recovery != "restart" && o.recovery != "live")
    throw UsageError("unknown --recovery '" + o.recovery + "': choose restart or live");
  return RunConfig{
      .name = o.name,
      .storage_path = o.storage_path,
      .failure_config = {.max_failures = o.max_failures,
                         .heartbeat_timeout = std::chrono::milliseconds(
                             static_cast<int64_t>(o.heartbeat_timeout_s * 1000)),
                         .recovery = o.recovery == "live" ? FailureConfig::Recovery::kLive
                                                          : FailureConfig::Recovery::kRestart,
                         .replace_lost = o.replace_lost},
      .checkpoint_config = {.num_to_keep = o.num_to_keep},
      .resume = o.resume,
      .snapshot_path = o.snapshot_dir,
      .verbose = o.quiet ? 0 : 1,
      .rendezvous = o.rdzv,
      .tensorboard = {.enabled = o.tensorboard, .histograms = o.tensorboard_histograms},
      .log_every_steps = o.log_every_steps,
      .umask = umask_of(o.umask),
      .dashboard = dashboard_of(o),
      .profile_steps = profile_steps_of(o.profile_steps, max_steps)};
}

void RunOptions::apply(train::EpochLoopOptions& loop) const {
  loop.checkpoint_every_steps = checkpoint_every_steps.value_or(0);
  loop.snapshot_every_steps = snapshot_every_steps.value_or(0);
  loop.save = {.async = async_checkpoint, .skip_when_busy = checkpoint_when_busy == "skip"};
}

void to_json(Json& j, const RunOptions& o) {
  j = Json{{"storage_path", o.storage_path},
           {"name", o.name},
           {"resume", o.resume},
           {"max_failures", o.max_failures},
           {"recovery", o.recovery},
           {"replace_lost", o.replace_lost},
           {"heartbeat_timeout_s", o.heartbeat_timeout_s},
           {"num_to_keep", o.num_to_keep},
           {"async_checkpoint", o.async_checkpoint},
           {"checkpoint_when_busy", o.checkpoint_when_busy},
           {"snapshot_dir", o.snapshot_dir},
           {"rdzv", o.rdzv},
           {"umask", o.umask},
           {"quiet", o.quiet},
           {"tensorboard", o.tensorboard},
           {"tensorboard_histograms", o.tensorboard_histograms},
           {"profile_steps", o.profile_steps},
           {"log_every_steps", o.log_every_steps},
           {"dashboard_host", o.dashboard_host}};
  if (o.checkpoint_every_steps) j["checkpoint_every_steps"] = *o.checkpoint_every_steps;
  if (o.snapshot_every_steps) j["snapshot_every_steps"] = *o.snapshot_every_steps;
  if (o.dashboard) j["dashboard"] = *o.dashboard;
}

void from_json(const Json& j, RunOptions& o) {
  const RunOptions d;
  o.storage_path = json_field(j, "storage_path", d.storage_path);
  o.name = json_field(j, "name", d.name);
  o.resume = json_field(j, "resume", d.resume);
  o.max_failures = json_field(j, "max_failures", d.max_failures);
  o.recovery = json_field(j, "recovery", d.recovery);
  o.replace_lost = json_field(j, "replace_lost", d.replace_lost);
  o.heartbeat_timeout_s = json_field(j, "heartbeat_timeout_s", d.heartbeat_timeout_s);
  o.num_to_keep = json_field(j, "num_to_keep", d.num_to_keep);
  o.async_checkpoint = json_field(j, "async_checkpoint", d.async_checkpoint);
  o.checkpoint_when_busy = json_field(j, "checkpoint_when_busy", d.checkpoint_when_busy);
  o.snapshot_dir = json_field(j, "snapshot_dir", d.snapshot_dir);
  o.rdzv = json_field(j, "rdzv", d.rdzv);
  o.umask = json_field(j, "umask", d.umask);
  o.quiet = json_field(j, "quiet", d.quiet);
  o.tensorboard = json_field(j, "tensorboard", d.tensorboard);
  o.tensorboard_histograms = json_field(j, "tensorboard_histograms", d.tensorboard_histograms);
  o.profile_steps = json_field(j, "profile_steps", d.profile_steps);
  o.log_every_steps = json_field(j, "log_every_steps", d.log_every_steps);
  o.dashboard_host = json_field(j, "dashboard_host", d.dashboard_host);
  if (j.contains("checkpoint_every_steps"))
    o.checkpoint_every_steps = json_field<int64_t>(j, "checkpoint_every_steps", 0);
  if (j.contains("snapshot_every_steps"))
    o.snapshot_every_steps = json_field<int64_t>(j, "snapshot_every_steps", 0);
  if (j.contains("dashboard")) o.dashboard = json_field<std::string>(j, "dashboard", "");
}

void add_run_options(CLI::App* cmd, RunOptions& o) {
  const auto group = cmd->option_defaults()->get_group();
  cmd->option_defaults()->group("Run directory and recovery");
  cmd->add_option("--storage-path", o.storage_path, "where run directories go")
      ->capture_default_str();
  cmd->add_option("--name", o.name, "run directory name (default: cohort_<date>_<time>)");
  add_bool_flag(cmd, "--resume,!--no-resume", o.resume,
                "continue a run with the same --storage-path and --name from its latest checkpoint "
                "(default)");
  cmd->add_option(
         "--max-failures", o.max_failures,
         "restarts after a worker failure, each from the latest checkpoint (-1: unlimited)")
      ->capture_default_str();
  cmd->add_option("--recovery", o.recovery,
                  "when a worker dies or hangs: restart the group from the latest checkpoint or "
                  "snapshot (--max-failures times), or live: the survivors go on without it at "
                  "the current step, in the same processes, with a replacement in the lost one's "
                  "place (DDP, local SGD, DiLoCo and ZeRO 1-3 in sharding groups, under the "
                  "local driver or cohort launch)")
      ->capture_default_str();
  add_bool_flag(cmd, "--replace-lost,!--no-replace-lost", o.replace_lost,
                "with --recovery live: start a replacement for a lost worker, which takes its "
                "state from a survivor (the group keeps its size); --no-replace-lost: the "
                "survivors go on alone, down to --min-workers");
  cmd->add_option("--heartbeat-timeout", o.heartbeat_timeout_s,
                  "seconds a rank may send no heartbeat before the coordinator stops the group "
                  "naming it (a hung or stopped rank)")
      ->capture_default_str();
  cmd->add_option("--num-to-keep", o.num_to_keep,
                  "checkpoints kept besides the latest, the best by the run's score (cohort train: "
                  "test accuracy; 0: all)")
      ->capture_default_str();
  cmd->add_option("--checkpoint-every-steps", o.checkpoint_every_steps,
                  "also checkpoint every N optimizer steps (a run killed inside an epoch then "
                  "resumes at most N steps back); default: at each epoch's end only");
  cmd->add_option("--snapshot-every-steps", o.snapshot_every_steps,
                  "keep an in-memory snapshot every N optimizer steps, with a copy on a buddy "
                  "worker (on another node when the job spans nodes): a restart after a failure "
                  "resumes from it, at most N steps back, when it is newer than the last "
                  "checkpoint");
  cmd->add_option("--snapshot-dir", o.snapshot_dir,
                  "memory-backed storage of each node where snapshots are kept (the run's folder "
                  "goes when it ends)")
      ->capture_default_str();
  add_bool_flag(cmd, "--async-checkpoint", o.async_checkpoint,
                "write checkpoints behind the training loop: a step waits only while each "
                "worker copies its state into memory; the writing into the run directory and the "
                "commit happen on a thread of their own");
  cmd->add_option("--checkpoint-when-busy", o.checkpoint_when_busy,
                  "with --async-checkpoint, when a save is still being written at the next "
                  "checkpoint: wait for it, or skip this one (its report says so)")
      ->capture_default_str();
  cmd->add_option("--rdzv", o.rdzv,
                  "under a launcher (torchrun, srun, mpirun): etcd://HOST:PORT makes the ranks "
                  "rendezvous in etcd there (cohort launch --rdzv sets it for its ranks)");
  cmd->add_option("--umask", o.umask,
                  "permission bits taken from the run directory and its files, in octal as the "
                  "shell's umask: 077 keeps the run yours alone, 022 lets others read it")
      ->capture_default_str();
  cmd->option_defaults()->group("Output and observability");
  add_bool_flag(cmd, "--quiet", o.quiet, "no progress bar or report lines");
  add_bool_flag(cmd, "--tensorboard,!--no-tensorboard", o.tensorboard,
                "write TensorBoard event files under <run>/tensorboard/: every reported metric, "
                "the config (default)");
  add_bool_flag(cmd, "--tensorboard-histograms", o.tensorboard_histograms,
                "also histograms of the parameters and gradients at each report");
  cmd->add_option("--log-every-steps", o.log_every_steps,
                  "the training loss and step time of every N-th step go to <run>/steps.jsonl, "
                  "TensorBoard (step/...) and the dashboard's step charts (0: about every 15 s)")
      ->capture_default_str();
  cmd->add_option("--dashboard", o.dashboard,
                  "serve a live dashboard of the runs under --storage-path while training, on "
                  "this port (default 8265; 0: a free one); the address is printed")
      ->expected(0, 1);
  cmd->add_option("--dashboard-host", o.dashboard_host,
                  "the dashboard's address (0.0.0.0: reachable from other hosts)")
      ->capture_default_str();
  cmd->add_option("--profile-steps", o.profile_steps,
                  "trace these steps (A-B or N, from 1): each rank writes its data wait, "
                  "forward, backward, communication wait, optimizer and checkpoint spans to "
                  "<run>/trace/rank-R.json (Chrome trace JSON, for ui.perfetto.dev)");
  cmd->option_defaults()->group(group);
}

}  // namespace cohort::cli

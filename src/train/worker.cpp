// The worker side of Trainer::fit: a rank started by cohort's local driver, or by an external
// launcher (torchrun-style variables, mpirun, srun, cohort launch), where rank 0 also keeps the
// run's bookkeeping.
#include <c10/core/impl/VirtualGuardImpl.h>
#include <sys/stat.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <mutex>
#include <optional>

#include <thread>

#include "cohort/comm/address.h"
#include "cohort/comm/store.h"
#include "cohort/data/data_iterator.h"
#include "cohort/error.h"
#include "cohort/runtime/blas.h"
#include "cohort/runtime/control_channel.h"
#include "cohort/runtime/coordinator.h"
#include "cohort/runtime/environment.h"
#include "cohort/runtime/gpus.h"
#include "cohort/runtime/heap.h"
#include "cohort/runtime/node_launcher.h"
#include "cohort/runtime/process.h"
#include "cohort/runtime/worker_info.h"
#include "cohort/train/prepare.h"
#include "comm/handshake.h"
#include "runtime/worker_spec.h"
#include "train/driver.h"
#include "train/flight_records.h"
#include "train/launched_run.h"
#include "train/live_recovery.h"
#include "train/run_files.h"
#include "train/session_spec.h"
#include "train/snapshots.h"
#include "train/worker_session.h"

namespace cohort::train {
namespace {

using Clock = std::chrono::steady_clock;

void set_threads(int threads) {
  torch::set_num_threads(threads);
  try {
    torch::set_num_interop_threads(1);
  } catch (const std::exception&) {
    // Already fixed by earlier torch use in this process; harmless.
  }
}

// Everything a rank needs to join its group, from the driver's variables or from rank 0.
struct SessionSettings {
  runtime::WorkerInfo info;
  comm::Store store;
  std::string run_token;
  std::chrono::milliseconds setup_timeout{};
  std::chrono::milliseconds collective_timeout{};
  std::string name;
  std::filesystem::path run_dir;
  std::chrono::system_clock::time_point run_start;
  std::string resume_from;
  bool resume = true;                   // RunConfig::resume
  std::filesystem::path snapshot_path;  // RunConfig::snapshot_path
  int64_t next_checkpoint_index = 0;
  c10::Device device = c10::Device(c10::DeviceType::CPU);
  comm::Backend backend = comm::Backend::kAuto;
  std::string interface_address = "127.0.0.1";
  bool tensorboard_histograms = false;
  RunConfig::ProfileSteps profile_steps;
  int64_t log_every_steps = 0;
  int umask = 077;  // RunConfig::umask
  int cpu_threads = 1;
  SessionScaling scaling;
  // A function: the worker program's own ScalingConfig's.
  decltype(ScalingConfig::on_world_size_change) on_world_size_change;
  // FailureConfig::Recovery::kLive (the local driver's workers, or cohort launch's ranks), the
  // token the decisions are keyed by (the group's first), and the live regroup this session
  // starts after, if any.
  bool live_recovery = false;
  std::string live_token;
  const LiveRegroup* regroup = nullptr;
};

// Where a survivor keeps the state a live regroup healed it with: the node's memory-backed
// snapshot storage, else the run directory.
std::filesystem::path live_state_folder(const SessionSettings& settings) {
  const auto root = settings.snapshot_path.empty()
                        ? settings.run_dir
                        : snapshot_run_folder(settings.snapshot_path, settings.run_dir);
  return live_state_folder_in(root, settings.live_token, settings.info.world_rank);
}

// The device of a worker with `per_worker` GPUs (0: the CPU), made the current CUDA device.
c10::Device device_of(int per_worker, int local_rank) {
  if (per_worker == 0) return c10::Device(c10::DeviceType::CPU);
  const int visible = static_cast<int>(runtime::visible_gpus().size());
  const c10::Device device(c10::DeviceType::CUDA,
                           static_cast<c10::DeviceIndex>(runtime::device_index_of_local_rank(
                               local_rank, per_worker, visible)));
  c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).setDevice(device);
  return device;
}

// Once per host and CPU run: where libtorch's matrix products run on the reference BLAS, a line
// saying so and what to install (runtime/blas.h); a GPU's products do not use it.
void advise_on_blas(const runtime::WorkerInfo& info, const c10::Device& device) {
  if (info.local_rank != 0 || !device.is_cpu()) return;
  if (const auto advice = runtime::blas_advice(); !advice.empty())
    std::cerr << "cohort: " << advice << std::endl;
}

// Joins the process group: the session a SessionScope then owns while the train loop runs.
std::unique_ptr<WorkerSession> open_session(SessionSettings settings,
                                            const std::map<std::string, data::Dataset>& datasets) {
  auto session = std::make_unique<WorkerSession>();
  session->store = settings.store;
  session->run_token = settings.run_token;
  session->collective_timeout = settings.collective_timeout;
  session->datasets = datasets;
  // Preprocessing workers (num_workers = -1) get the CPUs this host's trainers leave free.
  {
    const int cpus = static_cast<int>(std::thread::hardware_concurrency());
    const int local = std::max(1, settings.info.local_world_size);
    const int trainers = local * std::max(1, settings.cpu_threads);
    data::set_default_data_workers(std::max(1, (cpus - trainers) / local));
  }
  const auto& scaling = settings.scaling;
  session->on_world_size_change = settings.on_world_size_change;
  session->num_parameter_servers = scaling.num_parameter_servers;
  session->interface_address = settings.interface_address;
  session->remote_preprocessing_dataset = scaling.remote_preprocessing_dataset;
  session->data_members = runtime::env_int(runtime::kDataMembersVar, session->data_members, 0);
  session->next_checkpoint_index = settings.next_checkpoint_index;
  session->tensorboard_histograms = settings.tensorboard_histograms;
  session->step_log.every_steps = settings.log_every_steps;
  session->umask = settings.umask;
  // Until the model is prepared, what its construction and preparation free goes back to the
  // system (runtime/heap.h).
  session->heap_in_setup = runtime::heap_for_setup();
  if (!settings.resume_from.empty())
    session->resume_from = Checkpoint::from_directory(settings.resume_from);
  auto& ctx = session->context;
  const auto& info = settings.info;
  ctx.world_rank = info.world_rank;
  ctx.local_rank = info.local_rank;
  ctx.node_rank = info.node_rank;
  ctx.world_size = info.world_size;
  ctx.local_world_size = info.local_world_size;
  ctx.experiment_name = settings.name;
  ctx.storage_path = settings.run_dir;
  ctx.run_start = settings.run_start;
  ctx.device = settings.device;
  // With live recovery the driver signals a lost peer, and the group's collectives stop waiting.
  std::function<bool()> aborted;
  if (settings.live_recovery) {
    runtime::watch_peer_losses();
    aborted = [seen = runtime::peer_losses()] { return runtime::peer_losses() != seen; };
  }
  ctx.process_group = comm::ProcessGroup::create(settings.store, info.world_rank, info.world_size,
                                                 {.interface_address = settings.interface_address,
                                                  .setup_timeout = settings.setup_timeout,
                                                  .timeout = settings.collective_timeout,
                                                  .prefix = "train/" + settings.run_token,
                                                  .backend = settings.backend,
                                                  .aborted = aborted});
  record_flights(ctx.process_group, settings.run_dir, info.world_rank);
  if (scaling.mesh.pp * scaling.mesh.tp > 1)
    ctx.mesh = parallel::DeviceMesh::create(ctx.process_group, scaling.mesh);
  ctx.precision = optim::precision_from_string(scaling.precision);
  optim::check_precision_supported(ctx.precision, ctx.device);
  session->loss_scaler = std::make_unique<optim::LossScaler>(
      scaling.loss_scaler, ctx.process_group, ctx.precision == optim::Precision::kFp16);
  session->live_recovery = settings.live_recovery;
  session->collectives_aborted = aborted;
  session->live_token = settings.live_token;
  if (settings.regroup != nullptr) {
    session->live_round = settings.regroup->round;
    session->resume_from = heal_from_peer(
        *settings.regroup, settings.store, settings.run_token, settings.interface_address,
        settings.setup_timeout, live_state_folder(settings), settings.umask, session->kept_state);
  }
  if (!settings.snapshot_path.empty()) {
    session->snapshot_folder = snapshot_run_folder(settings.snapshot_path, settings.run_dir);
    if (settings.regroup == nullptr)
      choose_snapshot_to_restore(*session, settings.resume, settings.setup_timeout);
  }
  runtime::watch_stop_requests();
  if (settings.profile_steps.first > 0) {
    const auto file =
        settings.run_dir / kTraceDir / ("rank-" + std::to_string(info.world_rank) + ".json");
    const auto steps = settings.profile_steps;
    trace::set_profile_steps(
        steps.first, steps.last,
        [file, steps, rank = info.world_rank](const std::vector<trace::Event>& events) {
          std::filesystem::create_directories(file.parent_path());
          write_atomically(file, trace::chrome_trace(events, rank));
          if (rank == 0) {
            std::cout << "trace of steps " << steps.first << "-" << steps.last
                      << " written: " << (file.parent_path() / "rank-<R>.json").string()
                      << " for each rank R (open them in ui.perfetto.dev)" << std::endl;
          }
        });
  }
  return session;
}

// A collective that failed or timed out because of a peer is a consequence of that peer's
// failure; the driver names the cause first.
bool is_consequence(const std::exception& e) {
  return dynamic_cast<const PeerFailureError*>(&e) != nullptr ||
         dynamic_cast<const TimeoutError*>(&e) != nullptr;
}

// A rank whose collective failed or timed out writes its flight recorder before it reports the
// failure: what it did last is what names a hang.
void dump_flight_records_after(const std::exception& e) {
  if (is_consequence(e)) runtime::dump_flight_recorder(e.what());
}

[[noreturn]] void end_process(int code) {
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  // Skip static destructors: the process group's threads may still be blocked on a dead peer,
  // and nothing after the loop needs them.
  std::_Exit(code);
}

// Where rank 0 of a launched job leaves the job secret for the others when the environment gives
// none: the storage path, which every node shares when a multi-node run keeps one run directory.
std::string secret_file_of(const RunConfig& run, const runtime::WorkerInfo& info) {
  return (std::filesystem::path(run.storage_path) /
          (".job-secret-" + (info.job_id.empty() ? std::string("default") : info.job_id)))
      .string();
}

// A launched rank joins the job's store with the job's secret: the environment's
// (COHORT_JOB_SECRET or COHORT_JOB_SECRET_FILE; `cohort launch` sets the first), else one rank 0
// makes and writes to a private file under the storage path, which the others read there. A file
// left by an earlier job may be read before rank 0 replaces it: the store then refuses the proof,
// and the rank reads the file again until the setup deadline.
comm::Store join_launched_store(const runtime::WorkerInfo& info, const RunConfig& run, bool serve,
                                std::string& secret_file) {
  comm::StoreOptions options{.host = info.master_addr,
                             .port = info.store_port,
                             .is_server = serve,
                             .timeout = run.setup_timeout,
                             .job_id = info.job_id};
  if (info.etcd) {
    options.host = info.etcd->host;
    options.port = info.etcd->port;
    options.etcd = true;
  }
  if (auto given = runtime::job_secret_from_env()) {
    options.secret = *given;
    return comm::Store::connect(options);
  }
  if (info.etcd && info.world_size > 1) {
    // In etcd the first rank to arrive records the secret's proof: one read from a stale file
    // would shut rank 0 out.
    throw UsageError(std::string("ranks that rendezvous in etcd need the job secret from their "
                                 "environment: set ") +
                     runtime::kJobSecretVar + " (or " + runtime::kJobSecretFileVar +
                     ") to the same secret for every rank, or " + runtime::kInsecureVar + "=1");
  }
  if (info.world_size == 1 && serve) {
    options.secret = comm::JobSecret::generate();
    return comm::Store::connect(options);
  }
  secret_file = secret_file_of(run, info);
  if (info.world_rank == 0) {
    std::filesystem::create_directories(run.storage_path);
    options.secret = comm::JobSecret::generate();
    options.secret.write_file(secret_file);
    return comm::Store::connect(options);
  }
  const auto deadline = Clock::now() + run.setup_timeout;
  while (true) {
    std::error_code missing;
    if (std::filesystem::exists(secret_file, missing)) {
      options.secret = comm::JobSecret::read_file(secret_file);
      options.timeout =
          std::max(std::chrono::milliseconds(1000),
                   std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
      try {
        return comm::Store::connect(options);
      } catch (const comm::SecretRefused&) {
        if (Clock::now() >= deadline) throw;  // not rank 0's secret of this job
      }
    } else if (Clock::now() >= deadline) {
      throw TimeoutError(
          "rank " + std::to_string(info.world_rank) + " waited " +
          std::to_string(run.setup_timeout.count()) + " ms for the job secret rank 0 writes to " +
          secret_file + ": where nodes share no storage path, set " + runtime::kJobSecretVar +
          " (or " + runtime::kJobSecretFileVar + ") to the same secret on every node");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // rank 0 writes it, then serves
  }
}

// A live round's state (in memory, under the snapshots' folder) goes with the process however it
// ends: a failed round's is no snapshot, and nothing restores from it.
struct LiveStateRemover {
  const SessionSettings& settings;
  ~LiveStateRemover() {
    if (settings.regroup != nullptr) remove_tree(live_state_folder(settings));
  }
};

// Runs the train loop in a session of `settings`, and with live recovery again in each live
// round's group after a LiveRegroup, from the state the regroup heals it with. `regroup`: a
// replacement's first round (settings.regroup points at it), then each round's. `settings` ends
// as of the last round (its rank, world size and token).
void train_in_live_rounds(SessionSettings& settings, std::optional<LiveRegroup>& regroup,
                          const std::map<std::string, data::Dataset>& datasets,
                          const std::function<void(const Json&)>& train_loop, const Json& config) {
  // The groups a regroup left: a collective may still wait inside one until its deadline, which
  // their destructors would wait for. They live as long as the process and are never destroyed
  // (rank 0 under a launcher returns from fit() and ends normally): kept reachable here.
  static auto* abandoned = new std::vector<comm::ProcessGroup>();
  while (true) {
    SessionScope scope(open_session(settings, datasets));
    try {
      if (regroup) {
        // Sent and written: their memory is free again (the kept tensors once the session's
        // model loaded them).
        regroup->state.reset();
        regroup->kept.reset();
        regroup->own.reset();
      }
      train_loop(config);
      finish_session();
      return;
    } catch (const LiveRegroup& next) {
      regroup = next;
    }
    // The session ends with this round; its groups live on (see `abandoned`).
    abandoned->push_back(scope.session().context.process_group);
    abandoned->push_back(scope.session().snapshot_group);
    if (settings.regroup != nullptr) remove_tree(live_state_folder(settings));
    settings.info.world_rank = regroup->rank;
    settings.info.world_size = regroup->world_size;
    settings.run_token = live_run_token(settings.live_token, regroup->round);
    settings.next_checkpoint_index = regroup->next_checkpoint_index;
    settings.regroup = &*regroup;
  }
}

}  // namespace

void run_worker(const std::function<void(const Json&)>& train_loop, const ScalingConfig& scaling,
                const std::map<std::string, data::Dataset>& datasets) {
  int code = 0;
  int rank = -1;
  try {
    auto info = runtime::worker_info_from_env();
    if (!info) throw RuntimeError("worker started without RANK/WORLD_SIZE");
    rank = info->world_rank;
    const runtime::WorkerSpec process = runtime::worker_spec_from_env();
    set_threads(process.cpu_threads);
    // First of all, so that even a slow start is not taken for a hang.
    runtime::start_heartbeat(process.heartbeat.interval);
    const SessionSpec spec = session_spec_from_json(process.session);
    SessionSettings settings;
    const LiveStateRemover live_state_remover{settings};
    settings.info = *info;
    settings.setup_timeout = process.setup_timeout;
    settings.collective_timeout = process.collective_timeout;
    const auto secret = runtime::job_secret_from_env();
    if (!secret) {
      throw UsageError(std::string("a worker of the local driver got no ") +
                       runtime::kJobSecretVar + ": start it through a Trainer's fit()");
    }
    settings.store = comm::Store::connect({.host = info->master_addr,
                                           .port = info->master_port,
                                           .is_server = false,
                                           .timeout = settings.setup_timeout,
                                           .secret = *secret});
    settings.run_token = process.run_token;
    settings.name = spec.name;
    settings.run_dir = spec.run_dir;
    settings.run_start = std::chrono::system_clock::time_point(
        std::chrono::duration_cast<std::chrono::system_clock::duration>(
            std::chrono::nanoseconds(spec.run_start_ns)));
    settings.resume_from = spec.resume_from;
    settings.resume = spec.resume;
    settings.snapshot_path = spec.snapshot_path;
    settings.next_checkpoint_index = spec.next_checkpoint_index;
    settings.device = device_of(process.gpus_per_worker, info->local_rank);
    advise_on_blas(*info, settings.device);
    settings.backend = comm::backend_from_string(process.backend);
    settings.tensorboard_histograms = spec.tensorboard_histograms;
    settings.profile_steps = {.first = spec.profile_first, .last = spec.profile_last};
    settings.log_every_steps = spec.log_every_steps;
    // A process the driver started for the run: every file it creates takes the run's mask. It
    // is set here, not inherited: the worker re-ran the program up to fit(), which may have set
    // its own umask on the way.
    ::umask(static_cast<mode_t>(process.umask));
    settings.umask = process.umask;
    // The driver's ScalingConfig, not this program's first Trainer's.
    settings.cpu_threads = process.cpu_threads;
    settings.scaling = spec.scaling;
    settings.on_world_size_change = scaling.on_world_size_change;
    settings.live_recovery = spec.live_recovery;
    settings.live_token = process.run_token;
    // With live recovery a lost peer ends a loop with a LiveRegroup: the loop runs again in the
    // new group, from the state of the survivor that stepped furthest.
    std::optional<LiveRegroup> regroup;
    if (spec.live_round > 0) {
      // A replacement: it joins the live round's group and takes the source's state.
      regroup = LiveRegroup{.round = spec.live_round,
                            .rank = info->world_rank,
                            .world_size = info->world_size,
                            .source = spec.live_source,
                            .next_checkpoint_index = spec.next_checkpoint_index};
      settings.run_token = live_run_token(process.run_token, spec.live_round);
      settings.regroup = &*regroup;
    }
    train_in_live_rounds(settings, regroup, datasets, train_loop, spec.config);
    rank = settings.info.world_rank;
    trace::finish_profile();
  } catch (const std::exception& e) {
    code = 1;
    std::cerr << "error: " << e.what() << std::endl;
    dump_flight_records_after(e);
    if (runtime::has_control_channel()) {
      try {
        runtime::send_control_message(Json{
            {"type", "error"},
            {"rank", rank},
            {"message", e.what()},
            {"consequence",
             is_consequence(e)}}.dump());
      } catch (...) {
      }
    }
  }
  end_process(code);
}

Result run_launched(const std::function<void(const Json&)>& train_loop,
                    const ScalingConfig& scaling, const RunConfig& run, const Json& config,
                    const std::map<std::string, data::Dataset>& datasets,
                    runtime::WorkerInfo info) {
  const auto started = Clock::now();
  // Rank 0 opens the run directory here: everything of the run takes its mask while it lasts.
  const ScopedUmask umask(run.umask);
  const std::string where = " (launched by " + info.launcher + " as rank " +
                            std::to_string(info.world_rank) + " of " +
                            std::to_string(info.world_size) + ")";
  const bool live = run.failure_config.recovery == FailureConfig::Recovery::kLive;
  if (live && info.launcher != "cohort-launch") {
    throw UsageError(
        "live recovery (FailureConfig.recovery, --recovery live) needs cohort's local driver or "
        "cohort launch, which start a lost rank's replacement" +
        where +
        ": under this launcher use --recovery restart, with --snapshot-every-steps K to restore "
        "from in-memory snapshots");
  }
  if (live && runtime::env_int(runtime::kDataMembersVar, 0, 0) > 0) {
    throw UsageError(
        "live recovery (--recovery live) does not regroup the data workers of cohort launch "
        "--data-workers" +
        where + ": use --recovery restart, or preprocess on the ranks' nodes");
  }
  // A replacement that cohort launch started in a lost rank's place (live recovery): the job
  // host's decision, with the place it takes as the coordinator knows it.
  std::optional<Json> join;
  if (const auto text = runtime::env_string(runtime::kLiveJoinVar); !text.empty()) {
    if (!live) {
      throw UsageError(std::string(runtime::kLiveJoinVar) +
                       " is set, but this rank does not recover live (--recovery live): only "
                       "cohort launch sets it, in a replacement of such a job's rank");
    }
    join = Json::parse(text);
  }
  // With min_workers, a launcher that lost a node (cohort launch --min-nodes) may restart the
  // group smaller: any size from min_workers to num_workers.
  const int fewest = scaling.min_workers > 0 ? scaling.min_workers : scaling.num_workers;
  if (!join && (info.world_size > scaling.num_workers || info.world_size < fewest)) {
    throw UsageError(
        "ScalingConfig.num_workers=" + std::to_string(scaling.num_workers) +
        (scaling.min_workers > 0 ? " (min_workers=" + std::to_string(scaling.min_workers) + ")"
                                 : std::string()) +
        " but the launcher started " + std::to_string(info.world_size) + " processes" + where +
        ": make them agree (e.g. srun -n / mpirun -np / --nnodes x --nproc-per-node)");
  }
  set_threads(scaling.resources_per_worker.cpu_threads);
  const bool rank0 = info.world_rank == 0;
  const bool serve = rank0 && !info.store_on_launcher;
  SessionSettings settings;
  settings.info = info;
  settings.setup_timeout = run.setup_timeout;
  settings.collective_timeout = run.collective_timeout;
  settings.tensorboard_histograms = run.tensorboard.enabled && run.tensorboard.histograms;
  settings.profile_steps = run.profile_steps;
  settings.log_every_steps = run.log_every_steps;
  settings.umask = run.umask;
  std::string secret_file;  // where rank 0 left the job secret for the others, if it did
  if (!run.rendezvous.empty())
    info.etcd = comm::parse_etcd_endpoint(run.rendezvous, "RunConfig.rendezvous (--rdzv)");
  settings.store = join_launched_store(info, run, serve, secret_file);
  const std::string round = "job/" + std::to_string(info.restart_round) + "/";

  // Same program everywhere, or a clear refusal.
  if (join) {
    // The others met long ago: a replacement compares itself with rank 0.
    check_same_program("the replacement of rank " + std::to_string(join->at("index").get<int>()),
                       program_identity(), settings.store.get(round + "binary/0"));
  } else {
    const auto fingerprints = settings.store.arrive_and_wait(
        round + "binary/", info.world_rank, info.world_size, program_identity(),
        "join the rendezvous (" + settings.store.where() + ")", run.setup_timeout);
    // Every rank is in: the secret's file has served its purpose.
    if (rank0 && !secret_file.empty()) std::filesystem::remove(secret_file);
    for (int r = 1; r < info.world_size; ++r) {
      check_same_program("rank " + std::to_string(r), fingerprints[static_cast<size_t>(r)],
                         fingerprints[0]);
    }
  }

  // Rank 0 opens the run directory (on storage all nodes share), hosts the coordinator and tells
  // the others where both are. Under cohort launch a run that recovers live has the job host do
  // that (job_host.cpp), at rank 0's word: then rank 0 is a rank as any, which may be lost.
  settings.interface_address = runtime::data_plane_address(info.master_addr);
  const runtime::HeartbeatOptions heartbeat = heartbeat_options(run);
  const bool job_host = job_host_keeps_run(run, info);
  const bool host_here = rank0 && !job_host;
  std::optional<LaunchedRun> host;
  if (host_here) {
    host.emplace(run, config,
                 LaunchedRunOptions{.world_size = info.world_size,
                                    .restart_round = info.restart_round,
                                    .job_id = info.job_id,
                                    .launcher = info.launcher,
                                    .store = settings.store,
                                    .bind_address = settings.interface_address,
                                    .started = started,
                                    .on_verdict = [&](const runtime::Coordinator::Verdict& v) {
                                      // Rank 0's own error comes from its training thread,
                                      // which ends the run itself.
                                      if (v.rank == 0) return;
                                      if (host->finish_after(v)) end_process(1);
                                    }});
    host->publish();
  }
  // Node 0's launcher starts the job host at rank 0's word, and stops asking once it was said.
  if (rank0 && !join && info.launcher == "cohort-launch")
    settings.store.set(runtime::launch_host_key(info.restart_round), job_host ? "1" : "0");
  const Json shared = Json::parse(settings.store.get(round + "run"));
  settings.name = shared["name"];
  settings.run_dir = shared["run_dir"].get<std::string>();
  settings.resume_from = shared["resume_from"];
  settings.resume = run.resume;
  settings.snapshot_path = run.snapshot_path;
  settings.next_checkpoint_index = shared["next_checkpoint"];
  settings.run_token = shared["token"];
  settings.run_start = std::chrono::system_clock::time_point(
      std::chrono::duration_cast<std::chrono::system_clock::duration>(
          std::chrono::nanoseconds(shared["start_ns"].get<int64_t>())));
  if (!std::filesystem::is_directory(settings.run_dir)) {
    throw UsageError("rank " + std::to_string(info.world_rank) + " on " + runtime::host_name() +
                     " cannot see the run directory " + settings.run_dir.string() + " that " +
                     (job_host ? "the job host" : "rank 0") +
                     " created: RunConfig.storage_path must be storage every node shares");
  }
  settings.device =
      device_of(runtime::check_gpu_request(scaling.use_gpu, scaling.resources_per_worker.gpus,
                                           info.local_world_size, runtime::visible_gpus()),
                info.local_rank);
  advise_on_blas(info, settings.device);
  settings.backend = comm::backend_from_string(scaling.backend);

  if (host_here) {
    runtime::set_control_sink([&](const std::string& line) {
      host->coordinator().deliver(0, line);
      if (const auto broken = host->record(Json::parse(line)); !broken.empty())
        throw UsageError(broken);
    });
  } else {
    // A replacement takes the lost rank's place at the coordinator.
    runtime::connect_to_coordinator(shared["coordinator"],
                                    join ? join->at("index").get<int>() : info.world_rank,
                                    settings.run_token, settings.store.secret(), heartbeat,
                                    job_host ? "the job host" : "rank 0");
  }
  runtime::start_heartbeat(heartbeat.interval);
  std::optional<std::string> error;
  try {
    settings.cpu_threads = scaling.resources_per_worker.cpu_threads;
    settings.scaling = session_scaling_of(scaling);
    settings.on_world_size_change = scaling.on_world_size_change;
    settings.live_recovery = live;
    settings.live_token = settings.run_token;
    // With live recovery a lost peer ends a loop with a LiveRegroup: the loop runs again in the
    // new group (live_recovery.h), in this process.
    std::optional<LiveRegroup> regroup;
    if (join) {
      // A replacement: it joins the live round's group and takes the source's state.
      regroup = LiveRegroup{.round = join->at("live_round").get<int>(),
                            .rank = info.world_rank,
                            .world_size = info.world_size,
                            .source = join->at("source").get<int>(),
                            .next_checkpoint_index = join->at("next_checkpoint").get<int64_t>()};
      settings.run_token = live_run_token(settings.live_token, regroup->round);
      settings.next_checkpoint_index = regroup->next_checkpoint_index;
      settings.regroup = &*regroup;
    }
    const LiveStateRemover live_state_remover{settings};
    train_in_live_rounds(settings, regroup, datasets, train_loop, config);
    trace::finish_profile();
    // From here a rank that goes away is no longer a failure (the others may end first).
    if (!host_here) runtime::leave_coordinator();
    // Rank 0 serves the store: nobody may still need it when it returns. The group of the last
    // live round, if any, under its own keys.
    const std::string done =
        round + "done/" + (regroup ? "live" + std::to_string(regroup->round) + "/" : "");
    settings.store.arrive_and_wait(done, settings.info.world_rank, settings.info.world_size, "1",
                                   "finish the train loop", run.collective_timeout);
    // Every rank is done: the node's snapshots of the run served their purpose.
    if (info.local_rank == 0 && !settings.snapshot_path.empty())
      remove_tree(snapshot_run_folder(settings.snapshot_path, settings.run_dir));
  } catch (const std::exception& e) {
    error = "rank " + std::to_string(settings.info.world_rank) + " failed: " + e.what();
    std::cerr << "error: " << *error << std::endl;
    dump_flight_records_after(e);
    // The coordinator learns of it, and names the cause: this rank's own error, or when the
    // error is a peer's consequence, the peer (it ends this process then, with its reason).
    const Json message{{"type", "error"},
                       {"rank", settings.info.world_rank},
                       {"message", e.what()},
                       {"consequence", is_consequence(e)}};
    const auto within = 3 * heartbeat.interval;
    if (host_here) {
      host->coordinator().deliver(0, message.dump());
      if (const auto verdict = host->coordinator().await_verdict(within)) error = verdict->reason;
    } else {
      try {
        runtime::send_control_message(message.dump());
      } catch (const std::exception&) {
        // The coordinator is gone: this rank's own message is all there is.
      }
      runtime::wait_for_coordinator(within);
    }
  }
  runtime::stop_heartbeat();
  runtime::set_control_sink(nullptr);
  if (!host_here) end_process(error ? 1 : 0);
  auto result = host->finish(error, settings.info.world_size);
  if (!result) end_process(1);  // the coordinator's thread finished the run with its verdict
  return *result;
}

namespace {

// A data worker of a `cohort launch --data-workers` node: serves, one after the other, the streams
// its rank's iterators assign to it through the store, until every rank has finished.
[[noreturn]] void serve_as_data_member(const std::map<std::string, data::Dataset>& datasets,
                                       const runtime::DataMemberInfo& member) {
  const std::string who = "cohort data worker " + std::to_string(member.member) + " (pid " +
                          std::to_string(::getpid()) + " on " + runtime::host_name() + ")";
  int code = 0;
  try {
    const auto& job = member.job;
    auto store = join_launched_job(job, "a data worker", kDefaultSetupTimeout);
    const auto secret = store.secret();
    const std::string round = "job/" + std::to_string(job.restart_round) + "/";
    store.wait({round + "run"},
               std::chrono::hours(24));  // rank 0 opens the run once every rank joined
    // The same program as the ranks, or a clear refusal (as between ranks).
    check_same_program("it", program_identity(), store.get(round + "binary/0"));
    const std::string prefix =
        data_member_key(Json::parse(store.get(round + "run"))["token"], member.member);
    std::vector<std::string> finished;
    for (int r = 0; r < job.train_ranks; ++r)
      finished.push_back(round + "done/" + std::to_string(r));
    for (int64_t n = 0;; ++n) {
      const std::string key = prefix + std::to_string(n);
      while (!store.check({key})) {
        if (store.check(finished)) end_process(0);  // every rank is done
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      const Json task = Json::parse(store.get(key));
      const std::string name = task["dataset"];
      const int rank = task["rank"];
      const int world = task["world"];
      if (datasets.count(name) == 0)
        throw UsageError("no dataset '" + name + "' was given to this Trainer");
      // A shard that differs from the rank's is refused by the rank's pool, both sides saying why.
      const auto shard = dataset_shard(datasets.at(name), rank, world);
      std::cerr << who << ": serving rank " << rank << "'s '" << name << "' stream at "
                << task["address"].get<std::string>() << std::endl;
      std::string why;
      if (!data::serve_data_consumer(shard, task["address"], secret, &why)) {
        std::cerr << who << ": rank " << rank << "'s stream ended without it: " << why << std::endl;
      }
    }
  } catch (const PeerFailureError& e) {
    std::cerr << who << ": lost the job's rendezvous store (" << e.what() << ")" << std::endl;
    code = 1;
  } catch (const std::exception& e) {
    std::cerr << who << ": " << e.what() << std::endl;
    code = 1;
  }
  end_process(code);
}

}  // namespace

void serve_dataset_shard(const std::map<std::string, data::Dataset>& datasets) {
  std::string problem;
  try {
    if (const auto member = runtime::data_member_from_env())
      serve_as_data_member(datasets, *member);
    const auto wanted = runtime::data_shard_from_env();
    if (datasets.count(wanted.dataset) == 0) {
      problem = "no dataset '" + wanted.dataset + "' was given to this Trainer";
    } else {
      const auto shard = dataset_shard(datasets.at(wanted.dataset), wanted.rank, wanted.shards);
      // Returns only when the shard built here differs from the rank's (it ends the process else).
      data::serve_if_data_worker(shard);
      problem = "the pipeline built here differs from the rank's (fingerprint " +
                shard.fingerprint() + ")";
    }
    problem += ": the program must build the same Trainer datasets in every process";
  } catch (const UsageError& e) {
    problem = e.what();  // a variable the rank that started this process set otherwise
  }
  std::cerr << "cohort: preprocessing worker " << ::getpid() << ": " << problem << std::endl;
  ::_exit(2);
}

}  // namespace cohort::train

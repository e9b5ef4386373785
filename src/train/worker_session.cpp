#include "train/worker_session.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <exception>
#include <filesystem>
#include <iostream>
#include <random>

#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/types.h>

#include "cohort/error.h"
#include "cohort/runtime/control_channel.h"
#include "cohort/runtime/environment.h"
#include "cohort/runtime/heap.h"
#include "cohort/train/memory_estimate.h"
#include "cohort/train/parallel_model.h"
#include "cohort/train/prepare.h"
#include "cohort/train/report.h"
#include "train/data_positions.h"
#include "train/live_recovery.h"
#include "train/run_files.h"
#include "train/snapshots.h"
#include "train/tensorboard_log.h"

namespace cohort::train {
namespace {

// The session of the train loop this thread runs: SessionScope's, which owns it.
thread_local WorkerSession* current = nullptr;

WorkerSession& require_session(const char* what) {
  auto* session = current_session();
  if (session == nullptr) {
    throw RuntimeError(std::string(what) +
                       " was called outside a train loop: call it inside the function given to "
                       "cohort::Trainer");
  }
  return *session;
}

// Now on the wall clock, in nanoseconds since the epoch: a checkpoint's or snapshot's "saved_ns",
// which orders saves made on different nodes.
int64_t wall_clock_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

std::string new_run_token() {
  std::random_device device;
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%08x%08x", device(), device());
  return buffer;
}

WorkerSession* current_session() { return current; }

SessionScope::SessionScope(std::unique_ptr<WorkerSession> session)
    : session_(std::move(session)), exceptions_at_start_(std::uncaught_exceptions()) {
  if (current != nullptr)
    throw RuntimeError("a train loop started inside another one on the same thread");
  current = session_.get();
}

SessionScope::~SessionScope() {
  if (current == session_.get()) current = nullptr;
  // Left to the process's end, which does not destroy it.
  if (std::uncaught_exceptions() > exceptions_at_start_) (void)session_.release();
}

int64_t WorkerSession::PreparedModel::optimizer_steps() const {
  if (ddp) return ddp->synchronized_steps();
  if (zero_optimizer) return zero_optimizer->steps();
  if (local_sgd) return local_sgd->stats().inner_steps;
  if (parameter_server) return parameter_server->stats().pushes;
  return 0;
}

const char* WorkerSession::PreparedModel::engine_name() const {
  if (!engine_wraps_optimizer()) return "DistributedDataParallel";
  if (zero.stage > 0) return "ZeroOptimizer";
  return std::holds_alternative<parallel::AsyncParameterServer>(sync) ? "ParameterServerOptimizer"
                                                                      : "LocalSgdOptimizer";
}

int64_t optimizer_steps(const WorkerSession& session) {
  int64_t steps = session.steps_through_step_optimizer;
  for (const auto& model : session.prepared_models)
    steps = std::max(steps, model.optimizer_steps());
  return steps;
}

TrainContext& get_context() { return require_session("cohort::train::get_context()").context; }

void use_precision(optim::Precision precision, const optim::LossScalerOptions& loss_scaler) {
  auto& session = require_session("cohort::train::parallelize()");
  auto& ctx = session.context;
  if (precision == ctx.precision) {
    if (precision != optim::Precision::kFp16 || session.loss_scaler->options() == loss_scaler)
      return;
    throw UsageError("parallelize: the plan's loss scaler " + Json(loss_scaler).dump() +
                     " differs from the run's (ScalingConfig::loss_scaler " +
                     Json(session.loss_scaler->options()).dump() +
                     "): set the fp16 options in one of them");
  }
  if (ctx.precision != optim::Precision::kFp32) {
    throw UsageError("parallelize: the plan's --precision " + optim::to_string(precision) +
                     " differs from the run's (ScalingConfig::precision " +
                     optim::to_string(ctx.precision) + "): set the precision in one of them");
  }
  optim::check_precision_supported(precision, ctx.device);
  ctx.precision = precision;
  session.loss_scaler = std::make_unique<optim::LossScaler>(loss_scaler, ctx.process_group,
                                                            precision == optim::Precision::kFp16);
}

const parallel::DeviceMesh& TrainContext::get_mesh() const {
  if (!has_mesh()) {
    throw UsageError(
        "get_mesh: this run has no mesh: set ScalingConfig::mesh's pp or tp above 1 (cohort "
        "train --pp/--tp); without them every worker is data-parallel over the whole group");
  }
  return mesh;
}

namespace {

// The group a prepared model's replicas average over: the mesh's dp group, else every worker.
comm::ProcessGroup data_parallel_group(WorkerSession& session) {
  return session.context.has_mesh() ? session.context.mesh.dp() : session.context.process_group;
}

}  // namespace

DataParallelPosition data_parallel_position(const TrainContext& context) {
  if (!context.has_mesh()) return {context.world_rank, context.world_size};
  return {context.mesh.dp_index(), context.mesh.shape().dp};
}

void prepare_module(const std::shared_ptr<torch::nn::Module>& module,
                    const PrepareModelOptions& options) {
  auto& session = require_session("cohort::train::prepare_model()");
  if (!module) throw UsageError("prepare_model: the model is null");
  for (const auto& model : session.prepared_models) {
    if (model.module == module)
      throw UsageError("prepare_model: this model was already prepared; prepare it once");
  }
  options.zero.validate();
  parallel::validate(options.sync);
  auto sync = options.sync;
  if (auto* ps = std::get_if<parallel::AsyncParameterServer>(&sync)) {
    // Servers run in worker processes: an elastic group smaller than asked runs one per worker.
    if (ps->servers == 0) ps->servers = std::max(1, session.num_parameter_servers);
    ps->servers = std::min(ps->servers, session.context.world_size);
  } else if (session.num_parameter_servers > 0) {
    throw UsageError("prepare_model: ScalingConfig.num_parameter_servers=" +
                     std::to_string(session.num_parameter_servers) + " but the sync mode is " +
                     parallel::to_string(sync) +
                     ": parameter servers serve only parallel::AsyncParameterServer (sync "
                     "async-ps:K); set 0 servers or that mode");
  }
  if (const auto conflict = parallel::zero_conflict(sync, options.zero.stage)) {
    throw UsageError("prepare_model: sync " + *conflict + "; use ZeRO stage 0 or the ddp sync");
  }
  if (options.move_to_device) module->to(session.context.device);
  WorkerSession::PreparedModel prepared{.module = module, .sync = sync, .zero = options.zero};
  if (!parallel::is_synchronous(sync)) {
    // The optimizer that prepare_optimizer() makes is the engine; a backward before it exists
    // would train the replicas apart unnoticed.
    for (const auto& p : module->parameters()) {
      if (!p.requires_grad()) continue;
      const std::string mode = parallel::to_string(sync);
      auto accumulator = torch::autograd::impl::grad_accumulator(p);
      // Thrown through autograd, which stops the backward and rethrows it from backward().
      const auto key =
          accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
              [mode](const torch::autograd::variable_list&,
                     const torch::autograd::variable_list&) -> torch::autograd::variable_list {
                throw UsageError("backward on a model prepared with sync " + mode +
                                 " before its optimizer was passed through "
                                 "cohort::train::prepare_optimizer(model, optimizer): the "
                                 "replicas would never synchronise");
              }));
      prepared.remove_guard = [accumulator, key] { accumulator->del_post_hook(key); };
      break;
    }
  } else if (options.zero.stage == 0) {
    prepared.ddp = std::make_unique<parallel::DistributedDataParallel>(
        module, data_parallel_group(session), options.ddp);
  }  // else the ZeroOptimizer that prepare_optimizer() makes is the engine: it needs the optimizer
  session.prepared_models.push_back(std::move(prepared));
  // DDP's model is ready to step; the others' engines come with prepare_optimizer.
  if (session.prepared_models.back().ddp) end_heap_setup(session);
}

void end_heap_setup(WorkerSession& session) {
  if (!session.heap_in_setup) return;
  session.heap_in_setup = false;
  runtime::heap_for_steps();
}

namespace {

// The model as prepare_model prepared it; a UsageError when it was not passed to it.
WorkerSession::PreparedModel& prepared_model(WorkerSession& session,
                                             const std::shared_ptr<torch::nn::Module>& module) {
  for (auto& model : session.prepared_models)
    if (model.module == module) return model;
  throw UsageError("this model was not passed to cohort::train::prepare_model");
}

}  // namespace

std::unique_ptr<torch::optim::Optimizer> prepare_optimizer(
    const std::shared_ptr<torch::nn::Module>& module,
    std::unique_ptr<torch::optim::Optimizer> optimizer) {
  auto& session = require_session("cohort::train::prepare_optimizer()");
  if (!optimizer) throw UsageError("prepare_optimizer: the optimizer is null");
  auto& model = prepared_model(session, module);
  if (!model.engine_wraps_optimizer()) return optimizer;  // DDP's engine is the model's
  if (model.has_optimizer_engine()) {
    throw UsageError(std::string("prepare_optimizer: this model already has its ") +
                     model.engine_name() + "; prepare one optimizer per model");
  }
  const auto group = data_parallel_group(session);
  std::unique_ptr<torch::optim::Optimizer> engine;
  if (model.zero.stage > 0) {
    auto sharded = std::make_unique<parallel::ZeroOptimizer>(module, *optimizer, group, model.zero);
    model.zero_optimizer = sharded.get();
    engine = std::move(sharded);
  } else if (const auto* ps = std::get_if<parallel::AsyncParameterServer>(&model.sync)) {
    auto served = std::make_unique<parallel::ParameterServerOptimizer>(module, std::move(optimizer),
                                                                       group, *ps);
    model.parameter_server = served.get();
    engine = std::move(served);
  } else {
    auto local = std::make_unique<parallel::LocalSgdOptimizer>(module, std::move(optimizer), group,
                                                               model.sync);
    model.local_sgd = local.get();
    engine = std::move(local);
  }
  if (model.remove_guard) model.remove_guard();
  model.remove_guard = nullptr;
  release_free_memory();  // the tensors the engine flattened or sharded
  end_heap_setup(session);
  return engine;
}

parallel::DistributedDataParallel& get_ddp(const std::shared_ptr<torch::nn::Module>& module) {
  auto& model = prepared_model(require_session("cohort::train::get_ddp()"), module);
  if (model.ddp) return *model.ddp;
  const std::string plan =
      model.zero.stage > 0 ? "ZeRO" : "sync " + parallel::to_string(model.sync);
  throw UsageError("this model was prepared with " + plan + ": its engine is the " +
                   model.engine_name() + " that prepare_optimizer returned, not DDP");
}

GatheredParameters gathered_parameters(const std::shared_ptr<torch::nn::Module>& module,
                                       bool write_back) {
  // Only ZeRO's parameters need gathering: any other model (prepared or not) is whole already.
  for (const auto& model :
       require_session("cohort::train::gathered_parameters()").prepared_models) {
    if (model.module == module && model.zero_optimizer != nullptr) {
      return GatheredParameters(std::make_unique<parallel::ZeroOptimizer::GatheredParameters>(
          *model.zero_optimizer, write_back));
    }
  }
  return GatheredParameters();
}

NoSyncGuard no_sync(const std::shared_ptr<torch::nn::Module>& module) {
  auto& model = prepared_model(require_session("cohort::train::no_sync()"), module);
  if (model.ddp)
    return NoSyncGuard(
        std::make_unique<parallel::DistributedDataParallel::NoSyncGuard>(*model.ddp));
  if (model.zero.stage == 0) return NoSyncGuard();  // local SGD, DiLoCo, the parameter server
  if (model.zero_optimizer == nullptr) {
    throw UsageError(
        "no_sync: this model was prepared with ZeRO; call prepare_optimizer "
        "before the training loop");
  }
  return NoSyncGuard(std::make_unique<parallel::ZeroOptimizer::NoSyncGuard>(*model.zero_optimizer));
}

ForwardScope::ForwardScope(optim::Precision precision, const c10::Device& device)
    : span_(trace::Phase::kForward), autocast_(precision, device) {}

ForwardScope autocast() {
  const auto& ctx = require_session("cohort::train::autocast()").context;
  return ForwardScope(ctx.precision, ctx.device);
}

optim::LossScaler& get_loss_scaler() {
  return *require_session("cohort::train::get_loss_scaler()").loss_scaler;
}

void backward(const at::Tensor& loss) {
  trace::Span span(trace::Phase::kBackward);
  get_loss_scaler().scale(loss).backward();
}

bool step_optimizer(torch::optim::Optimizer& optimizer) {
  auto& session = require_session("cohort::train::step_optimizer()");
  ++session.steps_through_step_optimizer;  // a skipped fp16 step communicated all the same
  auto& scaler = *session.loss_scaler;
  bool stepped;
  {
    trace::Span span(trace::Phase::kOptimizer);
    stepped = scaler.step(optimizer);
    scaler.update();
  }
  trace::end_step();
  return stepped;
}

namespace {

// Where stream `key` of shard `shard` of `shards` starts in a run resumed from a checkpoint that
// kept its position; none otherwise. Rank 0 says when the epoch cannot resume exactly.
data::EpochStart resume_start_of(const WorkerSession& s, const std::string& key, int shard,
                                 int shards) {
  if (!s.resume_from) return {};
  const auto meta_file = s.resume_from->path() / kMetaFile;
  if (!std::filesystem::exists(meta_file)) return {};
  std::string warning;
  const auto start =
      resume_start_from(read_json(meta_file), s.resume_from->path(), key, shard, shards, warning);
  if (!warning.empty() && s.context.world_rank == 0)
    std::cerr << "cohort: data: " << key << ": " << warning << std::endl;
  return start;
}

// Keeps stream `key`'s position in the session, for the next report's checkpoint; a resumed run's
// stream starts where the checkpoint's stood.
template <typename Stream>
void track_position(WorkerSession& s, const std::string& key, Stream& stream) {
  const auto position = data_parallel_position(s.context);
  if (const auto start = resume_start_of(s, key, position.rank, position.world_size);
      start.epoch >= 0)
    stream.start_at(start);
  auto* session = &s;
  stream.set_on_position(
      [session, key](const data::EpochPosition& p) { session->data_positions[key] = p; });
}

}  // namespace

data::DataLoader prepare_data_loader(data::TensorDataset dataset, data::DataLoaderOptions options) {
  auto& session = require_session("cohort::train::prepare_data_loader()");
  options.device = session.context.device;
  const auto position = data_parallel_position(session.context);
  data::DataLoader loader(std::move(dataset), options, position.rank, position.world_size);
  track_position(session, "loader:" + std::to_string(session.data_loaders++), loader);
  return loader;
}

namespace {

// "a;b;;c" -> {"a", "b", "", "c"}.
std::vector<std::string> split_fields(const std::string& text) {
  std::vector<std::string> fields;
  size_t begin = 0;
  for (size_t end; (end = text.find(';', begin)) != std::string::npos; begin = end + 1)
    fields.push_back(text.substr(begin, end - begin));
  fields.push_back(text.substr(begin));
  return fields;
}

// What a rank's trace recorded since its last report.
struct RankTimes {
  int64_t steps = 0;
  double busy_seconds = 0;  // trace::Totals::busy_seconds: its steps without its waits for peers
  std::array<double, trace::kPhases> seconds{};
};

// Where the step time goes, added to a report when the ranks ended steps (train::step_optimizer)
// since the last: each rank's step time without its waits for peers (so that a rank that
// computes slowly stands out from the ones that wait for it), its lower median, min and max and
// the slowest rank; the phases' ms per step averaged over the ranks; the slowest checkpoint.
// A metric the loop reported itself is kept. Each rank's step time also goes into the message as
// "rank_step_time_ms" (null for a rank without steps), for dashboards.
void add_step_times(const std::vector<RankTimes>& times, Json& message) {
  Json& metrics = message["metrics"];
  Json by_rank = Json::array();
  std::vector<std::pair<double, int>> step_ms;
  std::array<double, trace::kPhases> phase_ms{};
  double checkpoint_ms = 0;
  for (size_t r = 0; r < times.size(); ++r) {
    const auto& t = times[r];
    checkpoint_ms =
        std::max(checkpoint_ms, 1000 * t.seconds[static_cast<size_t>(trace::Phase::kCheckpoint)]);
    if (t.steps == 0) {
      by_rank.push_back(nullptr);
      continue;
    }
    const double per_step = 1000.0 / static_cast<double>(t.steps);
    step_ms.emplace_back(t.busy_seconds * per_step, static_cast<int>(r));
    by_rank.push_back(step_ms.back().first);
    for (size_t p = 0; p < phase_ms.size(); ++p) phase_ms[p] += t.seconds[p] * per_step;
  }
  const auto put = [&](const std::string& key, const Json& value) {
    if (!metrics.contains(key)) metrics[key] = value;
  };
  if (checkpoint_ms > 0) put("checkpoint_ms", checkpoint_ms);
  if (step_ms.empty()) return;
  std::sort(step_ms.begin(), step_ms.end());
  put("step_time_ms_min", step_ms.front().first);
  put("step_time_ms_median", step_ms[(step_ms.size() - 1) / 2].first);
  put("step_time_ms_max", step_ms.back().first);
  put("slowest_rank", step_ms.back().second);
  for (size_t p = 0; p < phase_ms.size(); ++p) {
    const auto phase = static_cast<trace::Phase>(p);
    if (phase == trace::Phase::kCheckpoint) continue;
    put(std::string(trace::to_string(phase)) + "_ms",
        phase_ms[p] / static_cast<double>(step_ms.size()));
  }
  message["rank_step_time_ms"] = by_rank;  // last: `metrics` refers into `message`
}

// TensorBoard's histograms of the prepared models' parameters and gradients, by tag
// ("parameters/<name>", with several models "model<i>/parameters/<name>").
Json model_histograms(const WorkerSession& s) {
  const auto& models = s.prepared_models;
  Json out = Json::object();
  for (size_t i = 0; i < models.size(); ++i) {
    const std::string prefix = models.size() > 1 ? "model" + std::to_string(i) + "/" : "";
    for (const auto& p : models[i].module->named_parameters()) {
      // ZeRO stage 3's units hold their parameters only inside a step (gathering them here
      // would be a collective on one rank).
      if (p.value().numel() > 0 && p.value().storage().nbytes() == 0) continue;
      out[prefix + "parameters/" + p.key()] = histogram_to_json(Histogram::of(p.value()));
      if (p.value().grad().defined())
        out[prefix + "gradients/" + p.key()] = histogram_to_json(Histogram::of(p.value().grad()));
    }
  }
  return out;
}

}  // namespace

namespace {

// The session's writer of asynchronous checkpoints, made at the first.
AsyncCheckpointWriter& writer_of(WorkerSession& s) {
  if (!s.checkpoint_writer) {
    s.checkpoint_writer = std::make_unique<AsyncCheckpointWriter>(s.store, s.collective_timeout);
  }
  return *s.checkpoint_writer;
}

// "[1, 3]".
std::string ranks_list(const std::vector<int>& ranks) {
  std::string out;
  for (int r : ranks) out += (out.empty() ? "" : ", ") + std::to_string(r);
  return "[" + out + "]";
}

// report()'s work: `files`, the folder of this rank's checkpoint files, is merged into the
// report's staging folder now; with `async` the files captured in memory are, by the session's
// writer, behind the loop (`files` set: this rank has some).
void report_files(const Json& metrics, const std::optional<std::filesystem::path>& files,
                  bool async) {
  auto& s = require_session("cohort::train::report()");
  end_heap_setup(s);  // a loop that prepared nothing: its setup ends at its first report
  if (!metrics.is_object()) {
    throw UsageError("report: metrics must be a JSON object of name -> value, got " +
                     metrics.dump());
  }
  // Checkpoints commit in the order of their reports: a synchronous one after the save in flight.
  if (files && !async) wait_for_checkpoint_in_flight();
  const int64_t index = ++s.reports;
  // Announced before waiting for the others, so that the driver can tell a rank that will never
  // come (it finished with fewer calls) from one that is late.
  if (runtime::has_control_channel()) {
    runtime::send_control_message(
        Json{{"type", "report_begin"}, {"rank", s.context.world_rank}, {"index", index}}.dump());
  }
  const auto staging =
      s.context.storage_path / kStagingDir / (s.run_token + "-" + std::to_string(index));
  // The store keys of an asynchronous save's ranks: each says whether its files are in.
  const std::string async_keys =
      "async-checkpoint/" + s.run_token + "/" + std::to_string(index) + "/";
  AsyncCheckpointWriter::Job job{.has_files = files.has_value(),
                                 .staging = staging,
                                 .keys = async_keys,
                                 .rank = s.context.world_rank,
                                 .umask = s.umask,
                                 .report_index = index};
  if (files && !async) {
    trace::Span span(trace::Phase::kCheckpoint);
    merge_files(*files, staging, s.context.world_rank, s.umask);
  } else if (files && s.context.world_rank != 0) {
    writer_of(s).start(std::move(job));  // rank 0's waits for the others' arrivals
  }
  // Each rank's mean wait for data per batch, bytes sent, optimizer steps, and its traced steps,
  // busy seconds (trace::Totals) and seconds per phase (cohort/trace.h) since its last report ride
  // along with whether it brings a checkpoint, whether it stored its data positions, and with the
  // parameter server its pushes' staleness: "<0|1>;[<ms>];<bytes>;<steps>;<traced steps>;<busy s>;
  // <phase s>x6;<0|1>[;<staleness sum>;<pushes>;<max>]".
  const auto ingest = data::take_ingest_stats();
  const auto traced = trace::take_totals();
  const int64_t bytes = s.context.process_group.bytes_sent();
  const int64_t steps = optimizer_steps(s);
  // "1": files merged now, "2": merged behind the loop.
  std::string arrival = !files ? "0;" : async ? "2;" : "1;";
  if (ingest.batches > 0)
    arrival += std::to_string(1000.0 * ingest.wait_seconds / static_cast<double>(ingest.batches));
  arrival += ";" + std::to_string(bytes - s.bytes_at_report) + ";" +
             std::to_string(steps - s.steps_at_report);
  arrival += ";" + std::to_string(traced.steps) + ";" + std::to_string(traced.busy_seconds);
  for (double seconds : traced.seconds) arrival += ";" + std::to_string(seconds);
  s.bytes_at_report = bytes;
  s.steps_at_report = steps;
  const std::string keys = "report/" + s.run_token + "/" + std::to_string(index) + "/";
  // Where this rank's data streams stand, for a checkpoint's meta.json (rank 0 reads them).
  arrival += s.data_positions.empty() ? ";0" : ";1";
  if (!s.data_positions.empty()) {
    const auto position = data_parallel_position(s.context);
    s.store.set(keys + "data/" + std::to_string(s.context.world_rank),
                rank_positions(s.data_positions, position.rank, position.world_size).dump());
  }
  for (const auto& model : s.prepared_models) {
    if (model.parameter_server == nullptr) continue;
    const auto ps = model.parameter_server->stats();
    arrival += ";" + std::to_string(ps.staleness_sum - s.staleness_at_report) + ";" +
               std::to_string(ps.pushes - s.pushes_at_report) + ";" +
               std::to_string(ps.staleness_max);
    s.staleness_at_report = ps.staleness_sum;
    s.pushes_at_report = ps.pushes;
    break;
  }
  const auto arrivals =
      s.store.arrive_and_wait(keys, s.context.world_rank, s.context.world_size, arrival,
                              "reach report() call #" + std::to_string(index) +
                                  " (every rank must call report() equally often)",
                              s.collective_timeout);
  // Every rank returns only once rank 0 has handed the report (and its checkpoint) on: a rank
  // that dies right after report() then never takes a report it saw complete down with it.
  const auto committed_key = keys + "committed";
  if (s.context.world_rank != 0) {
    try {
      s.store.wait({committed_key}, s.collective_timeout);
    } catch (const TimeoutError& e) {
      throw TimeoutError("report() call #" + std::to_string(index) +
                         ": rank 0 did not commit it within " +
                         std::to_string(s.collective_timeout.count()) + " ms (" + e.what() + ")");
    }
    return;
  }
  // Every rank has passed the previous report (they all arrived at this one): its keys go, so the
  // store holds the same few keys at step 10 and at step 10,000.
  if (index > 1)
    s.store.remove_prefix("report/" + s.run_token + "/" + std::to_string(index - 1) + "/");
  Json message{{"type", "report"}, {"rank", 0}, {"index", index}, {"metrics", metrics}};
  // fp16: how the loss scaling goes (the same on every rank).
  if (s.loss_scaler && s.loss_scaler->enabled()) {
    if (!metrics.contains("loss_scale"))
      message["metrics"]["loss_scale"] = s.loss_scaler->get_scale();
    if (!metrics.contains("skipped_steps"))
      message["metrics"]["skipped_steps"] = s.loss_scaler->skipped_steps();
  }
  bool with_checkpoint = false;
  std::vector<int> async_ranks, sync_ranks;
  std::optional<double> ingest_ms;
  double bytes_per_step = 0;
  int workers_stepping = 0;
  int64_t staleness_sum = 0;
  int64_t pushes = 0;
  std::optional<int64_t> staleness_max;
  std::vector<RankTimes> times;
  std::vector<std::string> ranks_with_positions;
  for (size_t r = 0; r < arrivals.size(); ++r) {
    const auto& a = arrivals[r];
    const auto fields = split_fields(a);
    with_checkpoint |= fields.at(0) != "0";
    if (fields.at(0) == "1") sync_ranks.push_back(static_cast<int>(r));
    if (fields.at(0) == "2") async_ranks.push_back(static_cast<int>(r));
    if (!fields.at(1).empty())
      ingest_ms = std::max(ingest_ms.value_or(0.0), std::stod(fields.at(1)));
    if (const int64_t rank_steps = std::stoll(fields.at(3)); rank_steps > 0) {
      bytes_per_step += static_cast<double>(std::stoll(fields.at(2))) / rank_steps;
      ++workers_stepping;
    }
    RankTimes t{.steps = std::stoll(fields.at(4)), .busy_seconds = std::stod(fields.at(5))};
    for (size_t p = 0; p < t.seconds.size(); ++p) t.seconds[p] = std::stod(fields.at(6 + p));
    times.push_back(t);
    if (fields.at(12) == "1") ranks_with_positions.push_back(keys + "data/" + std::to_string(r));
    if (fields.size() >= 16) {
      staleness_sum += std::stoll(fields[13]);
      pushes += std::stoll(fields[14]);
      staleness_max = std::max<int64_t>(staleness_max.value_or(0), std::stoll(fields[15]));
    }
  }
  add_step_times(times, message);
  if (staleness_max && !metrics.contains(kStalenessMeanMetric)) {
    message["metrics"][kStalenessMeanMetric] =
        pushes > 0 ? static_cast<double>(staleness_sum) / static_cast<double>(pushes) : 0.0;
    message["metrics"][kStalenessMaxMetric] = *staleness_max;
  }
  // The exposed ingest time: how long the slowest-fed rank waited for data per batch.
  if (ingest_ms && !metrics.contains(kIngestMetric)) message["metrics"][kIngestMetric] = *ingest_ms;
  if (workers_stepping > 0 && !metrics.contains(kCommBytesMetric))
    message["metrics"][kCommBytesMetric] = bytes_per_step / workers_stepping;
  if (!async_ranks.empty() && !sync_ranks.empty()) {
    throw UsageError("report() call #" + std::to_string(index) + ": ranks " +
                     ranks_list(async_ranks) + " saved their checkpoint asynchronously and ranks " +
                     ranks_list(sync_ranks) + " did not: every rank saves alike");
  }
  std::optional<AsyncCheckpointWriter::Commit> commit;
  if (with_checkpoint) {
    Json meta{{"metrics", message["metrics"]},
              {"report_index", index},
              {"world_size", s.context.world_size},
              {"data_parallel_size", data_parallel_position(s.context).world_size},
              {"saved_ns", wall_clock_ns()},
              {"timestamp", std::time(nullptr)}};
    if (!ranks_with_positions.empty())
      meta[kDataPositionsKey] = positions_by_shard(s.store.get_many(ranks_with_positions));
    const auto final_path = s.context.storage_path / checkpoint_name(s.next_checkpoint_index++);
    if (async_ranks.empty()) {
      // Whole before it gets its final name: a crash leaves a staging folder, never a
      // checkpoint_NNNNNN that looks valid and is not.
      write_atomically(staging / kMetaFile, meta.dump(2) + "\n");
      write_manifest(staging);
      rename_durably(staging, final_path);
      message["checkpoint"] = final_path.string();
    } else {
      commit = AsyncCheckpointWriter::Commit{.meta = std::move(meta),
                                             .final_path = final_path,
                                             .ranks = async_ranks,
                                             .message = {{"type", "checkpoint"},
                                                         {"rank", 0},
                                                         {"index", index},
                                                         {"metrics", message["metrics"]}}};
    }
  }
  if (s.tensorboard_histograms) message["histograms"] = model_histograms(s);
  if (runtime::has_control_channel()) runtime::send_control_message(message.dump());
  s.store.set(committed_key, "1");
  if (commit) {
    job.commit = std::move(commit);
    writer_of(s).start(std::move(job));
  }
}

}  // namespace

void report(const Json& metrics, const std::optional<Checkpoint>& checkpoint) {
  report_files(metrics,
               checkpoint ? std::optional<std::filesystem::path>(checkpoint->path()) : std::nullopt,
               false);
}

CapturedFiles& checkpoint_capture() {
  return writer_of(require_session("cohort::train::report()")).captured();
}

void report_async(const Json& metrics, bool has_files) {
  report_files(
      metrics,
      has_files ? std::optional<std::filesystem::path>(std::filesystem::path()) : std::nullopt,
      true);
}

void snapshot_async(const Json& metrics) {
  auto& s = require_session("cohort::train::snapshot()");
  if (!metrics.is_object()) {
    throw UsageError("snapshot: metrics must be a JSON object of name -> value, got " +
                     metrics.dump());
  }
  if (s.snapshot_folder.empty()) {
    throw UsageError(
        "snapshot: RunConfig::snapshot_path is empty: set it to memory-backed storage of each "
        "node (e.g. /dev/shm/cohort-snapshots) to keep snapshots");
  }
  const auto& ctx = s.context;
  const int64_t index = ++s.snapshots;
  // A group of its own (not a sub-group of the loop's: its bytes are not the training's traffic),
  // through Gloo: the copies are of host memory.
  if (ctx.world_size > 1 && !s.snapshot_group.valid()) {
    s.snapshot_group = comm::ProcessGroup::create(s.store, ctx.world_rank, ctx.world_size,
                                                  {.interface_address = s.interface_address,
                                                   .setup_timeout = s.collective_timeout,
                                                   .timeout = s.collective_timeout,
                                                   .prefix = "snapshot/" + s.run_token + "/group",
                                                   .backend = comm::Backend::kGloo,
                                                   .aborted = s.collectives_aborted});
  }
  // Each rank's node, clock and data positions; every rank builds the same meta.json from them.
  Json arrival{{"node", ctx.node_rank}, {"saved_ns", wall_clock_ns()}};
  if (!s.data_positions.empty()) {
    const auto position = data_parallel_position(ctx);
    arrival["data"] = rank_positions(s.data_positions, position.rank, position.world_size);
  }
  const std::string keys = "snapshot/" + s.run_token + "/" + std::to_string(index) + "/";
  const auto arrivals =
      s.store.arrive_and_wait(keys + "arrive/", ctx.world_rank, ctx.world_size, arrival.dump(),
                              "reach snapshot() call #" + std::to_string(index) +
                                  " (every rank must call snapshot() equally often)",
                              s.collective_timeout);
  // Every rank's writer finished the previous snapshot before it arrived here.
  if (ctx.world_rank == 0 && index > 1)
    s.store.remove_prefix("snapshot/" + s.run_token + "/" + std::to_string(index - 1) + "/");
  std::vector<int> node_of_rank;
  std::vector<std::string> positions;
  for (const auto& text : arrivals) {
    const auto a = Json::parse(text);
    node_of_rank.push_back(a.at("node"));
    if (a.contains("data")) positions.push_back(a["data"].dump());
  }
  Json meta{{"metrics", metrics},
            {"snapshot_index", index},
            {"world_size", ctx.world_size},
            {"data_parallel_size", data_parallel_position(ctx).world_size},
            {"saved_ns", Json::parse(arrivals.at(0)).at("saved_ns")},
            {"timestamp", std::time(nullptr)}};
  if (!positions.empty()) meta[kDataPositionsKey] = positions_by_shard(positions);
  const auto buddies = snapshot_buddies(node_of_rank);
  AsyncCheckpointWriter::Snapshot snapshot{.run_folder = s.snapshot_folder,
                                           .token = s.run_token,
                                           .name = snapshot_name(s.run_token, index),
                                           .meta = std::move(meta),
                                           .group = s.snapshot_group,
                                           .buddy = buddies[static_cast<size_t>(ctx.world_rank)],
                                           .keys = keys + "kept/"};
  for (int r = 0; r < ctx.world_size; ++r) {
    if (buddies[static_cast<size_t>(r)] == ctx.world_rank) snapshot.wards.push_back(r);
    if (node_of_rank[static_cast<size_t>(r)] == ctx.node_rank) snapshot.node_ranks.push_back(r);
  }
  // The node's lowest rank commits the node's snapshot.
  if (snapshot.node_ranks.front() != ctx.world_rank) snapshot.node_ranks.clear();
  // Every rank lists its files (none is a list too) and keeps its wards' copies.
  writer_of(s).start({.rank = ctx.world_rank,
                      .umask = s.umask,
                      .report_index = index,
                      .snapshot = std::move(snapshot)});
}

void choose_snapshot_to_restore(WorkerSession& s, bool resume, std::chrono::milliseconds timeout) {
  if (s.snapshot_folder.empty()) return;
  const auto& ctx = s.context;
  if (!resume) {
    // A new run of the same name: an earlier one's snapshots are not its past.
    if (ctx.local_rank == 0) remove_tree(s.snapshot_folder);
    return;
  }
  const auto held = held_snapshots(s.snapshot_folder);
  const auto arrivals =
      s.store.arrive_and_wait("snapshot/" + s.run_token + "/held/", ctx.world_rank, ctx.world_size,
                              Json(held).dump(), "say which snapshots its node holds", timeout);
  std::vector<std::vector<HeldSnapshot>> by_rank;
  for (const auto& text : arrivals)
    by_rank.push_back(Json::parse(text).get<std::vector<HeldSnapshot>>());
  const auto choice = choose_snapshot(
      by_rank, ctx.world_rank, s.resume_from ? saved_ns_of(s.resume_from->path()) : std::nullopt);
  if (choice.snapshot) {
    s.resume_from = Checkpoint::from_directory(
        snapshot_checkpoint(s.snapshot_folder, *choice.snapshot, ctx.world_rank));
  }
  if (ctx.world_rank != 0 || choice.why.empty()) return;
  if (!runtime::has_control_channel()) {
    std::cerr << "cohort: " << choice.why << std::endl;
  } else {
    runtime::send_control_message(Json{
        {"type", "restored"},
        {"rank", 0},
        {"source", choice.snapshot ? "snapshot" : "disk"},
        {"checkpoint", s.resume_from ? s.resume_from->path().string() : ""},
        {"why", choice.why}}.dump());
  }
}

double wait_for_checkpoint_in_flight() {
  auto& s = require_session("cohort::train::report()");
  return s.checkpoint_writer ? s.checkpoint_writer->wait() : 0.0;
}

bool checkpoint_in_flight_on_any_rank() {
  auto& s = require_session("cohort::train::report()");
  const bool busy = s.checkpoint_writer && s.checkpoint_writer->busy();
  std::vector<at::Tensor> flag{torch::tensor({busy ? 1 : 0}, torch::kInt)};
  s.context.process_group.allreduce(flag, comm::ReduceOp::kMax);
  return flag[0].item<int>() > 0;
}

void finish_session() {
  if (auto* s = current_session(); s != nullptr && s->checkpoint_writer)
    s->checkpoint_writer->wait();
}

bool should_stop() {
  auto& s = require_session("cohort::train::should_stop()");
  if (!s.accepts_stop_requests) {
    s.accepts_stop_requests = true;
    if (runtime::has_control_channel()) {
      runtime::send_control_message(
          Json{{"type", "accepts_stop_requests"}, {"rank", s.context.world_rank}}.dump());
    }
  }
  std::vector<at::Tensor> flag{torch::tensor({runtime::stop_requested() ? 1 : 0}, torch::kInt)};
  live_collective([&] { s.context.process_group.allreduce(flag, comm::ReduceOp::kMax); });
  return flag[0].item<int>() > 0;
}

std::optional<Checkpoint> get_checkpoint() {
  return require_session("cohort::train::get_checkpoint()").resume_from;
}

void barrier() { require_session("cohort::train::barrier()").context.process_group.barrier(); }

Json broadcast_from_rank_zero(const Json& value) {
  auto& s = require_session("cohort::train::broadcast_from_rank_zero()");
  if (s.context.world_size == 1) return value;
  // Two broadcasts on the train group (the length, then the bytes): nothing left in the store.
  auto group = s.context.process_group;
  const std::string text = s.context.world_rank == 0 ? value.dump() : "";
  const auto on = [&](torch::Dtype dtype) {
    return torch::TensorOptions(dtype).device(s.context.device);
  };
  std::vector<at::Tensor> length{
      torch::full({1}, static_cast<int64_t>(text.size()), on(torch::kInt64))};
  group.broadcast(length, 0);
  auto host = torch::empty({length[0].item<int64_t>()}, torch::kUInt8);
  if (s.context.world_rank == 0) std::memcpy(host.data_ptr(), text.data(), text.size());
  std::vector<at::Tensor> bytes{host.to(s.context.device)};
  group.broadcast(bytes, 0);
  if (s.context.world_rank == 0) return value;
  host = bytes[0].cpu();
  return Json::parse(
      std::string(static_cast<const char*>(host.data_ptr()), static_cast<size_t>(host.numel())));
}

data::Dataset dataset_shard(const data::Dataset& dataset, int rank, int world_size) {
  return world_size > 1 ? dataset.shard(rank, world_size) : dataset;
}

data::DataIterator get_dataset_shard(const std::string& name) {
  auto& s = require_session("cohort::train::get_dataset_shard()");
  auto it = s.datasets.find(name);
  if (it == s.datasets.end()) {
    std::string names;
    for (const auto& [n, d] : s.datasets) names += (names.empty() ? "" : ", ") + n;
    throw UsageError("get_dataset_shard: no dataset named '" + name +
                     "' was given to the Trainer (it has [" + names + "])");
  }
  const auto position = data_parallel_position(s.context);
  const int rank = position.rank, world = position.world_size;
  auto shard = dataset_shard(it->second, rank, world);
  // The job's data workers on other nodes (cohort launch --data-workers): this rank's share.
  std::vector<int> members;
  if (name == s.remote_preprocessing_dataset && shard.has_map_stage()) {
    const int ranks = s.context.world_size;
    for (int k = s.context.world_rank; k < s.data_members; k += ranks) members.push_back(k);
  }
  if (!members.empty()) {
    auto execution = shard.execution();
    execution.listen_address = s.interface_address + ":0";
    execution.remote_workers += static_cast<int>(members.size());
    shard = shard.with_execution(execution);
  }
  data::DataIterator iterator(shard);
  track_position(s, "dataset:" + name, iterator);
  // Its preprocessing workers find the same shard: they re-run this program up to fit().
  iterator.set_worker_environment(
      {{runtime::kDataDatasetVar, name},
       {runtime::kDataShardVar, std::to_string(rank) + "/" + std::to_string(world)}});
  if (!members.empty()) {
    auto* session = &s;
    iterator.set_on_listening([session, members, name, rank, world](const std::string& address) {
      const std::string task =
          Json{{"address", address}, {"dataset", name}, {"rank", rank}, {"world", world}}.dump();
      for (int k : members) {
        const auto prefix = data_member_key(session->run_token, k);
        const int64_t n = session->store.add(prefix + "count", 1) - 1;
        session->store.set(prefix + std::to_string(n), task);
      }
    });
  }
  if (s.context.world_size > 1) {
    // Whether every rank has this batch: an all-reduce (min) of one number, no store round trip
    // per batch. It is a collective of the train group like DDP's, so a rank that stopped reading
    // shows in the stall inspector.
    iterator.set_batch_agreement(
        [group = s.context.process_group, device = s.context.device](int64_t, int64_t, bool have) {
          std::vector<at::Tensor> flag{
              torch::full({1}, have ? 1 : 0, torch::TensorOptions(torch::kInt32).device(device))};
          auto g = group;
          live_collective([&] { g.allreduce(flag, comm::ReduceOp::kMin); });
          return flag[0].item<int32_t>() == 1;
        });
  }
  return iterator;
}

void log_step(int64_t step, const std::function<Json()>& metrics) {
  auto& session = require_session("cohort::train::log_step()");
  if (session.context.world_rank != 0 || !runtime::has_control_channel()) return;
  using Clock = std::chrono::steady_clock;
  constexpr auto kAutomaticInterval = std::chrono::seconds(15);
  auto& log = session.step_log;
  const auto now = Clock::now();
  if (log.last_call && log.gaps_ms.size() < 100000)
    log.gaps_ms.push_back(std::chrono::duration<double, std::milli>(now - *log.last_call).count());
  log.last_call = now;
  const bool due = log.every_steps > 0
                       ? step % log.every_steps == 0
                       : !log.last_logged || now - *log.last_logged >= kAutomaticInterval;
  if (!due) return;
  log.last_logged = now;
  Json values = metrics();
  if (!values.is_object()) {
    throw UsageError("train::log_step: the metrics of step " + std::to_string(step) +
                     " are not a JSON object: " + values.dump());
  }
  if (!log.gaps_ms.empty() && !values.contains("step_time_ms")) {
    auto middle = log.gaps_ms.begin() + static_cast<std::ptrdiff_t>((log.gaps_ms.size() - 1) / 2);
    std::nth_element(log.gaps_ms.begin(), middle, log.gaps_ms.end());
    values["step_time_ms"] = *middle;
  }
  log.gaps_ms.clear();
  runtime::send_control_message(
      Json{{"type", "step"}, {"step", step}, {"metrics", std::move(values)}}.dump());
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

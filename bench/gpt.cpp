// The zoo's GPT on random tokens, trained by `--workers` processes with AdamW (fp32 state) under
// each plan of `--modes`, to the first checkpoint and back:
//
//   ddp            every worker the whole model and optimizer state
//   zero3          ZeRO stage 3: each worker builds the whole model, then keeps its shards
//   zero3-deferred ZeRO stage 3 with deferred initialisation: each worker initialises its shards
//                  only, one unit at a time (models::ModelOptions::deferred_init)
//   zero3-disk     that, with the optimizer state of its shard in files under --offload-dir
//   ddp-host       DDP with the optimizer state in host memory (--offload-optimizer cpu): on a
//                  GPU the update runs on the host (ZeRO-Offload); on a CPU run it is ddp
//   pipeline       two pipeline stages (1F1B over --batch-size micro-batches of one row), DDP
//                  over the --workers / 2 pipelines: each worker its stage's layers and state
//   mesh           that with each stage tensor-parallel over two workers (heads and MLP), DDP
//                  over the --workers / 4 meshes
//   pipeline-zero2 pipeline with ZeRO stage 2 over the pipelines instead of DDP, or stage 3
//   pipeline-zero3
//
// For each mode: the workers train --steps steps (batch --batch-size rows of --context tokens
// each), write a checkpoint, and a second run resumes from it and trains one step more. Printed
// per mode: the largest worker's peak resident memory from its start to its last step, beside
// train::estimate_memory's figure for the plan (its activations probed on the whole model in a
// fresh process before the workers start), and its peak once the checkpoint is written; the mean
// step time and tokens/s of the timed steps (after the first); whether the checkpoint reloaded
// (the resumed run's step count) and the resumed run's peak (its load and one step). Then one
// JSON line per mode.
//
//   bench/gpt --layers 24 --width 2048 --heads 16 --workers 4 --modes zero3-deferred,zero3-disk
//             --offload-dir /var/tmp                                   (1.2 B parameters)
//
// On a GPU (--device cuda, one worker: bf16 autocast, each step one CUDA graph but with ddp-host)
// it also prints model FLOPs utilisation against --peak-tflops (models::GptImpl::flops_per_token:
// 6 per weight and token, and attention's) and the GPU memory the worker holds after its steps
// (NVML's figure for the process).
#include <torch/torch.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <iomanip>
#include <iostream>
#include <map>

#include "cohort/cohort.h"
#include "cohort/models/model_spec.h"
#include "cohort/models/zoo.h"
#include "cohort/runtime/blas.h"
#include "cohort/runtime/gpu_usage.h"
#include "cohort/runtime/heap.h"
#include "cohort/runtime/worker_info.h"
#include "fresh_process.h"
#include "gpt_config.h"

namespace {

using cohort::Json;
namespace train = cohort::train;
namespace models = cohort::models;

models::ModelOptions options_of(const Json& c) {
  auto o = cohort::bench::gpt_options(c);
  o.deferred_init = c["mode"].get<std::string>().rfind("zero3-", 0) == 0;
  return o;
}

train::Plan plan_of(const Json& c) {
  train::Plan plan;
  const auto mode = c["mode"].get<std::string>();
  if (mode.rfind("zero3", 0) == 0) plan.zero.stage = 3;
  if (mode == "ddp-host") plan.offload_optimizer = train::parse_optimizer_offload("cpu");
  // On a GPU: bf16 autocast and each step one CUDA graph (the flat optimizer's step included),
  // but where the update runs on the host.
  if (c["cuda"].get<bool>()) {
    plan.precision = cohort::optim::Precision::kBf16;
    plan.cuda_graph = mode != "ddp-host";
  }
  if (mode == "zero3-disk")
    plan.offload_optimizer =
        train::parse_optimizer_offload("disk:" + c["offload_dir"].get<std::string>());
  if (mode.rfind("pipeline", 0) == 0 || mode == "mesh") {
    plan.pp = 2;
    plan.tp = mode == "mesh" ? 2 : 1;
    plan.micro_batches = static_cast<int>(c["batch_size"].get<int64_t>());
  }
  if (mode == "pipeline-zero2") plan.zero.stage = 2;
  if (mode == "pipeline-zero3") plan.zero.stage = 3;
  return plan;
}

std::unique_ptr<torch::optim::Optimizer> adamw(std::vector<at::Tensor> parameters) {
  return std::make_unique<cohort::optim::FlatAdamW>(parameters, torch::optim::AdamWOptions(1e-4));
}

// A worker: the plan's model, its steps, its peak memory, then the checkpoint; resumed, one step.
void worker_loop(const Json& c) {
  auto& ctx = train::get_context();
  const auto o = options_of(c);
  const auto plan = plan_of(c);
  auto model = train::parallelize(models::model_spec("gpt", o, 0), adamw,
                                  models::logits_cross_entropy, plan);
  const bool resumed = train::get_checkpoint().has_value();
  if (resumed) model.load(*train::get_checkpoint());
  const int64_t batch = c["batch_size"];
  const int64_t steps = resumed ? 1 : c["steps"].get<int64_t>();
  double timed = 0;
  for (int64_t step = 0; step < steps; ++step) {
    torch::manual_seed(step + 1000 * ctx.get_world_rank());
    const auto tokens =
        torch::randint(0, o.vocab_size, {batch, o.context + 1}).to(ctx.get_device());
    const auto start = std::chrono::steady_clock::now();
    model.step(tokens.narrow(1, 0, o.context), tokens.narrow(1, 1, o.context));
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (step > 0) timed += seconds;
    if (ctx.get_world_rank() == 0)
      std::cout << "  step " << model.steps() << ": " << seconds << " s" << std::endl;
  }
  const auto peak_training = static_cast<double>(train::peak_resident_bytes());
  // On a GPU, what the worker holds there after its steps (the caching allocator keeps its peak).
  double gpu_mb = 0;
  if (c["cuda"].get<bool>()) {
    const auto usage = cohort::runtime::Nvml::instance().usage_of({static_cast<int>(::getpid())});
    if (!usage.empty()) gpu_mb = usage.begin()->second.memory_mb;
  }
  const auto checkpointing = std::chrono::steady_clock::now();
  train::report({{"steps", model.steps()}}, model);
  const double checkpoint_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - checkpointing).count();
  const auto mine = torch::tensor(
      {peak_training, static_cast<double>(train::peak_resident_bytes()), timed}, torch::kDouble);
  double peak = 0, peak_checkpoint = 0, slowest = 0;
  for (const auto& r : ctx.get_process_group().allgather(mine)) {
    peak = std::max(peak, r[0].item<double>());
    peak_checkpoint = std::max(peak_checkpoint, r[1].item<double>());
    slowest = std::max(slowest, r[2].item<double>());
  }
  const double step_s = steps > 1 ? slowest / static_cast<double>(steps - 1) : 0.0;
  // The rows of a step: every pipeline's (a pipeline's and a tensor-parallel group's ranks read
  // the same).
  const int64_t pipelines = ctx.get_world_size() / (plan.pp * plan.tp);
  const double tokens_per_s =
      step_s > 0 ? static_cast<double>(batch * o.context * pipelines) / step_s : 0.0;
  train::report({{"peak_rss_bytes", peak},
                 {"peak_rss_bytes_with_checkpoint", peak_checkpoint},
                 {"step_s", step_s},
                 {"tokens_per_s", tokens_per_s},
                 {"checkpoint_s", checkpoint_s},
                 {"gpu_memory_mb", gpu_mb},
                 {"steps", model.steps()},
                 {"resumed", resumed}});
}

// One step's activations of the config's GPT at `batch` rows, built and measured under a worker's
// heap policy: what this bench's --probe prints, in a fresh process before any worker starts (so
// the whole model fits beside nothing else).
int64_t probe_here(const Json& c, int64_t batch) {
  cohort::runtime::heap_for_setup();
  torch::manual_seed(0);
  auto model = models::create_model("gpt", cohort::bench::gpt_options(c));
  cohort::runtime::heap_for_steps();
  return models::measure_step_activations(*model, batch);
}

// A worker's activations for one step of `batch` rows (a pipeline's: one micro-batch's), probed
// in a fresh process.
int64_t probe_activations(const Json& c, int64_t batch) {
  std::string shape;
  for (const char* key : {"layers", "width", "heads", "context"})
    shape += std::string(" --") + key + " " + std::to_string(c[key].get<int64_t>());
  return cohort::bench::json_of_fresh_process("--probe" + shape + " --batch-size " +
                                              std::to_string(batch))["activation_bytes"];
}

// The estimate for the plan, from the model's shapes (built deferred: one unit at a time), with
// the activations that probe_activations measured.
train::MemoryEstimate estimate(const Json& c, int workers, int64_t runtime, int64_t activations) {
  auto o = options_of(c);
  o.deferred_init = true;
  torch::manual_seed(0);
  auto model = models::create_model("gpt", o);
  const auto plan = plan_of(c);
  train::ModelSpec spec{.module = model,
                        .forward = [model](const at::Tensor& x) { return model->forward(x); },
                        .layers = plan.pp > 1 ? models::pipeline_layers(*model, plan.pp) : nullptr};
  // The workers' AdamW is cohort's flat one: under DDP it keeps a gradient buffer of its own.
  return train::estimate_memory(spec, plan,
                                {.world_size = workers,
                                 .optimizer_states = 2,
                                 .flat_optimizer = true,
                                 .activation_bytes = activations,
                                 .runtime_bytes = runtime});
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t runtime = train::resident_bytes();
  CLI::App app{"the zoo's GPT under DDP and ZeRO-3 (deferred, on disk): memory and throughput"};
  std::vector<std::string> modes{"ddp", "zero3", "zero3-deferred", "zero3-disk"};
  int workers = 4, threads = 1;
  int64_t layers = 4, width = 256, heads = 8, context = 64, batch = 2, steps = 3;
  std::string offload_dir = std::filesystem::temp_directory_path().string();
  std::string device = "cpu";
  double peak_tflops = 989;
  app.add_option("--modes", modes,
                 "ddp, zero3, zero3-deferred, zero3-disk, ddp-host, pipeline, pipeline-zero2, "
                 "pipeline-zero3, mesh")
      ->delimiter(',')
      ->check(CLI::IsMember({"ddp", "zero3", "zero3-deferred", "zero3-disk", "ddp-host", "pipeline",
                             "pipeline-zero2", "pipeline-zero3", "mesh"}))
      ->capture_default_str();
  app.add_option("--workers", workers)->capture_default_str();
  app.add_option("--threads", threads, "torch threads per worker")->capture_default_str();
  app.add_option("--layers", layers)->capture_default_str();
  app.add_option("--width", width)->capture_default_str();
  app.add_option("--heads", heads)->capture_default_str();
  app.add_option("--context", context, "tokens per row")->capture_default_str();
  app.add_option("--batch-size", batch, "rows per worker and step")->capture_default_str();
  app.add_option("--steps", steps, "steps before the checkpoint (the first untimed)")
      ->capture_default_str();
  app.add_option("--offload-dir", offload_dir, "zero3-disk: where the state's files go")
      ->capture_default_str();
  app.add_option("--device", device, "cpu, or cuda (one worker)")->capture_default_str();
  app.add_option("--peak-tflops", peak_tflops,
                 "cuda: the GPU's peak for MFU (H100/H200 bf16 dense: 989)")
      ->capture_default_str();
  bool probe = false;
  app.add_flag("--probe", probe, "only measure one step's activations here, printed as JSON");
  CLI11_PARSE(app, argc, argv);
  const Json gpt_shape{
      {"layers", layers}, {"width", width}, {"heads", heads}, {"context", context}};
  if (probe) {
    std::cout << Json{{"activation_bytes", probe_here(gpt_shape, batch)}}.dump() << std::endl;
    return 0;
  }
  // A worker (this program re-executed by fit()) neither probes nor estimates: its start and
  // peak are its run's alone.
  const bool worker = cohort::runtime::is_spawned_worker();
  const bool cuda = device == "cuda";
  if (cuda && !torch::cuda::is_available()) {
    std::cout << "--device cuda: not measured: no GPU here" << std::endl;
    return 0;
  }
  const auto dir =
      std::filesystem::temp_directory_path() / ("cohort-bench-gpt-" + std::to_string(::getpid()));
  // The model's size, for the header and the JSON lines: not in a worker, whose heap would keep
  // what building it freed (a worker of the 101 M model started with 250 MB of it).
  int64_t parameters = 0;
  int64_t flops_per_token = 0;
  if (!worker) {
    torch::manual_seed(0);
    const auto shape = models::create_model("gpt", {.depth = layers,
                                                    .width = width,
                                                    .heads = heads,
                                                    .context = context,
                                                    .deferred_init = true});
    for (const auto& p : shape->parameters()) parameters += p.numel();
    flops_per_token = dynamic_cast<const models::GptImpl&>(*shape).flops_per_token(context);
    std::cout << "gpt: " << layers << " layers, width " << width << ", " << heads
              << " heads, context " << context << ": " << std::fixed << std::setprecision(1)
              << static_cast<double>(parameters) / 1e6 << " M parameters; " << (cuda ? 1 : workers)
              << " workers x batch " << batch << ", AdamW (fp32 state), " << steps
              << " steps, then a checkpoint and one resumed step; libtorch " << TORCH_VERSION
              << (cuda ? "" : ", BLAS " + cohort::runtime::blas_library().name) << std::endl;
  }
  const auto config_of = [&](const std::string& mode) {
    return Json{{"mode", mode},   {"layers", layers},           {"width", width},
                {"heads", heads}, {"context", context},         {"batch_size", batch},
                {"steps", steps}, {"offload_dir", offload_dir}, {"cuda", cuda}};
  };
  // On the CPU only: a GPU's activations are not in the workers' resident memory. By the rows
  // of a micro-batch (a step's, or a pipeline's micro-batch's), each size the modes take once.
  std::map<int64_t, int64_t> activations;
  for (const auto& mode : modes) {
    const int64_t rows = plan_of(config_of(mode)).micro_batch_rows(batch);
    if (cuda || worker || activations.count(rows) > 0) continue;
    activations[rows] = probe_activations(gpt_shape, rows);
    std::cout << "activations per worker of " << rows
              << " rows (probed on the whole model): " << std::setprecision(1)
              << static_cast<double>(activations[rows]) / 1e6 << " MB" << std::endl;
  }
  std::cout << std::left << std::setw(16) << "mode" << std::right << std::setw(16) << "peak RSS MB"
            << std::setw(14) << "estimate MB" << std::setw(8) << "ratio" << std::setw(18)
            << "with checkpoint" << std::setw(10) << "step s" << std::setw(10) << "tokens/s"
            << std::setw(14) << "checkpoint s" << std::setw(10) << "reloads" << std::setw(14)
            << "resumed MB" << std::endl;
  int failures = 0;
  for (const auto& mode : modes) {
    const Json config = config_of(mode);
    const auto plan = plan_of(config);
    const auto rows = activations.find(plan.micro_batch_rows(batch));
    const auto e =
        worker ? train::MemoryEstimate{}
               : estimate(config, workers, runtime, rows == activations.end() ? 0 : rows->second);
    const cohort::ScalingConfig scaling{.num_workers = cuda ? 1 : workers,
                                        .use_gpu = cuda,
                                        .resources_per_worker = {.cpu_threads = threads},
                                        .mesh = {.pp = plan.pp, .tp = plan.tp}};
    const cohort::RunConfig run{.name = mode, .storage_path = dir, .verbose = 0};
    const auto first = cohort::Trainer(worker_loop, scaling, run, config).fit();
    if (!first.ok()) {
      std::cout << std::left << std::setw(16) << mode << "failed: " << *first.error << std::endl;
      ++failures;
      continue;
    }
    const auto again = cohort::Trainer(worker_loop, scaling, run, config).fit();
    const bool reloaded = again.ok() && again.metrics["resumed"].get<bool>() &&
                          again.metrics["steps"].get<int64_t>() == steps + 1;
    const auto& m = first.metrics;
    const double peak = m["peak_rss_bytes"].get<double>();
    const double with_checkpoint = m["peak_rss_bytes_with_checkpoint"].get<double>();
    const double estimated = static_cast<double>(e.total());
    // The resumed run's peak: its load and one step.
    const double resumed_peak = reloaded ? again.metrics["peak_rss_bytes"].get<double>() : 0.0;
    std::cout << std::left << std::setw(16) << mode << std::right << std::setprecision(0)
              << std::setw(16) << peak / 1e6 << std::setw(14) << estimated / 1e6
              << std::setprecision(2) << std::setw(8) << estimated / peak << std::setprecision(0)
              << std::setw(18) << with_checkpoint / 1e6 << std::setprecision(2) << std::setw(10)
              << m["step_s"].get<double>() << std::setprecision(0) << std::setw(10)
              << m["tokens_per_s"].get<double>() << std::setprecision(1) << std::setw(14)
              << m["checkpoint_s"].get<double>() << std::setw(10) << (reloaded ? "yes" : "NO")
              << std::setprecision(0) << std::setw(14) << resumed_peak / 1e6 << std::endl;
    Json out{{"mode", mode},
             {"parameters", parameters},
             {"workers", workers},
             {"peak_rss_bytes", peak},
             {"peak_rss_bytes_with_checkpoint", with_checkpoint},
             {"estimate_bytes", e.total()},
             {"step_s", m["step_s"]},
             {"tokens_per_s", m["tokens_per_s"]},
             {"checkpoint_s", m["checkpoint_s"]},
             {"reloaded", reloaded},
             {"resumed_peak_rss_bytes", resumed_peak}};
    if (cuda && m["step_s"].get<double>() > 0) {
      out["mfu"] = m["tokens_per_s"].get<double>() * static_cast<double>(flops_per_token) /
                   (peak_tflops * 1e12);
      out["gpu_memory_mb"] = m["gpu_memory_mb"];
    }
    std::cout << out.dump() << std::endl;
    if (!reloaded) ++failures;
    std::filesystem::remove_all(dir / mode);
  }
  std::filesystem::remove_all(dir);
  return failures == 0 ? 0 : 1;
}

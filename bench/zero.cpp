// ZeRO stages 1, 2 and 3 against DDP: memory held per rank and training throughput.
//
//   bench/zero --workers 2 --modes ddp,ddp-flat,1,2,3   (defaults: a 100.7 M-parameter MLP,
//                                                        Adam, fp32)
//   bench/zero --modes ddp-flat,2 --offload-dir /scratch  the optimizer state in files there
//
// For each mode, N worker processes train the MLP (--layers Linear layers of --width x --width,
// batch --batch-size of random data) for --warmup + --steps steps, and print one JSON line:
//   bytes_per_param: parameters, gradients and optimizer state held per rank after a step,
//     counted from the live tensors (each storage once), beside the ZeRO paper's form for fp32
//     Adam (DDP 16; stage 1 8 + 8/N; stage 2 4 + 12/N; stage 3 16/N) and their ratio
//     (ddp-flat: DDP with cohort's FlatAdam, which holds its own gradient buffer: 20);
//   transient_bucket_bytes_per_param: stage 2's and 3's gradient buckets in flight during
//     backward; gathered_bytes_per_param: stage 3's whole layers held at most at once (the one
//     running and those prefetched);
//   samples_per_s (all ranks, timed steps), bytes_sent_per_step per rank (DDP: a ring
//     all-reduce, 2 (N - 1) / N of the gradients; ZeRO: its own count), peak_rss_mb.
// With --checkpoint, each mode then saves a checkpoint (train::save_checkpoint, into the run's
// folder, removed after) and adds checkpoint_s and peak_rss_mb_after_checkpoint: stage 3 writes
// the model one unit (layer) at a time, so its peak should not grow by the whole model.
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <iostream>
#include <set>
#include <sstream>

#include "cohort/cohort.h"

namespace {

using Clock = std::chrono::steady_clock;

struct MlpImpl : torch::nn::Module {
  MlpImpl(int layers, int64_t width) {
    // Each layer a unit of ZeRO stage 3 (a plain layer at the other stages).
    for (int k = 0; k < layers; ++k) {
      stack.push_back(register_module(
          "layer" + std::to_string(k),
          cohort::parallel::FullyShard(torch::nn::Linear(torch::nn::LinearOptions(width, width)))));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (size_t k = 0; k < stack.size(); ++k) {
      x = stack[k]->forward(x);
      if (k + 1 < stack.size()) x = torch::relu(x);
    }
    return x;
  }
  std::vector<cohort::parallel::FullyShard> stack;
};
TORCH_MODULE(Mlp);

// Bytes of the distinct storages behind `tensors`.
int64_t storage_bytes(const std::vector<torch::Tensor>& tensors) {
  std::set<const void*> seen;
  int64_t bytes = 0;
  for (const auto& t : tensors) {
    if (!t.defined()) continue;
    const void* key = t.storage().unsafeGetStorageImpl();
    if (seen.insert(key).second) bytes += static_cast<int64_t>(t.storage().nbytes());
  }
  return bytes;
}

void bench_loop(const cohort::Json& c) {
  auto& ctx = cohort::train::get_context();
  const std::string mode = c["mode"].get<std::string>();
  const bool ddp = mode == "ddp" || mode == "ddp-flat";
  const int stage = ddp ? 0 : std::stoi(mode);
  torch::manual_seed(0);
  Mlp model(c["layers"].get<int>(), c["width"].get<int64_t>());
  int64_t numel = 0;
  for (const auto& p : model->parameters()) numel += p.numel();
  cohort::train::PrepareModelOptions prepare;
  prepare.zero.stage = stage;
  prepare.zero.reduce_bucket_size = c["reduce_bucket_size"].get<int64_t>();
  prepare.zero.allgather_bucket_size = c["reduce_bucket_size"].get<int64_t>();
  prepare.ddp.bucket_cap_mb = c["reduce_bucket_size"].get<int64_t>() * 4.0 / (1024 * 1024);
  cohort::train::prepare_model(model, prepare);
  // DDP with torch::optim::Adam: its state is the 8 bytes per parameter of the paper's form.
  // "ddp-flat": with cohort's FlatAdam, the update ZeRO runs on its shard (faster, and 4 bytes
  // per parameter more: its own gradient buffer).
  std::unique_ptr<torch::optim::Optimizer> adam;
  if (mode == "ddp-flat") {
    adam = std::make_unique<cohort::optim::FlatAdam>(model->parameters(),
                                                     torch::optim::AdamOptions(1e-4));
  } else {
    adam =
        std::make_unique<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(1e-4));
  }
  auto optimizer = cohort::train::prepare_optimizer(model.ptr(), std::move(adam));
  auto* flat = dynamic_cast<cohort::optim::FlatOptimizer*>(optimizer.get());
  auto* zero = dynamic_cast<cohort::parallel::ZeroOptimizer*>(optimizer.get());
  const std::string offload = c["offload_dir"].get<std::string>();
  if (!offload.empty()) {
    if (flat == nullptr) throw cohort::UsageError("--offload-dir needs ddp-flat or a ZeRO stage");
    flat->offload_state(offload);
  }
  const int64_t batch = c["batch_size"].get<int64_t>();
  const int64_t width = c["width"].get<int64_t>();
  const int64_t warmup = c["warmup"].get<int64_t>();
  const int64_t steps = c["steps"].get<int64_t>();
  torch::manual_seed(1 + ctx.get_world_rank());
  const auto x = torch::randn({batch, width});
  const auto y = torch::randn({batch, width});
  Clock::time_point start;
  double backward_seconds = 0, step_seconds = 0;
  for (int64_t step = 0; step < warmup + steps; ++step) {
    if (step == warmup) {
      ctx.get_process_group().barrier();
      start = Clock::now();
      backward_seconds = step_seconds = 0;
    }
    optimizer->zero_grad();
    const auto t0 = Clock::now();
    torch::mse_loss(model->forward(x), y).backward();
    const auto t1 = Clock::now();
    optimizer->step();
    backward_seconds += std::chrono::duration<double>(t1 - t0).count();
    step_seconds += std::chrono::duration<double>(Clock::now() - t1).count();
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();

  // What this rank holds after a step.
  double params = 0, grads = 0, state = 0, transient = 0, gathered = 0, sent = 0;
  std::vector<torch::Tensor> param_tensors, grad_tensors, state_tensors;
  for (const auto& p : model->parameters()) {
    param_tensors.push_back(p);
    grad_tensors.push_back(p.grad());
  }
  if (zero == nullptr && flat != nullptr) {
    params = static_cast<double>(storage_bytes(param_tensors));
    grads = static_cast<double>(storage_bytes(grad_tensors));
    state = static_cast<double>(flat->state_bytes());
    const int n = ctx.get_world_size();
    sent = 2.0 * (n - 1) / n * static_cast<double>(numel) * 4;
  } else if (zero != nullptr) {
    const auto stats = zero->stats();
    params = static_cast<double>(stats.parameter_bytes);
    grads = static_cast<double>(stats.gradient_bytes);
    state = static_cast<double>(stats.optimizer_state_bytes);
    transient = static_cast<double>(stats.bucket_bytes_peak);
    gathered = static_cast<double>(stats.gathered_bytes_peak);
    sent = static_cast<double>(stats.bytes_sent_last_step);
  } else {
    for (const auto& item : optimizer->state()) {
      const auto& s = static_cast<const torch::optim::AdamParamState&>(*item.second);
      state_tensors.push_back(s.exp_avg());
      state_tensors.push_back(s.exp_avg_sq());
    }
    params = static_cast<double>(storage_bytes(param_tensors));
    grads = static_cast<double>(storage_bytes(grad_tensors));
    state = static_cast<double>(storage_bytes(state_tensors));
    const int n = ctx.get_world_size();
    sent = 2.0 * (n - 1) / n * static_cast<double>(numel) * 4;
  }
  const auto peak_mb = [] {
    return static_cast<double>(cohort::train::peak_resident_bytes()) / (1 << 20);
  };
  const double rss_before_checkpoint = peak_mb();
  double checkpoint_seconds = 0;
  if (c["checkpoint"].get<bool>()) {
    const auto dir =
        ctx.get_storage_path() / ("bench-checkpoint-rank" + std::to_string(ctx.get_world_rank()));
    const auto t0 = Clock::now();
    cohort::train::save_checkpoint(dir, *model, *optimizer);
    checkpoint_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    std::filesystem::remove_all(dir);
  }
  auto mine = torch::tensor({seconds, params, grads, state, transient, sent, rss_before_checkpoint,
                             gathered, peak_mb(), checkpoint_seconds},
                            torch::kDouble);
  auto all = ctx.get_process_group().allgather(mine);
  double slowest = 0, rss = 0, rss_after = 0, checkpoint_slowest = 0;
  for (auto& r : all) {
    slowest = std::max(slowest, r[0].item<double>());
    rss = std::max(rss, r[6].item<double>());
    rss_after = std::max(rss_after, r[8].item<double>());
    checkpoint_slowest = std::max(checkpoint_slowest, r[9].item<double>());
  }
  const double n = ctx.get_world_size();
  const double p = static_cast<double>(numel);
  const double formula = mode == "ddp-flat" ? 20
                         : stage == 0       ? 16
                         : stage == 1       ? 8 + 8 / n
                         : stage == 2       ? 4 + 12 / n
                                            : 16 / n;
  const double total = (params + grads + state) / p;
  cohort::Json metrics{{"mode", ddp ? mode : "zero-" + mode},
                       {"workers", ctx.get_world_size()},
                       {"parameters", numel},
                       {"bytes_per_param",
                        {{"parameters", params / p},
                         {"gradients", grads / p},
                         {"optimizer_state", state / p},
                         {"total", total},
                         {"paper_form", formula},
                         {"ratio_to_form", total / formula}}},
                       {"transient_bucket_bytes_per_param", transient / p},
                       {"gathered_bytes_per_param", gathered / p},
                       {"samples_per_s", static_cast<double>(batch * steps) * n / slowest},
                       {"seconds_per_step", slowest / static_cast<double>(steps)},
                       // Rank 0's: forward and backward (with the gradient communication), and
                       // step() (with ZeRO the shard's update and the all-gather).
                       {"forward_backward_s", backward_seconds / static_cast<double>(steps)},
                       {"optimizer_step_s", step_seconds / static_cast<double>(steps)},
                       {"bytes_sent_per_step", sent},
                       {"peak_rss_mb", rss}};
  if (c["checkpoint"].get<bool>()) {
    metrics["checkpoint_s"] = checkpoint_slowest;
    metrics["peak_rss_mb_after_checkpoint"] = rss_after;
  }
  cohort::train::report(metrics);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"cohort ZeRO benchmark: memory per rank and throughput, DDP vs stages 1, 2, 3"};
  std::string modes = "ddp,ddp-flat,1,2,3";
  int workers = 2, threads = 1, layers = 6;
  bool checkpoint = false;
  int64_t width = 4096, batch = 8, steps = 5, warmup = 2, reduce_bucket_size = 25'000'000;
  app.add_option("--modes", modes, "comma-separated: ddp, ddp-flat, 1, 2, 3")
      ->capture_default_str();
  app.add_option("--workers", workers)->capture_default_str();
  app.add_option("--threads", threads, "CPU threads per worker")->capture_default_str();
  app.add_option("--layers", layers)->capture_default_str();
  app.add_option("--width", width)->capture_default_str();
  app.add_option("--batch-size", batch)->capture_default_str();
  app.add_option("--steps", steps, "timed steps")->capture_default_str();
  app.add_option("--warmup", warmup)->capture_default_str();
  app.add_option("--reduce-bucket-size", reduce_bucket_size,
                 "elements per gradient bucket (DDP: the same bytes as bucket_cap_mb)")
      ->capture_default_str();
  app.add_flag("--checkpoint", checkpoint,
               "save a checkpoint after the steps: its time and peak memory");
  std::string offload_dir;
  app.add_option("--offload-dir", offload_dir,
                 "the optimizer state in files in this folder (FlatOptimizer::offload_state; "
                 "ddp-flat and ZeRO): the RSS without it, and the step time with the disk");
  CLI11_PARSE(app, argc, argv);
  std::stringstream list(modes);
  for (std::string mode; std::getline(list, mode, ',');) {
    if (mode != "ddp" && mode != "ddp-flat" && mode != "1" && mode != "2" && mode != "3") {
      std::cerr << "error: --modes: '" << mode << "' is not ddp, ddp-flat, 1, 2 or 3" << std::endl;
      return 2;
    }
    cohort::Trainer trainer(
        bench_loop, {.num_workers = workers, .resources_per_worker = {.cpu_threads = threads}},
        {.name = "zero_" + mode,
         .storage_path = "/tmp/cohort_bench",
         .resume = false,
         .verbose = 0},
        {{"mode", mode},
         {"layers", layers},
         {"width", width},
         {"batch_size", batch},
         {"steps", steps},
         {"warmup", warmup},
         {"reduce_bucket_size", reduce_bucket_size},
         {"checkpoint", checkpoint},
         {"offload_dir", offload_dir}});
    auto result = trainer.fit();
    if (!result.ok()) {
      std::cerr << "error: " << *result.error << std::endl;
      return 1;
    }
    std::cout << result.metrics.dump() << std::endl;
    std::filesystem::remove_all(result.path);
  }
  // The storage folder too, once its runs are gone (it stays if something else is in it).
  std::error_code ignored;
  std::filesystem::remove("/tmp/cohort_bench", ignored);
  return 0;
}

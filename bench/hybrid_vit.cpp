// The zoo's ViT on Fashion-MNIST trained by a DP x PP x TP mesh and by pure data parallelism at
// the same global batch, step by step on the same rows:
//   hybrid_vit [--mesh 2,2,2] [--steps 20] [--batch 32] [--micro-batches 4]
//              [--schedule 1f1b] [--zero-stage 0|1|2] [--sync ddp|local-sgd:H|diloco:H]
//              [--data-dir DIR]
// The mesh run: dp x pp x tp worker processes; each pipeline cuts the ViT at its pipeline layers
// into pp stages, each stage's attention and MLP tensor-parallel over tp workers, DDP over dp (or
// ZeRO stage 1 or 2, which shards the optimizer's momentum over dp; or local SGD or DiLoCo, which
// average the replicas every H steps).
// The reference: dp worker processes, the whole ViT on each under the DDP engine (or the same
// local SGD or DiLoCo). Both start from the same weights (the same seed; the tensor-parallel
// slices are the dense model's) and take the same rows each step (the global batch --batch, dp
// rank d its d-th share). Both take the library's one path, train::parallelize with the plan of
// the flags (cli::PlanOptions), as cohort train does. Prints both loss curves, the largest relative
// difference between them, each run's time per step, the bytes a rank sends per step (over all its
// groups: the mesh's pp and tp traffic too) and the most optimizer state a rank holds.
#include <torch/torch.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <sstream>

#include "cohort/cli/plan_options.h"
#include "cohort/cohort.h"
#include "cohort/models/model_spec.h"

namespace {

using Clock = std::chrono::steady_clock;

// The run's plan (the bench's flags as PlanOptions, the mesh's degrees) made parallel by the
// library's one path, train::parallelize, as cohort train does.
void bench_loop(const cohort::Json& c) {
  torch::set_num_threads(1);
  auto& ctx = cohort::train::get_context();
  auto world = ctx.get_process_group();
  const auto plan = c["plan"].get<cohort::cli::PlanOptions>().plan(ctx.get_world_size());
  const int steps = c["steps"], batch = c["batch"];
  auto model = cohort::train::parallelize(
      cohort::models::model_spec("vit", {}, 7),
      [](std::vector<at::Tensor> parameters) {
        return std::make_unique<torch::optim::SGD>(parameters,
                                                   torch::optim::SGDOptions(0.05).momentum(0.9));
      },
      [](const at::Tensor& out, const at::Tensor& y) {
        return torch::nn::functional::cross_entropy(out, y);
      },
      plan);
  const int dp = ctx.get_world_size() / (plan.pp * plan.tp);
  const int dp_index = ctx.has_mesh() ? ctx.get_mesh().dp_index() : ctx.get_world_rank();
  const int tp_index = ctx.has_mesh() ? ctx.get_mesh().tp_index() : 0;

  // Step s takes the training set's rows [s x batch, (s+1) x batch); dp rank d its d-th share.
  const auto train =
      cohort::data::load_mnist(c["data_dir"].get<std::string>(), cohort::data::Split::kTrain);
  const int64_t share = batch / dp;
  std::vector<double> losses;
  double seconds = 0;
  // The world's counter: every group of the mesh counts into it.
  const int64_t bytes_before = world.bytes_sent();
  for (int step = 0; step < steps; ++step) {
    const int64_t first = int64_t(step) * batch + dp_index * share;
    const auto rows = train.get_batch(torch::arange(first, first + share));
    world.barrier();
    const auto start = Clock::now();
    const at::Tensor loss = model.step(rows.data, rows.target).loss;
    if (step > 0) seconds += std::chrono::duration<double>(Clock::now() - start).count();
    // The global batch's mean loss: the last stage's ranks of tp index 0 hold one per dp rank.
    const bool holds = loss.defined() && tp_index == 0;
    std::vector<at::Tensor> sum{
        torch::tensor({holds ? loss.item<double>() : 0.0, holds ? 1.0 : 0.0}, torch::kDouble)};
    world.allreduce(sum);
    losses.push_back(sum[0][0].item<double>() / sum[0][1].item<double>());
  }
  const double bytes_per_step = static_cast<double>(world.bytes_sent() - bytes_before) / steps;
  // The optimizer state this rank holds (the momentum: whole with DDP and local SGD, a shard with
  // ZeRO), the most over the ranks.
  double state_bytes = 0;
  auto& optimizer = model.optimizer();
  auto* local = dynamic_cast<cohort::parallel::LocalSgdOptimizer*>(&optimizer);
  if (const auto* zero = dynamic_cast<const cohort::parallel::ZeroOptimizer*>(&optimizer)) {
    state_bytes = static_cast<double>(zero->stats().optimizer_state_bytes);
  } else {
    for (const auto& [key, state] : (local != nullptr ? local->inner() : optimizer).state()) {
      state_bytes += static_cast<double>(
          static_cast<const torch::optim::SGDParamState&>(*state).momentum_buffer().nbytes());
    }
  }
  double most_state_bytes = 0;
  for (const auto& t : world.allgather(torch::tensor({state_bytes}, torch::kDouble)))
    most_state_bytes = std::max(most_state_bytes, t.item<double>());
  double most_bytes = 0;
  for (const auto& t : world.allgather(torch::tensor({bytes_per_step}, torch::kDouble)))
    most_bytes = std::max(most_bytes, t.item<double>());
  cohort::train::report({{"losses", losses},
                         {"ms_per_step", steps > 1 ? 1e3 * seconds / (steps - 1) : 0.0},
                         {"bytes_per_step", most_bytes},
                         {"optimizer_state_bytes", most_state_bytes}});
}

std::vector<int> parse_list(const std::string& text) {
  std::vector<int> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) out.push_back(std::stoi(item));
  return out;
}

// One run of `plan` on dp x pp x tp workers: its per-step losses and time per step, or an error.
cohort::Json run(int dp, const cohort::cli::PlanOptions& plan, const cohort::Json& config) {
  const std::string storage = "/tmp/cohort_bench_hybrid_vit";
  auto c = config;
  c["plan"] = plan;
  cohort::Trainer trainer(
      bench_loop, {.num_workers = dp * plan.pp * plan.tp, .mesh = {.pp = plan.pp, .tp = plan.tp}},
      {.name = "hybrid_vit", .storage_path = storage, .resume = false, .verbose = 0}, c);
  const cohort::Result result = trainer.fit();
  std::filesystem::remove_all(storage);
  if (!result.ok()) throw std::runtime_error(*result.error);
  return result.metrics;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"The ViT on a DP x PP x TP mesh against pure data parallelism"};
  std::string mesh_text = "2,2,2", schedule = "1f1b", sync = "ddp";
  int steps = 20, batch = 32, micro_batches = 4, zero_stage = 0;
  std::string data_dir = cohort::data::default_fashion_mnist_dir().string();
  app.add_option("--mesh", mesh_text, "dp,pp,tp");
  app.add_option("--steps", steps);
  app.add_option("--batch", batch, "the global batch: rows per step over all dp ranks");
  app.add_option("--micro-batches", micro_batches);
  app.add_option("--schedule", schedule, "gpipe, 1f1b or zero-bubble");
  app.add_option("--zero-stage", zero_stage, "the mesh's data parallelism: 0 DDP, 1 or 2 ZeRO")
      ->check(CLI::Range(0, 2));
  app.add_option("--sync", sync,
                 "the data parallelism of both runs: ddp, local-sgd:H or diloco:H (not with ZeRO)");
  app.add_option("--data-dir", data_dir);
  CLI11_PARSE(app, argc, argv);
  const auto mesh = parse_list(mesh_text);
  if (mesh.size() != 3 || batch % mesh[0] != 0 || (batch / mesh[0]) < micro_batches) {
    std::fprintf(stderr,
                 "error: --mesh takes dp,pp,tp; --batch must split into dp shares of at least "
                 "--micro-batches rows\n");
    return 2;
  }
  // The mesh run's plan, and the reference's: pure data parallelism over as many replicas, DDP
  // (or --sync) on the whole model.
  cohort::cli::PlanOptions hybrid_plan{.pp = mesh[1],
                                       .tp = mesh[2],
                                       .micro_batches = micro_batches,
                                       .schedule = schedule,
                                       .zero = {.stage = zero_stage},
                                       .sync = sync};
  cohort::cli::PlanOptions plain_plan{.sync = sync};
  try {
    if (std::holds_alternative<cohort::parallel::AsyncParameterServer>(
            cohort::parallel::parse_sync_mode(sync))) {
      throw cohort::UsageError("--sync takes ddp, local-sgd:H or diloco:H");
    }
    hybrid_plan.plan(mesh[0] * mesh[1] * mesh[2]);  // one line naming the flags that conflict
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
  const cohort::Json config{{"steps", steps}, {"batch", batch}, {"data_dir", data_dir}};
  try {
    const auto hybrid = run(mesh[0], hybrid_plan, config);
    const auto plain = run(mesh[0], plain_plan, config);
    const auto a = hybrid["losses"].get<std::vector<double>>();
    const auto b = plain["losses"].get<std::vector<double>>();
    std::printf("%4s %12s %12s %10s\n", "step", "mesh loss", "dp loss", "rel diff");
    double worst = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      const double rel = std::abs(a[i] - b[i]) / std::abs(b[i]);
      worst = std::max(worst, rel);
      std::printf("%4zu %12.6f %12.6f %10.2e\n", i + 1, a[i], b[i], rel);
    }
    std::printf(
        "mesh dp %d x pp %d x tp %d (%s, %d micro-batches, %s) against dp %d, global batch %d: "
        "largest relative loss difference over %d steps %.2e; %.1f ms/step against %.1f; "
        "a rank sends at most %.3f MB per step (dp, pp and tp) against %.3f; optimizer state per "
        "rank at most %.2f MB against %.2f\n",
        mesh[0], mesh[1], mesh[2], schedule.c_str(), micro_batches,
        zero_stage > 0 ? ("ZeRO stage " + std::to_string(zero_stage)).c_str()
                       : (sync == "ddp" ? std::string("DDP") : sync).c_str(),
        mesh[0], batch, steps, worst, hybrid["ms_per_step"].get<double>(),
        plain["ms_per_step"].get<double>(), hybrid["bytes_per_step"].get<double>() / 1e6,
        plain["bytes_per_step"].get<double>() / 1e6,
        hybrid["optimizer_state_bytes"].get<double>() / 1e6,
        plain["optimizer_state_bytes"].get<double>() / 1e6);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}

// The memory estimator against measurement: for each zoo model and plan (DDP, ZeRO 1, 2 and 3),
// train::estimate_memory's figure per worker (made as `cohort estimate` makes it: in a fresh
// process under a worker's heap policy, its resident memory before the model as the runtime, the
// activations from models::measure_step_activations) beside the peak resident memory
// of the workers of a real run of the plan (2 workers by default, AdamW, random batches of the
// model's inputs: Fashion-MNIST's images, or tokens for the GPT at its default size), from their
// start to the end of their steps.
//
// Each model's probe runs in a process of its own (this program again, with --probe MODEL): a
// probe after other work in the same process finds less, its heap already grown. The workers,
// which re-execute this program, skip the estimates: their start and peak are the run's alone.
//
//   bench/memory_estimate [--models mlp,cnn,resnet18,vit,gpt] [--modes 0,1,2,3] [--workers 2]
//                         [--batch-size 64] [--steps 3] [--runs 1]
//
// Prints a table, then one JSON line per model and plan. With --runs N each plan runs N times
// (the peak moves by several MB from run to run: which thread's arena a block comes from, and
// the order the heap's holes are filled in): the table shows the median run's peak and the
// lowest and highest ratio.
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <iomanip>
#include <iostream>
#include <sstream>

#include "cohort/cohort.h"
#include "cohort/models/model_spec.h"
#include "cohort/models/zoo.h"
#include "cohort/runtime/heap.h"
#include "cohort/runtime/worker_info.h"
#include "fresh_process.h"

namespace {

using cohort::Json;
namespace train = cohort::train;

train::Plan plan_of(const Json& c) {
  train::Plan plan;
  plan.zero.stage = c["stage"].get<int>();
  return plan;
}

std::unique_ptr<torch::optim::Optimizer> adamw(std::vector<at::Tensor> parameters) {
  return std::make_unique<torch::optim::AdamW>(parameters, torch::optim::AdamWOptions(1e-3));
}

// A worker: its resident memory before the model, then `steps` steps of the plan, then its peak.
void worker_loop(const Json& c) {
  auto& ctx = train::get_context();
  const int64_t start = train::resident_bytes();
  const auto spec = cohort::models::model_spec(c["model"], {}, 0);
  const auto zoo_model = std::dynamic_pointer_cast<cohort::models::ZooModelImpl>(spec.module);
  auto model = train::parallelize(spec, adamw, cohort::models::logits_cross_entropy, plan_of(c));
  const int64_t batch = c["batch_size"];
  for (int64_t step = 0; step < c["steps"].get<int64_t>(); ++step) {
    torch::manual_seed(step + 100 * ctx.get_world_rank());
    const auto [x, y] = zoo_model->sample_batch(batch);
    model.step(x, y);
  }
  const auto mine =
      torch::tensor({static_cast<double>(start), static_cast<double>(train::peak_resident_bytes())},
                    torch::kDouble);
  double start_max = 0, peak_max = 0;
  for (const auto& r : ctx.get_process_group().allgather(mine)) {
    start_max = std::max(start_max, r[0].item<double>());
    peak_max = std::max(peak_max, r[1].item<double>());
  }
  train::report({{"start_bytes", start_max}, {"peak_bytes", peak_max}});
}

// What a fresh process measures for `name` (this program's --probe): its resident memory before
// the model and one batch's forward and backward.
struct Probe {
  int64_t runtime_bytes = 0;
  int64_t activation_bytes = 0;
};

Probe probe_here(const std::string& name, int64_t batch, int64_t runtime) {
  // Built and probed under a worker's heap policy, as `cohort estimate` does.
  cohort::runtime::heap_for_setup();
  torch::manual_seed(0);
  auto model = cohort::models::create_model(name);
  cohort::runtime::heap_for_steps();
  return {runtime, cohort::models::measure_step_activations(*model, batch)};
}

Probe probe_in_fresh_process(const std::string& name, int64_t batch) {
  const auto j = cohort::bench::json_of_fresh_process("--probe " + name + " --batch-size " +
                                                      std::to_string(batch));
  return {j["runtime_bytes"].get<int64_t>(), j["activation_bytes"].get<int64_t>()};
}

// The estimate as `cohort estimate` makes it, with `probe` from a fresh process.
train::MemoryEstimate estimate(const std::string& name, int stage, int workers,
                               const Probe& probe) {
  torch::manual_seed(0);
  auto model = cohort::models::create_model(name);
  train::Plan plan;
  plan.zero.stage = stage;
  return train::estimate_memory(
      {.module = model, .forward = [model](const at::Tensor& in) { return model->forward(in); }},
      plan,
      {.world_size = workers,
       .optimizer_states = 2,
       .activation_bytes = probe.activation_bytes,
       .runtime_bytes = probe.runtime_bytes});
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t runtime = train::resident_bytes();  // before any model: libtorch and this process
  CLI::App app{"the memory estimator against the peak resident memory of real runs"};
  auto models = cohort::models::model_names();
  std::vector<int> modes{0, 1, 2, 3};
  int workers = 2;
  int64_t batch = 64, steps = 3;
  app.add_option("--models", models, "zoo models")->delimiter(',')->capture_default_str();
  app.add_option("--modes", modes, "ZeRO stages (0: DDP)")->delimiter(',')->capture_default_str();
  app.add_option("--workers", workers)->capture_default_str();
  app.add_option("--batch-size", batch, "rows per worker and step")->capture_default_str();
  app.add_option("--steps", steps)->capture_default_str();
  int runs = 1;
  app.add_option("--runs", runs, "runs of each plan (the table: the median, and the ratio's range)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  std::string probe_model;
  app.add_option("--probe", probe_model,
                 "only measure MODEL's runtime and activations here and print them as JSON");
  CLI11_PARSE(app, argc, argv);
  if (!probe_model.empty()) {
    const auto probe = probe_here(probe_model, batch, runtime);
    std::cout << Json{{"runtime_bytes", probe.runtime_bytes},
                      {"activation_bytes", probe.activation_bytes}}
                     .dump()
              << std::endl;
    return 0;
  }
  // A worker (this program re-executed by fit()) goes straight to its Trainer.
  const bool worker = cohort::runtime::is_spawned_worker();
  const auto dir = std::filesystem::temp_directory_path() /
                   ("cohort-memory-estimate-" + std::to_string(::getpid()));
  std::cout << "memory estimate against measurement: " << workers << " workers, AdamW, batch "
            << batch << ", " << steps << " steps" << std::endl
            << std::fixed << std::setprecision(1);
  std::cout << std::left << std::setw(10) << "model" << std::setw(7) << "plan" << std::right
            << std::setw(14) << "estimate MB" << std::setw(14) << "measured MB" << std::setw(9)
            << "ratio" << std::setw(16) << "worker start MB";
  if (runs > 1) std::cout << std::setw(16) << "ratio range";
  std::cout << std::endl;
  for (const auto& name : models) {
    const Probe probe = worker ? Probe{} : probe_in_fresh_process(name, batch);
    for (int stage : modes) {
      const auto e = worker ? train::MemoryEstimate{} : estimate(name, stage, workers, probe);
      // Each run's peak and worker start, sorted by the peak.
      std::vector<std::pair<double, double>> measured;
      for (int run = 0; run < runs; ++run) {
        cohort::Trainer trainer(
            worker_loop, {.num_workers = workers},
            {.name = name + "-" + std::to_string(stage) + "-" + std::to_string(run),
             .storage_path = dir,
             .verbose = 0},
            Json{{"model", name}, {"stage", stage}, {"batch_size", batch}, {"steps", steps}});
        const auto result = trainer.fit();
        if (!result.ok()) {
          std::cerr << name << " stage " << stage << ": " << *result.error << std::endl;
          std::filesystem::remove_all(dir);
          return 1;
        }
        measured.emplace_back(result.metrics["peak_bytes"].get<double>(),
                              result.metrics["start_bytes"].get<double>());
      }
      std::sort(measured.begin(), measured.end());
      const auto [peak, start] = measured[measured.size() / 2];
      const double estimated = static_cast<double>(e.total());
      const std::string plan = stage == 0 ? "ddp" : "zero" + std::to_string(stage);
      std::cout << std::left << std::setw(10) << name << std::setw(7) << plan << std::right
                << std::setw(14) << estimated / 1e6 << std::setw(14) << peak / 1e6 << std::setw(9)
                << std::setprecision(3) << estimated / peak << std::setw(16) << std::setprecision(1)
                << start / 1e6;
      if (runs > 1) {
        std::ostringstream range;
        range << std::fixed << std::setprecision(3) << estimated / measured.back().first << "-"
              << estimated / measured.front().first;
        std::cout << std::setw(16) << range.str();
      }
      std::cout << std::endl;
      Json items = Json::object();
      for (const auto& item : e.items) items[item.name] = item.bytes;
      Json peaks = Json::array();
      for (const auto& m : measured) peaks.push_back(m.first);
      std::cout << Json{{"model", name},
                        {"plan", plan},
                        {"workers", workers},
                        {"estimate_bytes", e.total()},
                        {"items", items},
                        {"measured_peak_bytes", peak},
                        {"measured_peak_bytes_of_each_run", peaks},
                        {"worker_start_bytes", start},
                        {"ratio", estimated / peak}}
                       .dump()
                << std::endl;
    }
  }
  std::filesystem::remove_all(dir);
}

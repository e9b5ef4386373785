// What seeing a run costs: seed 000's CNN on Fashion-MNIST, the same training with the driver's
// dashboard serving, TensorBoard files (every metric, histograms of every parameter and gradient
// at each report), a Chrome trace of a window of steps and the per-phase timing on, against the
// dashboard, TensorBoard and the trace off (the phase timing and status.json are always on: they
// are the cheap part). Runs alternate off / on so that drift of the machine hits both alike.
//   observability [--workers 2] [--steps 200] [--report-every 20] [--repeats 3]
//                 [--data-dir /usr/share/datasets/fashion-mnist]
// Prints one line per run, then the median samples/s of each and their ratio.
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>

#include "cohort/cohort.h"
#include "cohort/models/zoo.h"

namespace {

using Clock = std::chrono::steady_clock;

void bench_loop(const cohort::Json& c) {
  auto& ctx = cohort::train::get_context();
  torch::manual_seed(0);
  auto model = cohort::train::prepare_model(cohort::models::create_model("cnn"));
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.02).momentum(0.9));
  auto loader = cohort::train::prepare_data_loader(
      cohort::data::load_mnist(c["data_dir"].get<std::string>(), cohort::data::Split::kTrain),
      {.batch_size = 64, .shuffle = true, .drop_last = true});
  const int64_t total = c["steps"].get<int64_t>();
  const int64_t report_every = c["report_every"].get<int64_t>();
  constexpr int64_t kWarmup = 10;
  int64_t steps = 0;
  int64_t timed_samples = 0;
  Clock::time_point start;
  double loss_sum = 0;
  for (int epoch = 0; steps < total; ++epoch) {
    loader.set_epoch(epoch);
    for (auto& batch : loader) {
      if (steps == kWarmup) start = Clock::now();
      optimizer.zero_grad();
      at::Tensor loss;
      {
        auto forward = cohort::train::autocast();
        loss = torch::nn::functional::cross_entropy(model->forward(batch.data), batch.target);
      }
      cohort::train::backward(loss);
      cohort::train::step_optimizer(optimizer);
      loss_sum += loss.item<double>();
      ++steps;
      if (steps > kWarmup) timed_samples += batch.target.size(0) * ctx.get_world_size();
      const bool last = steps == total;
      if (steps % report_every == 0 || last) {
        const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
        cohort::train::report({{"loss", loss_sum / static_cast<double>(report_every)},
                               {"steps", steps},
                               {"samples_per_second", last ? timed_samples / seconds : 0.0}});
        loss_sum = 0;
      }
      if (last) break;
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"the cost of TensorBoard files, traces and phase timing on training throughput"};
  int workers = 2;
  int64_t steps = 200;
  int64_t report_every = 20;
  int repeats = 3;
  std::string data_dir = cohort::data::default_fashion_mnist_dir().string();
  app.add_option("--workers", workers)->capture_default_str();
  app.add_option("--steps", steps, "optimizer steps per run")->capture_default_str();
  app.add_option("--report-every", report_every, "steps between reports")->capture_default_str();
  app.add_option("--repeats", repeats, "runs of each setting")->capture_default_str();
  app.add_option("--data-dir", data_dir)->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  const auto storage = std::filesystem::temp_directory_path() / "cohort_bench_observability";
  const cohort::Json config{
      {"data_dir", data_dir}, {"steps", steps}, {"report_every", report_every}};
  std::vector<double> off, on;
  for (int r = 0; r < 2 * repeats; ++r) {
    const bool observed = r % 2 == 1;
    cohort::RunConfig run{.name = (observed ? "on_" : "off_") + std::to_string(r / 2),
                          .storage_path = storage,
                          .resume = false,
                          .verbose = 0};
    run.tensorboard = {.enabled = observed, .histograms = observed};
    if (observed) {
      run.profile_steps = {.first = steps / 2, .last = steps / 2 + 10};
      run.dashboard = cohort::DashboardOptions{.port = 0};
    }
    cohort::Trainer trainer(bench_loop, {.num_workers = workers}, run, config);
    const cohort::Result result = trainer.fit();
    if (!result.ok()) {
      std::cerr << "error: " << *result.error << "\n";
      return 1;
    }
    const double rate = result.metrics.at("samples_per_second").get<double>();
    (observed ? on : off).push_back(rate);
    std::printf("%-3s run %d: %8.1f samples/s (step time median %.1f ms, slowest rank %d)\n",
                observed ? "on" : "off", r / 2 + 1, rate,
                result.metrics.value("step_time_ms_median", 0.0),
                result.metrics.value("slowest_rank", -1));
    std::fflush(stdout);
  }
  const auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::printf(
      "observability on (dashboard, TensorBoard scalars + histograms, a %d-step trace, phase "
      "timing) vs "
      "off: %.1f vs %.1f samples/s, ratio %.3f (medians of %d runs, %d workers, %lld steps, "
      "a report every %lld)\n",
      11, median(on), median(off), median(on) / median(off), repeats, workers,
      static_cast<long long>(steps), static_cast<long long>(report_every));
  std::filesystem::remove_all(storage);
  return 0;
}

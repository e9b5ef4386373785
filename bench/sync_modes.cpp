// Synchronous, communication-efficient and asynchronous training on seed 000's CNN and
// Fashion-MNIST: for each sync mode (ddp, local-sgd:H, diloco:H, async-ps:K) and worker count,
// the bytes each worker sent per step and the test accuracy after the same number of samples;
// then, with one worker slowed down (a sleep of (factor - 1) x its own step time after every
// step), the throughput of each mode.
//   sync_modes [--workers 2,4] [--modes ddp,local-sgd:8,local-sgd:32,diloco:32,async-ps:4]
//              [--parameter-servers 1] [--epochs 1] [--slow-factor 2] [--slow-steps 192]
// Prints one JSON line per run, then a table. Every mode trains with the same optimizer (Adam,
// lr 1e-3, batch 32 per worker); DiLoCo's outer optimizer at the paper's defaults; the parameter
// servers run in the first workers' processes.
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <sstream>
#include <thread>

#include "cohort/cohort.h"
#include "cohort/models/zoo.h"

namespace {

using Clock = std::chrono::steady_clock;

// Mean accuracy over the test set, each rank evaluating its shard.
double test_accuracy(cohort::models::ZooModel& model, cohort::data::DataLoader& loader) {
  torch::NoGradGuard no_grad;
  model->eval();
  double correct = 0, total = 0;
  for (auto& batch : loader) {
    correct += model->forward(batch.data).argmax(1).eq(batch.target).sum().item<double>();
    total += static_cast<double>(batch.target.size(0));
  }
  model->train();
  std::vector<at::Tensor> sums{torch::tensor({correct, total}, torch::kDouble)};
  cohort::train::get_context().get_process_group().allreduce(sums);
  return sums[0][0].item<double>() / sums[0][1].item<double>();
}

void bench_loop(const cohort::Json& c) {
  auto& ctx = cohort::train::get_context();
  torch::manual_seed(0);
  const auto mode = cohort::parallel::parse_sync_mode(c["mode"].get<std::string>());
  auto model = cohort::models::create_model("cnn");
  cohort::train::prepare_model(model, {.sync = mode});
  auto optimizer = cohort::train::prepare_optimizer(
      model,
      std::make_unique<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(1e-3)));
  const std::string dir = c["data_dir"].get<std::string>();
  auto train_loader =
      cohort::train::prepare_data_loader(cohort::data::load_mnist(dir, cohort::data::Split::kTrain),
                                         {.batch_size = 32, .shuffle = true, .drop_last = true});
  auto test_loader = cohort::train::prepare_data_loader(
      cohort::data::load_mnist(dir, cohort::data::Split::kTest),
      {.batch_size = 500, .shuffle = false, .equal_shards = false});
  const int64_t max_steps = c["max_steps"].get<int64_t>();
  const bool slowed = ctx.get_world_rank() == c["slow_rank"].get<int>();
  const double slow_factor = c["slow_factor"].get<double>();
  auto* local = dynamic_cast<cohort::parallel::LocalSgdOptimizer*>(optimizer.get());
  auto* ps = dynamic_cast<cohort::parallel::ParameterServerOptimizer*>(optimizer.get());
  const int64_t bytes_before = ctx.get_process_group().bytes_sent();
  ctx.get_process_group().barrier();
  const auto start = Clock::now();
  int64_t steps = 0;
  int64_t samples = 0;
  for (int epoch = 0; epoch < c["epochs"].get<int>() && (max_steps == 0 || steps < max_steps);
       ++epoch) {
    train_loader.set_epoch(epoch);
    for (auto& batch : train_loader) {
      const auto step_start = Clock::now();
      optimizer->zero_grad();
      torch::nn::functional::cross_entropy(model->forward(batch.data), batch.target).backward();
      optimizer->step();
      if (slowed && slow_factor > 1) {
        std::this_thread::sleep_for((Clock::now() - step_start) * (slow_factor - 1));
      }
      ++steps;
      samples += batch.target.size(0);
      if (max_steps > 0 && steps >= max_steps) break;
    }
    if (local != nullptr) local->sync();
    if (ps != nullptr) ps->sync();
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  const int64_t bytes = ctx.get_process_group().bytes_sent() - bytes_before;
  const double accuracy = test_accuracy(model, test_loader);
  // Every rank's figures: samples per second (its own clock) and bytes per step.
  auto all = ctx.get_process_group().allgather(torch::tensor(
      {static_cast<double>(samples), seconds, static_cast<double>(bytes) / steps}, torch::kDouble));
  double rate = 0, bytes_per_step = 0;
  for (auto& r : all) {
    rate += r[0].item<double>() / r[1].item<double>();
    bytes_per_step += r[2].item<double>() / static_cast<double>(all.size());
  }
  // The parameter server's staleness: mean and largest over every worker's pushes.
  double staleness_mean = 0, staleness_max = 0;
  if (ps != nullptr) {
    const auto stats = ps->stats();
    auto staleness = ctx.get_process_group().allgather(
        torch::tensor({static_cast<double>(stats.staleness_sum), static_cast<double>(stats.pushes),
                       static_cast<double>(stats.staleness_max)},
                      torch::kDouble));
    double sum = 0, pushes = 0;
    for (auto& s : staleness) {
      sum += s[0].item<double>();
      pushes += s[1].item<double>();
      staleness_max = std::max(staleness_max, s[2].item<double>());
    }
    staleness_mean = pushes > 0 ? sum / pushes : 0;
  }
  cohort::train::report({{"mode", c["mode"]},
                         {"staleness_mean", staleness_mean},
                         {"staleness_max", staleness_max},
                         {"workers", ctx.get_world_size()},
                         {"steps_per_worker", steps},
                         {"samples", samples * ctx.get_world_size()},
                         {"bytes_per_step", bytes_per_step},
                         {"test_accuracy", accuracy},
                         {"samples_per_s", rate},
                         {"slow_factor", slow_factor}});
}

std::vector<std::string> split(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) out.push_back(item);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"cohort sync modes benchmark: DDP, local SGD, DiLoCo, the parameter server"};
  std::string workers_list = "2,4",
              modes_list = "ddp,local-sgd:8,local-sgd:32,diloco:32,async-ps:4";
  int parameter_servers = 1;
  std::string data_dir = cohort::data::default_fashion_mnist_dir();
  int epochs = 1;
  double slow_factor = 2;
  int64_t slow_steps = 192;
  app.add_option("--workers", workers_list, "worker counts, comma-separated");
  app.add_option("--modes", modes_list, "sync modes, comma-separated");
  app.add_option("--parameter-servers", parameter_servers, "servers of the async-ps runs");
  app.add_option("--epochs", epochs, "epochs of the accuracy runs");
  app.add_option("--slow-factor", slow_factor, "the slowed worker's step time x this (1: none)");
  app.add_option("--slow-steps", slow_steps, "steps per worker of the slowed runs (0: none)");
  app.add_option("--data-dir", data_dir);
  CLI11_PARSE(app, argc, argv);
  // The same path in the driver and in the workers, which re-run main() up to fit().
  const auto storage = std::filesystem::temp_directory_path() / "cohort_bench_sync_modes";
  std::vector<cohort::Json> rows;
  auto run = [&](int workers, const std::string& mode, int64_t max_steps, double factor) {
    // A usage error before any worker starts.
    const bool async = std::holds_alternative<cohort::parallel::AsyncParameterServer>(
        cohort::parallel::parse_sync_mode(mode));
    std::fprintf(stderr, "running %s on %d workers%s...\n", mode.c_str(), workers,
                 factor > 1 ? " (one slowed)" : "");
    cohort::Trainer trainer(
        bench_loop,
        {.num_workers = workers,
         .num_parameter_servers = async ? std::min(parameter_servers, workers) : 0},
        {.name = "run" + std::to_string(rows.size()), .storage_path = storage, .verbose = 0},
        {{"mode", mode},
         {"data_dir", data_dir},
         {"epochs", max_steps > 0 ? 1000 : epochs},
         {"max_steps", max_steps},
         {"slow_rank", factor > 1 ? workers - 1 : -1},
         {"slow_factor", factor}});
    auto result = trainer.fit();
    if (!result.ok()) throw cohort::RuntimeError(*result.error);
    std::cout << result.metrics.dump() << std::endl;
    rows.push_back(result.metrics);
  };
  try {
    for (const auto& w : split(workers_list))
      for (const auto& mode : split(modes_list)) run(std::stoi(w), mode, 0, 1);
    if (slow_steps > 0 && slow_factor > 1) {
      const int w = std::stoi(split(workers_list).front());
      for (const auto& mode : split(modes_list)) {
        run(w, mode, slow_steps, 1);
        run(w, mode, slow_steps, slow_factor);
      }
    }
  } catch (const std::exception& e) {
    std::filesystem::remove_all(storage);
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
  std::filesystem::remove_all(storage);
  std::printf("\n%-14s %7s %6s %14s %12s %10s %13s %16s\n", "mode", "workers", "slow", "bytes/step",
              "vs ddp", "accuracy", "samples/s", "staleness mean/max");
  for (const auto& r : rows) {
    double ddp_bytes = 0;
    for (const auto& o : rows)
      if (o["mode"] == "ddp" && o["workers"] == r["workers"]) ddp_bytes = o["bytes_per_step"];
    const double bytes = r["bytes_per_step"];
    std::printf("%-14s %7d %6.1f %14.0f %11.1fx %10.4f %13.1f %10.2f / %3.0f\n",
                r["mode"].get<std::string>().c_str(), r["workers"].get<int>(),
                r["slow_factor"].get<double>(), bytes, bytes > 0 ? ddp_bytes / bytes : 0.0,
                r["test_accuracy"].get<double>(), r["samples_per_s"].get<double>(),
                r["staleness_mean"].get<double>(), r["staleness_max"].get<double>());
  }
  return 0;
}

// Training throughput of cohort's DDP on the CNN of seed 000 and Fashion-MNIST.
//   --mode ddp          N workers, gradients synchronised by prepare_model
//   --mode independent  N workers at once, no communication at all: the limit DDP aims for
// Prints one JSON line: samples_per_s (all workers), comm_wait_fraction, peak_rss_mb (max over
// workers), per-rank figures. bench/ddp_throughput.py alternates this with PyTorch DDP.
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <filesystem>
#include <iostream>

#include "cohort/cohort.h"
#include "cohort/models/zoo.h"

namespace {

using Clock = std::chrono::steady_clock;

void bench_loop(const cohort::Json& c) {
  auto& ctx = cohort::train::get_context();
  torch::manual_seed(0);
  const bool ddp = c["mode"] == "ddp";
  auto model = cohort::models::create_model(c["model"].get<std::string>());
  cohort::train::PrepareModelOptions prepare;
  prepare.ddp.bucket_cap_mb = c["bucket_cap_mb"].get<double>();
  prepare.ddp.first_bucket_cap_mb = c["first_bucket_cap_mb"].get<double>();
  if (c["hook"] == "fp16") prepare.ddp.comm_hook = cohort::parallel::fp16_compress_hook();
  if (c["hook"] == "bf16") prepare.ddp.comm_hook = cohort::parallel::bf16_compress_hook();
  if (ddp) cohort::train::prepare_model(model, prepare);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  auto loader = cohort::train::prepare_data_loader(
      cohort::data::load_mnist(c["data_dir"].get<std::string>(), cohort::data::Split::kTrain),
      {.batch_size = c["batch_size"].get<int64_t>(), .shuffle = true, .drop_last = true});
  const int64_t warmup = c["warmup"].get<int64_t>();
  const int64_t steps = c["steps"].get<int64_t>();
  int64_t done = 0;
  int64_t samples = 0;
  double wait_before = 0;
  Clock::time_point start;
  for (int64_t epoch = 0; done < warmup + steps; ++epoch) {
    loader.set_epoch(epoch);
    for (auto& batch : loader) {
      if (done == warmup) {
        // Everyone starts the timed part together.
        ctx.get_process_group().barrier();
        if (ddp) wait_before = cohort::train::get_ddp(model).stats().wait_seconds;
        start = Clock::now();
      }
      optimizer.zero_grad();
      torch::nn::functional::cross_entropy(model->forward(batch.data), batch.target).backward();
      optimizer.step();
      if (done >= warmup) samples += batch.target.size(0);
      if (++done == warmup + steps) break;
    }
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  const double wait = ddp ? cohort::train::get_ddp(model).stats().wait_seconds - wait_before : 0;
  const double peak_mb = static_cast<double>(cohort::train::peak_resident_bytes()) / (1 << 20);
  auto mine = torch::tensor({samples / seconds, seconds, wait, peak_mb}, torch::kDouble);
  auto all = ctx.get_process_group().allgather(mine);
  double total_rate = 0, slowest = 0, wait_fraction = 0, rss = 0;
  cohort::Json ranks = cohort::Json::array();
  for (auto& r : all) {
    total_rate += r[0].item<double>();
    slowest = std::max(slowest, r[1].item<double>());
    wait_fraction += r[2].item<double>() / r[1].item<double>() / all.size();
    rss = std::max(rss, r[3].item<double>());
    ranks.push_back({{"samples_per_s", r[0].item<double>()}, {"peak_rss_mb", r[3].item<double>()}});
  }
  // In step-locked DDP every rank did the same work; the slowest clock is the honest one.
  const double rate = ddp ? static_cast<double>(samples) * all.size() / slowest : total_rate;
  cohort::train::report({{"mode", c["mode"]},
                         {"workers", all.size()},
                         {"samples_per_s", rate},
                         {"comm_wait_fraction", wait_fraction},
                         {"peak_rss_mb", rss},
                         {"steps", steps},
                         {"ranks", ranks}});
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"cohort DDP throughput benchmark"};
  std::string mode = "ddp", model = "cnn", hook = "none";
  std::string data_dir = cohort::data::default_fashion_mnist_dir();
  int workers = 2, threads = 1;
  int64_t batch = 64, steps = 200, warmup = 20;
  double bucket_cap_mb = 25, first_bucket_cap_mb = 1;
  app.add_option("--mode", mode, "ddp or independent")
      ->check(CLI::IsMember({"ddp", "independent"}));
  app.add_option("--model", model);
  app.add_option("--workers", workers);
  app.add_option("--threads", threads);
  app.add_option("--batch-size", batch);
  app.add_option("--steps", steps);
  app.add_option("--warmup", warmup);
  app.add_option("--data-dir", data_dir);
  app.add_option("--bucket-cap-mb", bucket_cap_mb);
  app.add_option("--first-bucket-cap-mb", first_bucket_cap_mb);
  app.add_option("--hook", hook)->check(CLI::IsMember({"none", "fp16", "bf16"}));
  CLI11_PARSE(app, argc, argv);
  cohort::Trainer trainer(
      bench_loop, {.num_workers = workers, .resources_per_worker = {.cpu_threads = threads}},
      {.name = "ddp_throughput", .storage_path = "/tmp/cohort_bench", .verbose = 0},
      {{"mode", mode},
       {"model", model},
       {"batch_size", batch},
       {"steps", steps},
       {"warmup", warmup},
       {"data_dir", data_dir},
       {"bucket_cap_mb", bucket_cap_mb},
       {"first_bucket_cap_mb", first_bucket_cap_mb},
       {"hook", hook}});
  auto result = trainer.fit();
  // The figures are printed; the run's folder is not kept.
  std::error_code ignored;
  std::filesystem::remove_all("/tmp/cohort_bench/ddp_throughput", ignored);
  std::filesystem::remove("/tmp/cohort_bench", ignored);  // when nothing else is in it
  if (!result.ok()) {
    std::cerr << "error: " << *result.error << std::endl;
    return 1;
  }
  std::cout << result.metrics.dump() << std::endl;
  return 0;
}

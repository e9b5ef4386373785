// Seed 003's workload scaled to this machine: synthetic RGB images, a chain of k GaussianBlur(11)
// passes and a normalisation, feeding a small CNN trainer. Prints, per configuration (the
// preprocessing inline on the trainer's prefetch thread, or offloaded to 1 or 2 preprocessing
// processes): trainer steps/s, the exposed ingest time per step (the trainer's wait for data),
// CPU use of the machine and peak memory; then the throughput against min(preprocessing capacity, training
// capacity), each measured alone, and peak memory at two dataset lengths.
//
//   build/bench/data_offload [--size 96] [--blurs 10] [--rows 640] [--batch 32]
#include <sys/resource.h>
#include <unistd.h>

#include <fstream>

#include <iomanip>
#include <iostream>

#include <CLI/CLI.hpp>

#include "cohort/cohort.h"

using namespace cohort;
using Clock = std::chrono::steady_clock;

namespace {

struct Settings {
  int64_t size = 96;
  int blurs = 10;
  int64_t rows = 640;
  int64_t batch = 32;
};

data::Dataset pipeline(const Settings& s, int blurs, int64_t rows, int workers) {
  data::Chain chain;
  for (int i = 0; i < blurs; ++i) chain.steps.push_back(data::GaussianBlur{.kernel_size = 11});
  chain.steps.push_back(data::Normalize{.mean = {0.5, 0.5, 0.5}, .std = {0.25, 0.25, 0.25}});
  return data::Dataset::synthetic_images(rows, {.height = s.size, .width = s.size, .channels = 3, .seed = 1})
      .random_shuffle(3)
      .map_batches(chain, {.name = "blur x" + std::to_string(blurs), .batch_size = s.batch, .num_workers = workers});
}

torch::nn::Sequential make_model() {
  return torch::nn::Sequential(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 16, 5).stride(2)), torch::nn::ReLU(),
                               torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 32, 3).stride(2)), torch::nn::ReLU(),
                               torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 32, 3).stride(2)), torch::nn::ReLU(),
                               torch::nn::AdaptiveAvgPool2d(1), torch::nn::Flatten(), torch::nn::Linear(32, 10));
}

// CPU seconds the whole machine spent busy (trainer and preprocessing workers alike), from
// /proc/stat: run on an otherwise idle machine.
double cpu_seconds() {
  std::ifstream stat("/proc/stat");
  std::string cpu;
  uint64_t user = 0, nice = 0, system = 0, idle = 0, iowait = 0, irq = 0, softirq = 0, steal = 0;
  stat >> cpu >> user >> nice >> system >> idle >> iowait >> irq >> softirq >> steal;
  return static_cast<double>(user + nice + system + irq + softirq + steal) / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

struct Figures {
  double steps_per_s = 0;
  double ingest_ms = 0;
  double step_ms = 0;
  double cpus = 0;
  double rss_mb = 0;  // the trainer process's peak
};

// Trains over the pipeline for 2 epochs; the first (start-up, warm-up) is not timed.
Figures train_over(const data::Dataset& ds, const Settings& s) {
  auto model = make_model();
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  auto it = ds.iterator();
  Figures f;
  for (int epoch = 0; epoch < 2; ++epoch) {
    const auto before = it.stats();
    const auto start = Clock::now();
    const double cpu_start = cpu_seconds();
    int64_t steps = 0;
    for (auto& batch : it.iter_batches({.batch_size = s.batch, .prefetch_batches = 2})) {
      optimizer.zero_grad();
      auto loss = torch::nn::functional::cross_entropy(model->forward(batch["image"]), batch["label"]);
      loss.backward();
      optimizer.step();
      ++steps;
    }
    const double wall = std::chrono::duration<double>(Clock::now() - start).count();
    const auto after = it.stats();
    f.steps_per_s = static_cast<double>(steps) / wall;
    f.step_ms = 1000.0 * wall / static_cast<double>(steps);
    f.ingest_ms = 1000.0 * (after.wait_seconds - before.wait_seconds) / static_cast<double>(after.batches - before.batches);
    f.cpus = (cpu_seconds() - cpu_start) / wall;
  }
  rusage self{};
  getrusage(RUSAGE_SELF, &self);
  f.rss_mb = static_cast<double>(self.ru_maxrss) / 1024.0;
  return f;
}

// Batches per second the preprocessing alone delivers with `workers` processes (0: one thread).
double preprocessing_capacity(const data::Dataset& ds, const Settings& s) {
  auto it = ds.iterator();
  double rate = 0;
  for (int epoch = 0; epoch < 2; ++epoch) {
    const auto start = Clock::now();
    int64_t batches = 0;
    for (auto& batch : it.iter_batches({.batch_size = s.batch})) batches += batch.num_rows() > 0;
    rate = static_cast<double>(batches) / std::chrono::duration<double>(Clock::now() - start).count();
  }
  return rate;
}

// Steps per second the trainer alone manages on one ready batch.
double training_capacity(const Settings& s) {
  auto model = make_model();
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  auto images = torch::randn({s.batch, 3, s.size, s.size});
  auto labels = torch::randint(10, {s.batch}, torch::kLong);
  const int steps = 30;
  Clock::time_point start;
  for (int i = 0; i < steps + 5; ++i) {
    if (i == 5) start = Clock::now();
    optimizer.zero_grad();
    torch::nn::functional::cross_entropy(model->forward(images), labels).backward();
    optimizer.step();
  }
  return steps / std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Preprocessing offload: trainer throughput and exposed ingest time"};
  Settings s;
  app.add_option("--size", s.size, "image height and width")->capture_default_str();
  app.add_option("--blurs", s.blurs, "GaussianBlur(11) passes per image (heavy case)")->capture_default_str();
  app.add_option("--rows", s.rows, "images per epoch")->capture_default_str();
  app.add_option("--batch", s.batch, "images per step")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  // The trainer computes on one CPU, as one rank of a group would; the rest is for preprocessing.
  torch::set_num_threads(1);

  // A preprocessing worker is this program again: it builds the pipelines and serves its own.
  if (runtime::spawned_role() == data::kDataRole) {
    for (int blurs : {s.blurs, 0}) {
      for (int64_t rows : {s.rows, 4 * s.rows}) data::serve_if_data_worker(pipeline(s, blurs, rows, 1));
    }
    return 2;
  }

  std::cout << "images " << s.size << "x" << s.size << "x3, batch " << s.batch << ", " << s.rows
            << " images per epoch, " << std::thread::hardware_concurrency() << " CPUs; trainer: small CNN, 1 thread\n";
  const double train_rate = training_capacity(s);
  std::cout << "training capacity alone: " << std::fixed << std::setprecision(2) << train_rate << " steps/s\n";
  for (int blurs : {s.blurs, 0}) {
    std::cout << "\n== " << (blurs > 0 ? std::to_string(blurs) + " blur passes and normalisation" : std::string("normalisation only"))
              << " per image ==\n";
    std::cout << std::left << std::setw(12) << "config" << std::right << std::setw(10) << "steps/s" << std::setw(11)
              << "step ms" << std::setw(12) << "ingest ms" << std::setw(10) << "ingest%" << std::setw(8) << "CPUs"
              << std::setw(13) << "prep cap/s" << std::setw(13) << "vs min(cap)" << std::setw(10) << "RSS MB" << "\n";
    for (int workers : {0, 1, 2}) {
      const double prep = preprocessing_capacity(pipeline(s, blurs, s.rows, workers), s);
      const auto f = train_over(pipeline(s, blurs, s.rows, workers), s);
      const std::string name = workers == 0 ? "inline" : std::to_string(workers) + " worker" + (workers > 1 ? "s" : "");
      std::cout << std::left << std::setw(12) << name << std::right << std::setprecision(2) << std::setw(10)
                << f.steps_per_s << std::setw(11) << f.step_ms << std::setw(12) << f.ingest_ms << std::setw(9)
                << 100.0 * f.ingest_ms / f.step_ms << "%" << std::setw(8) << f.cpus << std::setw(13) << prep
                << std::setw(12) << 100.0 * f.steps_per_s / std::min(prep, train_rate) << "%" << std::setw(10)
                << f.rss_mb << "\n";
    }
  }
  // Bounded memory: the trainer's peak with 4x the images (offloaded to 2 workers).
  const auto longer = train_over(pipeline(s, s.blurs, 4 * s.rows, 2), s);
  std::cout << "\npeak trainer RSS with " << 4 * s.rows << " images per epoch, 2 workers: " << longer.rss_mb
            << " MB (the table's runs above: " << s.rows << " images)\n";
  return 0;
}

// Seed 003's workload scaled to this machine: synthetic RGB images, a chain of k GaussianBlur(11)
// passes and a normalisation, feeding a small CNN trainer. Prints, per configuration (the
// preprocessing inline on the trainer's prefetch thread, or offloaded to 1 or 2 preprocessing
// processes): trainer steps/s, the exposed ingest time per step (the trainer's wait for data),
// CPU use of the machine and peak memory; then the throughput against min(preprocessing capacity,
// training capacity), each measured alone, and peak memory at two dataset lengths. A second table
// runs the preprocessing in a worker on another host: a network namespace joined to this one by a
// veth pair (10.231.0.1 here, 10.231.0.2 there), the worker connecting over TCP (needs root; the
// namespace is removed at the end).
//
//   build/bench/data_offload [--size 96] [--blurs 10] [--rows 640] [--batch 32] [--epochs 3]
//   [--no-netns]
#include <arpa/inet.h>
#include <netinet/in.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include <iomanip>
#include <iostream>

#include <CLI/CLI.hpp>

#include "cohort/cohort.h"
#include "cohort/runtime/process.h"
#include "cohort/runtime/worker_group.h"

using namespace cohort;
using Clock = std::chrono::steady_clock;

namespace {

struct Settings {
  int64_t size = 96;
  int blurs = 10;
  int64_t rows = 640;
  int64_t batch = 32;
  int epochs = 3;  // timed, after one untimed (start-up, warm-up)
};

data::Dataset pipeline(const Settings& s, int blurs, int64_t rows, int workers,
                       data::ExecutionOptions execution = {}) {
  data::Chain chain;
  for (int i = 0; i < blurs; ++i) chain.steps.push_back(data::GaussianBlur{.kernel_size = 11});
  chain.steps.push_back(data::Normalize{.mean = {0.5, 0.5, 0.5}, .std = {0.25, 0.25, 0.25}});
  return data::Dataset::synthetic_images(
             rows, {.height = s.size, .width = s.size, .channels = 3, .seed = 1})
      .random_shuffle(3)
      .map_batches(
          chain,
          {.name = "blur x" + std::to_string(blurs), .batch_size = s.batch, .num_workers = workers})
      .with_execution(execution);
}

// A second host: a network namespace with one end of a veth pair. Removed with everything in it.
class OtherHost {
 public:
  static constexpr const char* kHere = "10.231.0.1";
  static constexpr const char* kThere = "10.231.0.2";

  OtherHost() : name_("cohort-bench-" + std::to_string(::getpid())) {
    const std::string veth = "cbh" + std::to_string(::getpid() % 100000);
    for (const std::string& command :
         {"ip netns add " + name_, "ip link add " + veth + "a type veth peer name " + veth + "b",
          "ip link set " + veth + "b netns " + name_,
          "ip addr add " + std::string(kHere) + "/24 dev " + veth + "a",
          "ip link set " + veth + "a up",
          "ip -n " + name_ + " addr add " + kThere + "/24 dev " + veth + "b",
          "ip -n " + name_ + " link set " + veth + "b up", "ip -n " + name_ + " link set lo up"}) {
      if (std::system((command + " 2>&1").c_str()) != 0) {
        cleanup();
        throw std::runtime_error("'" + command + "' failed");
      }
    }
    veth_ = veth + "a";
  }
  ~OtherHost() { cleanup(); }

  // A free port on this side's address, for the trainer to listen on.
  static int free_port() {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    ::inet_pton(AF_INET, kHere, &addr.sin_addr);
    ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
    socklen_t len = sizeof addr;
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    ::close(fd);
    return ntohs(addr.sin_port);
  }

  // This program in the data role inside the namespace, serving `ds` to `address`.
  int start_worker(const data::Dataset& ds, const std::string& address) const {
    auto args = runtime::self_arguments();
    args.front() = runtime::self_executable();
    args.insert(args.begin(), {"ip", "netns", "exec", name_});
    auto env = runtime::child_environment(
        {{"COHORT_DATA_ADDRESS", address}, {"COHORT_DATA_PIPELINE", ds.fingerprint()}},
        std::string(data::kDataRole), false);
    std::vector<char*> argv, envp;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    pid_t pid = -1;
    if (::posix_spawnp(&pid, "ip", nullptr, nullptr, argv.data(), envp.data()) != 0) {
      throw std::runtime_error("could not start ip netns exec");
    }
    return pid;
  }

 private:
  void cleanup() {
    std::system(("for p in $(ip netns pids " + name_ +
                 " 2>/dev/null); do kill -9 $p; done; ip netns del " + name_ +
                 " 2>/dev/null; ip link del " + veth_ + " 2>/dev/null")
                    .c_str());
  }
  std::string name_;
  std::string veth_ = "none";
};

torch::nn::Sequential make_model() {
  return torch::nn::Sequential(
      torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 16, 5).stride(2)), torch::nn::ReLU(),
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
  return static_cast<double>(user + nice + system + irq + softirq + steal) /
         static_cast<double>(::sysconf(_SC_CLK_TCK));
}

struct Figures {
  double steps_per_s = 0;
  double ingest_ms = 0;
  double step_ms = 0;
  double cpus = 0;
  double rss_mb = 0;  // the trainer process's peak
};

// Trains over the pipeline for 1 + s.epochs epochs; the first (start-up, warm-up) is not timed.
Figures train_over(const data::Dataset& ds, const Settings& s) {
  auto model = make_model();
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  auto it = ds.iterator();
  Figures f;
  data::IngestStats before;
  Clock::time_point start;
  double cpu_start = 0;
  int64_t steps = 0;
  for (int epoch = 0; epoch <= s.epochs; ++epoch) {
    if (epoch == 1) {
      before = it.stats();
      start = Clock::now();
      cpu_start = cpu_seconds();
      steps = 0;
    }
    for (auto& batch : it.iter_batches({.batch_size = s.batch, .prefetch_batches = 2})) {
      optimizer.zero_grad();
      auto loss =
          torch::nn::functional::cross_entropy(model->forward(batch["image"]), batch["label"]);
      loss.backward();
      optimizer.step();
      ++steps;
    }
  }
  const double wall = std::chrono::duration<double>(Clock::now() - start).count();
  const auto after = it.stats();
  f.steps_per_s = static_cast<double>(steps) / wall;
  f.step_ms = 1000.0 * wall / static_cast<double>(steps);
  f.ingest_ms = 1000.0 * (after.wait_seconds - before.wait_seconds) /
                static_cast<double>(after.batches - before.batches);
  f.cpus = (cpu_seconds() - cpu_start) / wall;
  f.rss_mb = static_cast<double>(cohort::train::peak_resident_bytes()) / (1 << 20);
  return f;
}

// Batches per second the preprocessing alone delivers with `workers` processes (0: one thread).
double preprocessing_capacity(const data::Dataset& ds, const Settings& s) {
  auto it = ds.iterator();
  Clock::time_point start;
  int64_t batches = 0;
  for (int epoch = 0; epoch <= s.epochs; ++epoch) {
    if (epoch == 1) {
      start = Clock::now();
      batches = 0;
    }
    for (auto& batch : it.iter_batches({.batch_size = s.batch})) batches += batch.num_rows() > 0;
  }
  return static_cast<double>(batches) / std::chrono::duration<double>(Clock::now() - start).count();
}

// Steps per second the trainer alone manages on one ready batch.
double training_capacity(const Settings& s) {
  auto model = make_model();
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  auto images = torch::randn({s.batch, 3, s.size, s.size});
  auto labels = torch::randint(10, {s.batch}, torch::kLong);
  const int steps = 60;
  Clock::time_point start;
  for (int i = 0; i < steps + 5; ++i) {
    if (i == 5) start = Clock::now();
    optimizer.zero_grad();
    torch::nn::functional::cross_entropy(model->forward(images), labels).backward();
    optimizer.step();
  }
  return steps / std::chrono::duration<double>(Clock::now() - start).count();
}

void print_header() {
  std::cout << std::left << std::setw(18) << "config" << std::right << std::setw(10) << "steps/s"
            << std::setw(11) << "step ms" << std::setw(12) << "ingest ms" << std::setw(10)
            << "ingest%" << std::setw(8) << "CPUs" << std::setw(13) << "prep cap/s" << std::setw(13)
            << "vs min(cap)" << std::setw(10) << "RSS MB"
            << "\n";
}

void print_row(const std::string& name, const Figures& f, double prep, double train_rate) {
  std::cout << std::left << std::setw(18) << name << std::right << std::fixed
            << std::setprecision(2) << std::setw(10) << f.steps_per_s << std::setw(11) << f.step_ms
            << std::setw(12) << f.ingest_ms << std::setw(9) << 100.0 * f.ingest_ms / f.step_ms
            << "%" << std::setw(8) << f.cpus << std::setw(13) << prep << std::setw(12)
            << 100.0 * f.steps_per_s / std::min(prep, train_rate) << "%" << std::setw(10)
            << f.rss_mb << "\n";
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Preprocessing offload: trainer throughput and exposed ingest time"};
  Settings s;
  app.add_option("--size", s.size, "image height and width")->capture_default_str();
  app.add_option("--blurs", s.blurs, "GaussianBlur(11) passes per image (heavy case)")
      ->capture_default_str();
  app.add_option("--rows", s.rows, "images per epoch")->capture_default_str();
  app.add_option("--batch", s.batch, "images per step")->capture_default_str();
  app.add_option("--epochs", s.epochs, "timed epochs per configuration, after an untimed one")
      ->capture_default_str();
  bool netns = true;
  app.add_flag("!--no-netns", netns, "skip the table with a worker in another network namespace");
  CLI11_PARSE(app, argc, argv);
  // The trainer computes on one CPU, as one rank of a group would; the rest is for preprocessing.
  torch::set_num_threads(1);

  // A preprocessing worker is this program again: it builds the pipelines and serves its own.
  if (runtime::spawned_role() == data::kDataRole) {
    for (int blurs : {s.blurs, 0}) {
      for (int64_t rows : {s.rows, 4 * s.rows})
        data::serve_if_data_worker(pipeline(s, blurs, rows, 1));
    }
    return 2;
  }
  if (netns && ::geteuid() != 0) {
    std::cout << "(not root: the table with a worker in another network namespace is skipped)\n";
    netns = false;
  }

  std::cout << "images " << s.size << "x" << s.size << "x3, batch " << s.batch << ", " << s.rows
            << " images per epoch, " << s.epochs << " timed epochs, "
            << std::thread::hardware_concurrency() << " CPUs; trainer: small CNN, 1 thread\n";
  const double train_rate = training_capacity(s);
  std::cout << "training capacity alone: " << std::fixed << std::setprecision(2) << train_rate
            << " steps/s\n";
  for (int blurs : {s.blurs, 0}) {
    std::cout << "\n== "
              << (blurs > 0 ? std::to_string(blurs) + " blur passes and normalisation"
                            : std::string("normalisation only"))
              << " per image ==\n";
    print_header();
    for (int workers : {0, 1, 2}) {
      const double prep = preprocessing_capacity(pipeline(s, blurs, s.rows, workers), s);
      const auto f = train_over(pipeline(s, blurs, s.rows, workers), s);
      print_row(
          workers == 0 ? "inline" : std::to_string(workers) + " worker" + (workers > 1 ? "s" : ""),
          f, prep, train_rate);
    }
  }
  if (netns) {
    // The heavy pipeline again, its worker on the other host (TCP), alone and beside a local one.
    OtherHost other;
    std::cout << "\n== " << s.blurs
              << " blur passes and normalisation, a worker on another host (network namespace, "
              << OtherHost::kThere << " -> " << OtherHost::kHere << ", TCP) ==\n";
    print_header();
    for (int local : {0, 1}) {
      auto run = [&](auto&& measure) {
        const std::string address =
            std::string(OtherHost::kHere) + ":" + std::to_string(OtherHost::free_port());
        auto ds = pipeline(s, s.blurs, s.rows, local,
                           {.listen_address = address,
                            .remote_workers = 1,
                            .worker_start_timeout = std::chrono::seconds(60)});
        const int pid = other.start_worker(ds, address);
        auto result = measure(ds);
        int status = 0;
        ::waitpid(pid, &status, 0);  // it stops when its consumer is done
        return result;
      };
      const double prep =
          run([&](const data::Dataset& ds) { return preprocessing_capacity(ds, s); });
      const auto f = run([&](const data::Dataset& ds) { return train_over(ds, s); });
      print_row(local == 0 ? "1 remote" : "1 local+1 remote", f, prep, train_rate);
    }
  }
  // Bounded memory: the trainer's peak with 4x the images (offloaded to 2 workers).
  const auto longer = train_over(pipeline(s, s.blurs, 4 * s.rows, 2), s);
  std::cout << "\npeak trainer RSS with " << 4 * s.rows
            << " images per epoch, 2 workers: " << longer.rss_mb
            << " MB (the table's runs above: " << s.rows << " images)\n";
  return 0;
}

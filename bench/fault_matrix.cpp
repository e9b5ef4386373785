// Fault matrix (issue 5): runs each fault kind N times on a 2-worker data-parallel regression
// that checkpoints every K steps, with max_failures = 1, and prints per kind: runs, recovered,
// median and worst time to detect, median time to recover, steps lost (redone after the
// restart). The fault hits a random rank at a random step (seeded).
//   kill          SIGKILL right after a report
//   throw         an exception in the loop
//   hang          SIGSTOP (found by the missing heartbeats)
//   commit_crash  SIGKILL just before a report, while the others commit a checkpoint
#include <fcntl.h>
#include <torch/torch.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <random>

#include "cohort/cohort.h"

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Once per run: leaves the time of the injection in the run directory.
bool inject_now() {
  const auto marker = cohort::train::get_context().get_storage_path() / "injected_at";
  const int fd = ::open(marker.c_str(), O_CREAT | O_EXCL | O_WRONLY, 0644);
  if (fd < 0) return false;
  const std::string when = std::to_string(now_s());
  [[maybe_unused]] auto n = ::write(fd, when.data(), when.size());
  ::fsync(fd);
  ::close(fd);
  return true;
}

void loop(const cohort::Json& c) {
  auto& ctx = cohort::train::get_context();
  torch::manual_seed(7);
  auto model = torch::nn::Linear(16, 1);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  int start = 0;
  if (auto checkpoint = cohort::train::get_checkpoint()) {
    cohort::train::load_checkpoint(*checkpoint, *model, optimizer);
    start = checkpoint->metrics()["step"].get<int>() + 1;
  }
  cohort::train::prepare_model(model.ptr());
  const std::string fault = c["fault"];
  const bool mine = ctx.get_world_rank() == c["fault_rank"].get<int>();
  const int every = c["checkpoint_every"].get<int>();
  for (int step = start; step < c["steps"].get<int>(); ++step) {
    auto g = torch::make_generator<at::CPUGeneratorImpl>(1000 * step + ctx.get_world_rank());
    auto x = torch::randn({32, 16}, g);
    optimizer.zero_grad();
    torch::mse_loss(model->forward(x), x.sum(1, true)).backward();
    optimizer.step();
    const bool at_fault = mine && step == c["fault_step"].get<int>();
    if (at_fault && fault == "commit_crash" && inject_now()) std::raise(SIGKILL);
    if (at_fault && fault == "throw" && inject_now()) throw std::runtime_error("injected failure");
    std::optional<cohort::Checkpoint> checkpoint;
    const auto tmp =
        std::filesystem::temp_directory_path() / ("cohort-fm-" + std::to_string(::getpid()));
    if (ctx.get_world_rank() == 0 && step % every == every - 1) {
      checkpoint = cohort::train::save_checkpoint(tmp, *model, optimizer);
    }
    cohort::train::report({{"step", step}, {"resumed_at", start}}, checkpoint);
    std::filesystem::remove_all(tmp);
    if (at_fault && fault == "kill" && inject_now()) std::raise(SIGKILL);
    if (at_fault && fault == "hang" && inject_now()) std::raise(SIGSTOP);
  }
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"cohort fault matrix"};
  int runs = 5, steps = 12, every = 2;
  double heartbeat_s = 3;
  uint64_t seed = 1;
  std::vector<std::string> kinds{"kill", "throw", "hang", "commit_crash"};
  app.add_option("--runs", runs, "runs per fault kind");
  app.add_option("--steps", steps);
  app.add_option("--checkpoint-every", every);
  app.add_option("--heartbeat-timeout", heartbeat_s, "seconds");
  app.add_option("--seed", seed);
  app.add_option("--kinds", kinds);
  CLI11_PARSE(app, argc, argv);
  // Workers re-execute this program: they go straight to the loop (with the config their
  // driver passed), never through the bookkeeping below.
  if (cohort::runtime::is_spawned_worker()) cohort::Trainer(loop).fit();
  const std::string root = "/tmp/cohort_fault_matrix";
  std::mt19937_64 rng(seed);
  std::printf("%-13s %5s %9s %13s %12s %13s %10s %9s\n", "fault", "runs", "recovered",
              "detect_med_s", "detect_max_s", "recover_med_s", "lost_med", "lost_max");
  for (const auto& kind : kinds) {
    std::vector<double> detect, recover, lost;
    int recovered = 0;
    for (int r = 0; r < runs; ++r) {
      const int rank = static_cast<int>(rng() % 2);
      const int step = 1 + static_cast<int>(rng() % static_cast<uint64_t>(steps - 3));
      const std::string name = kind + "_" + std::to_string(r);
      std::filesystem::remove_all(std::filesystem::path(root) / name);
      cohort::Trainer trainer(loop, {.num_workers = 2},
                              {.name = name,
                               .storage_path = root,
                               .failure_config = {.max_failures = 1,
                                                  .heartbeat_timeout = std::chrono::milliseconds(
                                                      static_cast<int64_t>(heartbeat_s * 1000))},
                               .verbose = 0},
                              {{"fault", kind},
                               {"fault_rank", rank},
                               {"fault_step", step},
                               {"steps", steps},
                               {"checkpoint_every", every}});
      const double started = now_s();
      const auto result = trainer.fit();
      if (!result.ok() || result.failures.size() != 1) continue;
      ++recovered;
      std::ifstream marker(std::filesystem::path(root) / name / "injected_at");
      double injected = 0;
      marker >> injected;
      detect.push_back(started + result.failures[0]["detected_at_s"].get<double>() - injected);
      recover.push_back(result.failures[0]["recovery_s"].get<double>());
      // Steps done before the fault (through `step`) that the restart had to do again.
      lost.push_back(step + 1 - result.metrics["resumed_at"].get<double>());
    }
    std::printf("%-13s %5d %9d %13.2f %12.2f %13.2f %10.0f %9.0f\n", kind.c_str(), runs, recovered,
                median(detect),
                detect.empty() ? 0.0 : *std::max_element(detect.begin(), detect.end()),
                median(recover), median(lost),
                lost.empty() ? 0.0 : *std::max_element(lost.begin(), lost.end()));
  }
  return 0;
}

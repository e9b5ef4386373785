// Checkpoint save and load speed for the ResNet-18 state (weights as safetensors, Adam state),
// against a plain copy of the same bytes. Runs the real path: a worker saves and reports the
// checkpoint (copied into the run directory, manifest with CRC-32, renamed), then it is verified
// and loaded back. Prints one JSON line.
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <iostream>
#include <system_error>

#include "cohort/cohort.h"
#include "cohort/models/zoo.h"

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

uintmax_t folder_bytes(const std::filesystem::path& dir) {
  uintmax_t total = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (e.is_regular_file()) total += e.file_size();
  }
  return total;
}

void bench_loop(const cohort::Json& config) {
  auto model = cohort::models::create_model("resnet18");
  torch::optim::Adam optimizer(model->parameters());
  optimizer.zero_grad();
  model->forward(torch::randn({2, 1, 28, 28})).sum().backward();
  optimizer.step();  // Adam now holds its moment estimates
  const int rounds = config["rounds"].get<int>();
  const auto scratch =
      std::filesystem::temp_directory_path() / ("cohort-ckpt-bench-" + std::to_string(::getpid()));
  double save = 0, report = 0, verify = 0, load = 0, copy = 0;
  uintmax_t bytes = 0;
  for (int r = 0; r < rounds; ++r) {
    auto start = Clock::now();
    const auto checkpoint = cohort::train::save_checkpoint(scratch, *model, optimizer);
    save += seconds_since(start);
    bytes = folder_bytes(scratch);

    start = Clock::now();
    for (const auto& name : {"model.safetensors", "optimizer.pt"}) {
      std::filesystem::copy_file(scratch / name, scratch / (std::string(name) + ".copy"));
    }
    copy += seconds_since(start);
    for (const auto& name : {"model.safetensors", "optimizer.pt"})
      std::filesystem::remove(scratch / (std::string(name) + ".copy"));

    start = Clock::now();
    cohort::train::report({{"round", r}}, checkpoint);
    report += seconds_since(start);
    std::filesystem::remove_all(scratch);
  }
  // The run's latest checkpoint, as a resuming worker would find it.
  std::filesystem::path newest;
  for (const auto& e :
       std::filesystem::directory_iterator(cohort::train::get_context().get_storage_path())) {
    if (e.path().filename().string().rfind("checkpoint_0", 0) == 0 && e.path() > newest)
      newest = e.path();
  }
  for (int r = 0; r < rounds; ++r) {
    auto start = Clock::now();
    cohort::Checkpoint::from_directory(newest).verify();
    verify += seconds_since(start);
    start = Clock::now();
    cohort::train::load_checkpoint(cohort::Checkpoint::from_directory(newest), *model, optimizer);
    load += seconds_since(start);
  }
  const double mb = static_cast<double>(bytes) / 1e6;
  std::cout << cohort::Json{{"state_mb", mb},
                            {"save_mb_per_s", mb * rounds / save},
                            {"persist_mb_per_s", mb * rounds / report},
                            {"verify_mb_per_s", mb * rounds / verify},
                            {"load_mb_per_s", mb * rounds / load},
                            {"plain_copy_mb_per_s", mb * rounds / copy},
                            {"save_vs_copy", (mb * rounds / save) / (mb * rounds / copy)},
                            {"load_vs_copy", (mb * rounds / load) / (mb * rounds / copy)}}
                   .dump()
            << std::endl;
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 5;
  cohort::Trainer trainer(
      bench_loop, {.num_workers = 1},
      {.name = "checkpoint_speed", .storage_path = "/tmp/cohort_bench", .resume = false},
      {{"rounds", rounds}});
  auto result = trainer.fit();
  // The figures are printed; the run's checkpoints of ResNet-18 are not kept.
  std::error_code ignored;
  std::filesystem::remove_all("/tmp/cohort_bench/checkpoint_speed", ignored);
  std::filesystem::remove("/tmp/cohort_bench", ignored);  // when nothing else is in it
  if (!result.ok()) {
    std::cerr << "error: " << *result.error << std::endl;
    return 1;
  }
  return 0;
}

// A data-parallel regression for the external launchers (mpirun, torchrun-style variables,
// cohort launch), with one fault injected in rank 1: the launched fault tests and
// bench/launched_hang.sh run it.
//   launched_fault_program FAULT STORAGE_PATH [HEARTBEAT_TIMEOUT_S]
//   FAULT: none | kill (SIGKILL after step 2) | throw (at step 2) | stop (SIGSTOP after step 2)
//          | never_join (SIGSTOP before the rendezvous)
// Writes STORAGE_PATH/<FAULT>/injected_at (seconds since the epoch) when it injects; prints
// "result: ok" or "result: <error>" on rank 0 and exits 0 or 1.
#include <fcntl.h>
#include <torch/torch.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <iostream>

#include "cohort/cohort.h"

namespace {

void mark_injection() {
  const auto marker = cohort::train::get_context().get_storage_path() / "injected_at";
  const int fd = ::open(marker.c_str(), O_CREAT | O_TRUNC | O_WRONLY, 0644);
  if (fd < 0) return;
  const std::string when = std::to_string(
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count());
  [[maybe_unused]] auto n = ::write(fd, when.data(), when.size());
  ::fsync(fd);
  ::close(fd);
}

void loop(const cohort::Json& c) {
  auto& ctx = cohort::train::get_context();
  torch::manual_seed(7);
  auto model = torch::nn::Linear(4, 1);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.05));
  cohort::train::prepare_model(model.ptr());
  const std::string fault = c["fault"];
  const bool mine = ctx.get_world_rank() == 1;
  for (int step = 0; step < 6; ++step) {
    auto g = torch::make_generator<at::CPUGeneratorImpl>(1000 * step + ctx.get_world_rank());
    auto x = torch::randn({8, 4}, g);
    optimizer.zero_grad();
    torch::mse_loss(model->forward(x), x.sum(1, true)).backward();
    optimizer.step();
    if (mine && step == 2 && fault == "throw") {
      mark_injection();
      throw std::runtime_error("injected failure");
    }
    cohort::train::report({{"step", step}});
    if (mine && step == 2 && (fault == "kill" || fault == "stop")) {
      mark_injection();
      std::raise(fault == "kill" ? SIGKILL : SIGSTOP);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: launched_fault_program FAULT STORAGE_PATH [HEARTBEAT_TIMEOUT_S]\n";
    return 2;
  }
  const std::string fault = argv[1];
  const double heartbeat_s = argc > 3 ? std::atof(argv[3]) : 3.0;
  const auto launch = cohort::runtime::detect_launch();
  if (!launch) {
    std::cerr
        << "launched_fault_program: run it under a launcher (mpirun, cohort launch, RANK...)\n";
    return 2;
  }
  if (fault == "never_join" && launch->world_rank == 1) {
    std::filesystem::create_directories(std::filesystem::path(argv[2]) / fault);
    std::raise(SIGSTOP);
  }
  cohort::Trainer trainer(
      loop, cohort::ScalingConfig{.num_workers = launch->world_size},
      cohort::RunConfig{.name = fault,
                        .storage_path = argv[2],
                        .failure_config = {.heartbeat_timeout = std::chrono::milliseconds(
                                               static_cast<int64_t>(heartbeat_s * 1000))},
                        .resume = false,
                        .verbose = 0,
                        .setup_timeout = std::chrono::seconds(5),
                        .collective_timeout = std::chrono::seconds(120)},
      cohort::Json{{"fault", fault}});
  try {
    const auto result = trainer.fit();
    std::cout << "result: " << (result.ok() ? "ok" : *result.error) << std::endl;
    return result.ok() ? 0 : 1;
  } catch (const std::exception& e) {  // e.g. the rendezvous deadline, before the run begins
    std::cout << "result: " << e.what() << std::endl;
    return 1;
  }
}

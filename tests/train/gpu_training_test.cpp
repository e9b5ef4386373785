// Training on GPUs: placement, DDP over NCCL, batches on the device and checkpoints of CUDA
// tensors (skipped without a GPU), and the refusals a host without one gives.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>

#include "cohort/cohort.h"
#include "support/cuda.h"
#include "support/expect.h"
#include "support/run_config.h"
#include "support/tiny_mnist.h"

namespace cohort {
namespace {

using cohort::testing::expect_error;

using cohort::testing::quiet_run;

TEST(GpuTraining, BadGpuRequestsAreRefusedBeforeAnyWorkerStarts) {
  auto loop = [](const Json&) {};
  expect_error<UsageError>([&] { Trainer(loop, ScalingConfig{.backend = "mpi"}); },
                           "unknown communication backend 'mpi'");
  expect_error<UsageError>(
      [&] { Trainer(loop, ScalingConfig{.resources_per_worker = {.gpus = 1}}); },
      "gpus = 1 without use_gpu");
  expect_error<UsageError>(
      [&] { Trainer(loop, ScalingConfig{.use_gpu = true, .resources_per_worker = {.gpus = -2}}); },
      "gpus = -2 is negative");
  auto dir = cohort::testing::temp_dir("gpu_refusals");
  const std::string fragment =
      torch::cuda::is_available() ? "GPUs, but this node has" : "sees no CUDA device";
  const auto start = std::chrono::steady_clock::now();
  expect_error<UsageError>(
      [&] {
        Trainer(loop, ScalingConfig{.num_workers = 1024, .use_gpu = true},
                quiet_run(dir, "refused"))
            .fit();
      },
      fragment);
  // Refused in the driver, before 1024 workers could have been started.
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  EXPECT_FALSE(std::filesystem::exists(dir / "refused" / "logs" / "rank-0.log"));
  std::filesystem::remove_all(dir);
}

TEST(GpuTraining, AWorkerTrainsOnItsGpuAndCheckpointsLoadOnTheCpu) {
  COHORT_REQUIRE_CUDA();
  auto dir = cohort::testing::temp_dir("gpu_training");
  Trainer trainer(
      [](const Json&) {
        auto& ctx = train::get_context();
        if (!ctx.get_device().is_cuda()) throw RuntimeError("device is " + ctx.get_device().str());
        torch::manual_seed(0);
        auto model = train::prepare_model(std::make_shared<torch::nn::LinearImpl>(8, 2));
        for (const auto& p : model->parameters()) {
          if (!p.is_cuda()) throw RuntimeError("a parameter is on " + p.device().str());
        }
        auto inputs = torch::randn({256, 8});
        auto targets = (inputs.sum(1) > 0).to(torch::kLong);
        auto loader =
            train::prepare_data_loader({inputs, targets}, {.batch_size = 32, .shuffle = true});
        torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-2));
        double first = -1, last = 0;
        for (int epoch = 0; epoch < 5; ++epoch) {
          loader.set_epoch(epoch);
          for (auto& batch : loader) {
            if (!batch.data.is_cuda())
              throw RuntimeError("a batch arrived on " + batch.data.device().str());
            optimizer.zero_grad();
            auto loss =
                torch::nn::functional::cross_entropy(model->forward(batch.data), batch.target);
            loss.backward();
            optimizer.step();
            last = loss.item<double>();
            if (first < 0) first = last;
          }
        }
        // A checkpoint of CUDA tensors: the same files as a CPU run, loadable by a CPU model.
        const auto saved = ctx.get_storage_path() / "gpu_checkpoint";
        train::save_checkpoint(saved, *model, optimizer);
        auto cpu_model = std::make_shared<torch::nn::LinearImpl>(8, 2);
        torch::optim::Adam cpu_optimizer(cpu_model->parameters(), torch::optim::AdamOptions(1e-2));
        train::load_checkpoint(Checkpoint::from_directory(saved), *cpu_model, cpu_optimizer);
        const bool same = torch::equal(cpu_model->weight, model->weight.cpu());
        train::report(
            {{"first", first}, {"last", last}, {"same", same}, {"device", ctx.get_device().str()}});
      },
      ScalingConfig{.num_workers = 1, .use_gpu = true}, quiet_run(dir, "gpu"));
  Result result = trainer.fit();
  ASSERT_TRUE(result.ok()) << *result.error;
  EXPECT_EQ(result.metrics["device"], "cuda:0");
  EXPECT_TRUE(result.metrics["same"].get<bool>());
  EXPECT_LT(result.metrics["last"].get<double>(), result.metrics["first"].get<double>());
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace cohort

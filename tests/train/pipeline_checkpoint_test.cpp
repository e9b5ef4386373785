// Checkpoints of pipeline stages: into the unsplit model, back into stages of another cut, and
// into the same cut bit for bit.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <mutex>

#include "cohort/parallel/pipeline/pipeline.h"
#include "cohort/train/checkpoint.h"
#include "support/local_group.h"
#include "support/tiny_mnist.h"

namespace cohort::train {
namespace {

namespace pipeline = parallel::pipeline;
using cohort::testing::generator_mutex;

torch::nn::Sequential make_mlp() {
  std::lock_guard lock(generator_mutex());
  torch::manual_seed(31);
  return torch::nn::Sequential(
      torch::nn::Linear(6, 12), torch::nn::ReLU(), torch::nn::Linear(12, 12),
      torch::nn::LayerNorm(torch::nn::LayerNormOptions({12})), torch::nn::Linear(12, 3));
}

at::Tensor cross_entropy(const at::Tensor& output, const at::Tensor& target) {
  return torch::nn::functional::cross_entropy(output, target);
}

TEST(PipelineCheckpoint, StagesLoadIntoTheWholeModelAndBackIntoAnotherCut) {
  const auto root = cohort::testing::temp_dir("pipeline_checkpoint");
  std::mutex mutex;
  std::map<std::string, at::Tensor> trained;
  // Two stages ({3, 2} layers) train two steps, then each rank saves its stage.
  cohort::testing::run_ranks(2, [&](comm::ProcessGroup& group) {
    auto stages = pipeline::split_sequential(make_mlp(), {3, 2});
    torch::nn::Sequential mine = stages[group.rank()];
    torch::optim::SGD sgd(mine->parameters(), 0.5);
    pipeline::Pipeline pipe({mine}, group, cross_entropy, {.micro_batches = 2});
    for (int step = 0; step < 2; ++step) {
      const auto [x, y] = [&] {
        std::lock_guard lock(generator_mutex());
        torch::manual_seed(40 + step);
        return std::pair{torch::randn({8, 6}), torch::randint(0, 3, {8})};
      }();
      sgd.zero_grad();
      pipe.step(x, y);
      sgd.step();
    }
    save_pipeline_stages(root / "stages", pipe);
    std::lock_guard lock(mutex);
    for (const auto& p : mine->named_parameters()) trained[p.key()] = p.value().detach().clone();
  });
  EXPECT_TRUE(std::filesystem::exists(root / "stages" / "stage-0.safetensors"));
  EXPECT_TRUE(std::filesystem::exists(root / "stages" / "stage-1.safetensors"));

  // Into the unsplit model.
  torch::nn::Sequential whole = make_mlp();
  load_by_name(*whole, root / "stages");
  for (const auto& p : whole->named_parameters())
    EXPECT_TRUE(torch::equal(p.value(), trained.at(p.key()))) << p.key();

  // Back, from the whole model's file, into stages of another cut ({1, 4}).
  std::filesystem::create_directories(root / "whole");
  save_model(*whole, root / "whole" / "model.safetensors");
  for (auto stage : pipeline::split_sequential(make_mlp(), {1, 4})) {
    load_by_name(*stage, root / "whole");
    for (const auto& p : stage->named_parameters())
      EXPECT_TRUE(torch::equal(p.value(), trained.at(p.key()))) << p.key();
  }
  // The same cut, from the stage files: bit for bit.
  for (auto stage : pipeline::split_sequential(make_mlp(), {3, 2})) {
    load_by_name(*stage, root / "stages");
    for (const auto& p : stage->named_parameters())
      EXPECT_TRUE(torch::equal(p.value(), trained.at(p.key()))) << p.key();
  }

  // A model the files do not fit: named.
  torch::nn::Sequential wider(torch::nn::Linear(6, 16));
  try {
    load_by_name(*wider, root / "stages");
    ADD_FAILURE() << "no error";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("'0.weight'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("[16, 6] Float"), std::string::npos) << e.what();
  }
  EXPECT_THROW(load_by_name(*whole, root / "missing"), UsageError);
  std::filesystem::remove_all(root);
}

}  // namespace
}  // namespace cohort::train

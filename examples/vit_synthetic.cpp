// Seed 003 (Ray Data load balancing): synthetic RGB images and labels, a chain of Gaussian blurs
// as heavy preprocessing, and a small Vision Transformer trained data-parallel. The blurs run in
// preprocessing processes (by default one per CPU the trainers leave free, or on the CPU-only
// nodes of a `cohort launch` job), so the trainers get ready batches; each report carries
// ingest_wait_ms, how long the trainers waited for data per step.
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <iostream>

#include "cohort/cohort.h"
#include "cohort/models/zoo.h"

namespace {

struct Settings {
  int workers = 2;
  int epochs = 2;
  int64_t rows = 1024;
  int64_t size = 64;
  int blurs = 10;
  int64_t batch_size = 32;
  int data_workers = -1;
};

// The dataset: built the same way in every process (trainers and preprocessing workers).
cohort::data::Dataset synthetic_blurred_images(const Settings& s) {
  cohort::data::Chain chain;
  for (int i = 0; i < s.blurs; ++i)
    chain.steps.push_back(cohort::data::GaussianBlur{.kernel_size = 11});
  chain.steps.push_back(
      cohort::data::Normalize{.mean = {0.5, 0.5, 0.5}, .std = {0.25, 0.25, 0.25}});
  return cohort::data::Dataset::synthetic_images(
             s.rows, {.height = s.size, .width = s.size, .channels = 3, .seed = 3})
      .random_shuffle(7)
      .map_batches(chain, {.name = "gaussian blur x" + std::to_string(s.blurs),
                           .batch_size = s.batch_size,
                           .num_workers = s.data_workers});
}

void train_loop(const cohort::Json& config) {
  auto& ctx = cohort::train::get_context();
  const int64_t size = config["size"];
  auto model = cohort::models::create_model("vit", {.in_channels = 3,
                                                    .image_size = size,
                                                    .patch_size = size / 8,
                                                    .depth = 2,
                                                    .width = 64,
                                                    .heads = 4});
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-3));
  cohort::train::prepare_model(model);
  auto shard = cohort::train::get_dataset_shard("train");
  for (int epoch = 0; epoch < config["epochs"].get<int>(); ++epoch) {
    shard.set_epoch(epoch);
    double loss_sum = 0;
    int64_t steps = 0;
    const auto start = std::chrono::steady_clock::now();
    for (auto& batch :
         shard.iter_batches({.batch_size = config["batch_size"], .device = ctx.get_device()})) {
      auto loss =
          torch::nn::functional::cross_entropy(model->forward(batch["image"]), batch["label"]);
      optimizer.zero_grad();
      loss.backward();
      optimizer.step();
      loss_sum += loss.item<double>();
      ++steps;
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    cohort::train::report({{"epoch", epoch + 1},
                           {"loss", loss_sum / static_cast<double>(std::max<int64_t>(steps, 1))},
                           {"steps_per_second", static_cast<double>(steps) / seconds}});
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Seed 003: a ViT on synthetic images behind a chain of Gaussian blurs"};
  Settings s;
  app.add_option("--workers", s.workers, "trainers")->capture_default_str();
  app.add_option("--epochs", s.epochs)->capture_default_str();
  app.add_option("--rows", s.rows, "images per epoch")->capture_default_str();
  app.add_option("--size", s.size, "image height and width (a multiple of 8)")
      ->capture_default_str();
  app.add_option("--blurs", s.blurs, "GaussianBlur(11) passes per image")->capture_default_str();
  app.add_option("--batch-size", s.batch_size, "per trainer")->capture_default_str();
  app.add_option(
         "--data-workers", s.data_workers,
         "preprocessing processes per trainer (0: inline; -1: the CPUs the trainers leave free)")
      ->capture_default_str();
  std::string storage = "./cohort_results";
  app.add_option("--storage-path", storage)->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (s.size % 8 != 0) {
    std::cerr << "error: --size " << s.size << " must be a multiple of 8 (the ViT cuts 8x8 patches)"
              << std::endl;
    return 2;
  }
  cohort::Trainer trainer(train_loop, {.num_workers = s.workers},
                          {.name = "vit_synthetic", .storage_path = storage, .resume = false},
                          {{"epochs", s.epochs}, {"size", s.size}, {"batch_size", s.batch_size}},
                          {{"train", synthetic_blurred_images(s)}});
  cohort::Result result = trainer.fit();
  if (!result.ok()) {
    std::cerr << "error: " << *result.error << std::endl;
    return 1;
  }
  std::cout << "epoch " << result.metrics["epoch"] << " | loss " << result.metrics["loss"]
            << " | steps/s per trainer " << result.metrics["steps_per_second"]
            << " | ingest_wait_ms " << result.metrics["ingest_wait_ms"] << std::endl;
  return 0;
}

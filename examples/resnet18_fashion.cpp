// Seed 002 (the Ray Train chapter): ResNet-18 with a 1-channel 7x7 stride-2 stem on
// Fashion-MNIST, Adam 1e-3, batch 128 per worker, a checkpoint and the test accuracy reported
// after every epoch. Run it again with the same --storage-path to resume from the latest epoch.
#include <torch/torch.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <iostream>

#include "cohort/cohort.h"
#include "cohort/models/zoo.h"

double test_func(cohort::models::ZooModelImpl& model, cohort::data::DataLoader& loader) {
  model.eval();
  torch::NoGradGuard no_grad;
  double correct = 0, total = 0;
  for (auto& batch : loader) {
    correct += model.forward(batch.data).argmax(1).eq(batch.target).sum().item<double>();
    total += static_cast<double>(batch.target.size(0));
  }
  model.train();
  std::vector<at::Tensor> counts{torch::tensor({correct, total}, torch::kDouble)};
  cohort::train::get_context().get_process_group().allreduce(counts);
  return (counts[0][0] / counts[0][1]).item<double>();
}

void train_loop(const cohort::Json& config) {
  auto& ctx = cohort::train::get_context();
  const std::string dir = config["data_dir"];
  // Seed 002 normalises with (0.5, 0.5).
  const cohort::data::MnistOptions normalise{.mean = 0.5, .std = 0.5};
  auto train_loader = cohort::train::prepare_data_loader(
      cohort::data::load_mnist(dir, cohort::data::Split::kTrain, normalise),
      {.batch_size = config["batch_size"].get<int64_t>(), .shuffle = true});
  auto test_loader = cohort::train::prepare_data_loader(
      cohort::data::load_mnist(dir, cohort::data::Split::kTest, normalise),
      {.batch_size = 500, .shuffle = false, .equal_shards = false});
  auto model = cohort::models::create_model("resnet18");
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-3));
  int start_epoch = 0;
  if (auto checkpoint = cohort::train::get_checkpoint()) {
    cohort::train::load_checkpoint(*checkpoint, *model, optimizer);
    start_epoch = checkpoint->metrics()["epoch"].get<int>() + 1;
  }
  cohort::train::prepare_model(model);
  const int64_t max_steps = config["max_steps"].get<int64_t>();
  for (int epoch = start_epoch; epoch < config["epochs"].get<int>(); ++epoch) {
    train_loader.set_epoch(epoch);
    int64_t step = 0;
    for (auto& batch : train_loader) {
      auto loss = torch::nn::functional::cross_entropy(model->forward(batch.data), batch.target);
      optimizer.zero_grad();
      loss.backward();
      optimizer.step();
      cohort::train::report_progress({{"label", "epoch " + std::to_string(epoch)},
                                      {"step", ++step},
                                      {"total", train_loader.num_batches()},
                                      {"loss", loss.item<double>()}});
      if (max_steps > 0 && step >= max_steps) break;
    }
    const double acc = test_func(*model, test_loader);
    cohort::Json metrics{{"acc", acc}, {"epoch", epoch}};
    // Rank 0 writes the checkpoint; every rank reports.
    if (ctx.get_world_rank() == 0) {
      const auto tmp =
          std::filesystem::temp_directory_path() / ("resnet18-" + std::to_string(::getpid()));
      cohort::train::report(metrics, cohort::train::save_checkpoint(tmp, *model, optimizer));
      std::filesystem::remove_all(tmp);
      std::cout << metrics.dump() << std::endl;
    } else {
      cohort::train::report(metrics);
    }
  }
}

int main(int argc, char** argv) {
  CLI::App app{"Seed 002: ResNet-18 on Fashion-MNIST with checkpoints"};
  int workers = 2, epochs = 10, threads = 1;
  int64_t batch_size = 128, max_steps = 0;
  std::string data_dir = cohort::data::default_fashion_mnist_dir(), storage = "./cohort_results";
  app.add_option("--workers", workers);
  app.add_option("--threads", threads, "CPU threads per worker");
  app.add_option("--epochs", epochs);
  app.add_option("--batch-size", batch_size);
  app.add_option("--max-steps", max_steps, "steps per epoch (0: all)");
  app.add_option("--data-dir", data_dir);
  app.add_option("--storage-path", storage);
  CLI11_PARSE(app, argc, argv);
  cohort::Trainer trainer(
      train_loop, {.num_workers = workers, .resources_per_worker = {.cpu_threads = threads}},
      {.name = "exp_fashionmnist_resnet18",
       .storage_path = storage,
       .checkpoint_config = {.num_to_keep = 2, .checkpoint_score_attribute = "acc"}},
      {{"batch_size", batch_size},
       {"epochs", epochs},
       {"max_steps", max_steps},
       {"data_dir", data_dir}});
  cohort::Result result = trainer.fit();
  if (!result.ok()) {
    std::cerr << "error: " << *result.error << std::endl;
    return 1;
  }
  std::cout << "acc " << result.metrics["acc"] << " after epoch " << result.metrics["epoch"] << ", "
            << result.wall_seconds << " s; best checkpoint "
            << (result.best_checkpoints.empty()
                    ? "none"
                    : result.best_checkpoints.front().first.path().string())
            << std::endl;
  return 0;
}

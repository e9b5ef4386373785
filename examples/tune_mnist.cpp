// Seed 001's Ray Tune step, `tune.run(train, config={"lr": tune.loguniform(1e-4, 1e-1)})`: a
// function trainable (an MLP on Fashion-MNIST) searched over a log-uniform learning rate, with
// ASHA stopping the poor trials early and the status table of seed 002.
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <iostream>

#include "cohort/cohort.h"

void your_training_routine(const cohort::Json& config) {
  torch::manual_seed(0);
  auto model = torch::nn::Sequential(torch::nn::Flatten(), torch::nn::Linear(784, 128),
                                     torch::nn::ReLU(), torch::nn::Linear(128, 10));
  torch::optim::SGD optimizer(model->parameters(),
                              torch::optim::SGDOptions(config["lr"].get<double>()).momentum(0.9));
  const std::string dir = config["data_dir"];
  auto train_set = cohort::data::load_mnist(dir, cohort::data::Split::kTrain);
  const int64_t n = std::min<int64_t>(config["train_examples"].get<int64_t>(), train_set.size());
  train_set.inputs = train_set.inputs.narrow(0, 0, n);
  train_set.targets = train_set.targets.narrow(0, 0, n);
  auto train_loader =
      cohort::train::prepare_data_loader(train_set, {.batch_size = 64, .shuffle = true});
  auto test_loader =
      cohort::train::prepare_data_loader(cohort::data::load_mnist(dir, cohort::data::Split::kTest),
                                         {.batch_size = 1000, .shuffle = false});
  for (int epoch = 0; epoch < config["epochs"].get<int>(); ++epoch) {
    train_loader.set_epoch(epoch);
    for (auto& batch : train_loader) {
      optimizer.zero_grad();
      torch::nn::functional::cross_entropy(model->forward(batch.data), batch.target).backward();
      optimizer.step();
    }
    torch::NoGradGuard no_grad;
    double correct = 0, total = 0;
    for (auto& batch : test_loader) {
      correct += model->forward(batch.data).argmax(1).eq(batch.target).sum().item<double>();
      total += static_cast<double>(batch.target.size(0));
    }
    cohort::train::report({{"epoch", epoch + 1}, {"accuracy", correct / total}});
  }
}

int main(int argc, char** argv) {
  CLI::App app{"Seed 001: Ray Tune's tune.run over a log-uniform learning rate, in C++"};
  int samples = 6, epochs = 3, concurrent = 2;
  int64_t train_examples = 10000;
  std::string data_dir = cohort::data::default_fashion_mnist_dir();
  std::string storage = "./cohort_results";
  app.add_option("--samples", samples);
  app.add_option("--epochs", epochs);
  app.add_option("--train-examples", train_examples);
  app.add_option("--max-concurrent", concurrent);
  app.add_option("--data-dir", data_dir);
  app.add_option("--storage-path", storage);
  CLI11_PARSE(app, argc, argv);
  using namespace cohort;
  tune::Tuner tuner(
      your_training_routine,
      Json{{"lr", tune::loguniform(1e-4, 1e-1)},
           {"epochs", epochs},
           {"train_examples", train_examples},
           {"data_dir", data_dir}},
      tune::TuneConfig{.metric = "accuracy",
                       .mode = "max",
                       .num_samples = samples,
                       .max_concurrent_trials = concurrent,
                       .scheduler = std::make_shared<tune::ASHAScheduler>(tune::ASHAOptions{
                           .max_t = static_cast<double>(epochs), .reduction_factor = 2})},
      RunConfig{.name = "tune_mnist", .storage_path = storage});
  const tune::ResultGrid grid = tuner.fit();
  for (const auto& error : grid.errors()) std::cerr << "error: " << error << std::endl;
  if (grid.num_terminated() == 0) return 1;
  const Result best = grid.get_best_result();
  std::cout << "best lr " << best.config["lr"] << " accuracy " << best.metrics["accuracy"] << " ("
            << grid.num_terminated() << " trials, " << grid.num_errors() << " errored)"
            << std::endl;
  return grid.num_errors() == 0 ? 0 : 1;
}

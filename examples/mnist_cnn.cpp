// Seed 000 (the Ray Train MNIST article): the CNN trained data-parallel with a Trainer, on
// Fashion-MNIST. The model is the user's own module, exactly as in the article.
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <iostream>

#include "cohort/cohort.h"

struct CNN : torch::nn::Module {
  CNN() {
    conv1 =
        register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 32, 3).padding(1)));
    conv2 =
        register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3).padding(1)));
    fc1 = register_module("fc1", torch::nn::Linear(64 * 7 * 7, 128));
    fc2 = register_module("fc2", torch::nn::Linear(128, 10));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::max_pool2d(torch::relu(conv1->forward(x)), 2);
    x = torch::max_pool2d(torch::relu(conv2->forward(x)), 2);
    x = x.view({-1, 64 * 7 * 7});
    return fc2->forward(torch::relu(fc1->forward(x)));
  }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

void train_loop_per_worker(const cohort::Json& config) {
  auto model = cohort::train::prepare_model(std::make_shared<CNN>());
  torch::optim::SGD optimizer(model->parameters(),
                              torch::optim::SGDOptions(config["lr"].get<double>()));
  const std::string dir = config["data_dir"];
  auto train_loader = cohort::train::prepare_data_loader(
      cohort::data::load_mnist(dir, cohort::data::Split::kTrain),
      {.batch_size = config["batch_size"].get<int64_t>(), .shuffle = true});
  auto test_loader = cohort::train::prepare_data_loader(
      cohort::data::load_mnist(dir, cohort::data::Split::kTest),
      {.batch_size = 1000, .shuffle = false, .equal_shards = false});
  const int64_t max_steps = config["max_steps"].get<int64_t>();
  for (int epoch = 0; epoch < config["epochs"].get<int>(); ++epoch) {
    train_loader.set_epoch(epoch);
    model->train();
    int64_t step = 0;
    for (auto& batch : train_loader) {
      optimizer.zero_grad();
      auto loss = torch::nn::functional::cross_entropy(model->forward(batch.data), batch.target);
      loss.backward();
      optimizer.step();
      if (max_steps > 0 && ++step >= max_steps) break;
    }
    // Accuracy over the whole test set: each rank counts its share, the counts are summed.
    model->eval();
    torch::NoGradGuard no_grad;
    double correct = 0, total = 0;
    for (auto& batch : test_loader) {
      correct += model->forward(batch.data).argmax(1).eq(batch.target).sum().item<double>();
      total += static_cast<double>(batch.target.size(0));
    }
    std::vector<at::Tensor> counts{torch::tensor({correct, total}, torch::kDouble)};
    cohort::train::get_context().get_process_group().allreduce(counts);
    cohort::train::report(
        {{"epoch", epoch}, {"accuracy", (counts[0][0] / counts[0][1]).item<double>()}});
  }
}

int main(int argc, char** argv) {
  CLI::App app{"Seed 000: the CNN on Fashion-MNIST with a cohort Trainer"};
  int workers = 2, epochs = 1;
  int64_t batch_size = 64, max_steps = 0;
  double lr = 0.05;
  std::string data_dir = cohort::data::default_fashion_mnist_dir();
  app.add_option("--workers", workers);
  app.add_option("--epochs", epochs);
  app.add_option("--batch-size", batch_size);
  app.add_option("--lr", lr);
  app.add_option("--max-steps", max_steps, "steps per epoch (0: all)");
  app.add_option("--data-dir", data_dir);
  std::string storage = "./cohort_results";
  app.add_option("--storage-path", storage);
  CLI11_PARSE(app, argc, argv);
  cohort::Trainer trainer(train_loop_per_worker, {.num_workers = workers},
                          {.name = "mnist_cnn", .storage_path = storage, .resume = false},
                          {{"lr", lr},
                           {"batch_size", batch_size},
                           {"epochs", epochs},
                           {"max_steps", max_steps},
                           {"data_dir", data_dir}});
  cohort::Result result = trainer.fit();
  if (!result.ok()) {
    std::cerr << "error: " << *result.error << std::endl;
    return 1;
  }
  std::cout << "accuracy " << result.metrics["accuracy"] << std::endl;
  return 0;
}

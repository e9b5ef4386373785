// A guide's fragment of a pipeline's training loop: the model is a torch::nn::Sequential.
#include <torch/torch.h>

#include <cohort/cohort.h>

[[maybe_unused]] void fragment() {
  torch::nn::Sequential model(torch::nn::Flatten(), torch::nn::Linear(784, 64), torch::nn::ReLU(),
                              torch::nn::Linear(64, 64), torch::nn::ReLU(),
                              torch::nn::Linear(64, 10));
  auto loader = cohort::train::prepare_data_loader(
      cohort::data::load_mnist(cohort::data::default_fashion_mnist_dir(),
                               cohort::data::Split::kTrain),
      {.batch_size = 64});
  {
    // SNIPPET
  }
}

// A guide's fragment around a CUDA graph: the optimizer is one of cohort's flat optimizers.
#include <torch/torch.h>

#include <cohort/cohort.h>
#include <cohort/models/zoo.h>

[[maybe_unused]] void fragment() {
  using namespace cohort;
  auto model = models::create_model("cnn");
  optim::FlatSGD optimizer(model->parameters(), torch::optim::SGDOptions(0.02));
  auto loader = train::prepare_data_loader(
      data::load_mnist(data::default_fashion_mnist_dir(), data::Split::kTrain), {.batch_size = 64});
  {
    // SNIPPET
  }
}

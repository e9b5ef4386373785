// A guide's fragment of a training loop, compiled with what a loop has at hand: the context, a zoo
// model, its optimizer, a data loader and a batch, the report's metrics.
#include <torch/torch.h>

#include <filesystem>

#include <cohort/cohort.h>
#include <cohort/models/zoo.h>

[[maybe_unused]] void fragment(const cohort::Json& config) {
  using namespace cohort;
  auto& ctx = train::get_context();
  auto model = train::prepare_model(models::create_model("cnn"));
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.02));
  auto loader = train::prepare_data_loader(
      data::load_mnist(data::default_fashion_mnist_dir(), data::Split::kTrain), {.batch_size = 64});
  const auto x = torch::randn({64, 1, 28, 28});
  const auto y = torch::randint(10, {64});
  const int epochs = config.value("epochs", 1);
  const auto step = [](const torch::Tensor&, const torch::Tensor&) {};
  const Json metrics{{"loss", 0.0}};
  const std::filesystem::path dir = "checkpoint";
  const std::function<void(const Json&)> loop = [](const Json&) {};
  const ScalingConfig scaling{.num_workers = 2};
  const RunConfig run{.name = "run"};
  {
    // SNIPPET
  }
}

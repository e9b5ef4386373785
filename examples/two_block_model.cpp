// Seed 001 (the distributed-training workshop): a network split into two blocks that live on
// two devices (model parallelism), here also replicated over workers with a Trainer (data
// parallelism): hybrid parallelism as in seed 004. With a CUDA libtorch and two GPUs per worker
// the blocks go to cuda:2r and cuda:2r+1; otherwise both stay on the CPU and the program shows
// the same structure.
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <iostream>

#include "cohort/cohort.h"

struct TwoBlockNN : torch::nn::Module {
  TwoBlockNN(c10::Device first, c10::Device second) : first_device(first), second_device(second) {
    block1 = register_module("block1",
                             torch::nn::Sequential(torch::nn::Linear(10, 20), torch::nn::ReLU(),
                                                   torch::nn::Linear(20, 50)));
    block2 = register_module("block2",
                             torch::nn::Sequential(torch::nn::ReLU(), torch::nn::Linear(50, 1)));
    block1->to(first_device);
    block2->to(second_device);
  }
  torch::Tensor forward(torch::Tensor x) {
    x = block1->forward(x.to(first_device));
    return block2->forward(x.to(second_device));
  }
  c10::Device first_device, second_device;
  torch::nn::Sequential block1{nullptr}, block2{nullptr};
};

void train_loop(const cohort::Json& config) {
  auto& ctx = cohort::train::get_context();
  // With GPUs, the worker's two (it sees its own as cuda:0 and cuda:1); else the CPU twice.
  const c10::Device first = ctx.get_device();
  const c10::Device second =
      first.is_cuda() ? c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(first.index() + 1))
                      : first;
  torch::manual_seed(0);
  auto model = std::make_shared<TwoBlockNN>(first, second);
  // The blocks already sit where they belong: DDP only synchronises their gradients.
  cohort::train::prepare_model(model, {.move_to_device = false});
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-2));
  // A regression target the two blocks can learn: y = sum of the first three inputs.
  auto generator = torch::make_generator<at::CPUGeneratorImpl>(100 + ctx.get_world_rank());
  double first_loss = 0, loss_value = 0;
  for (int step = 0; step < config["steps"].get<int>(); ++step) {
    auto x = torch::randn({64, 10}, generator);
    auto y = x.narrow(1, 0, 3).sum(1, true);
    auto output = model->forward(x);
    auto loss = torch::mse_loss(output, y.to(second));
    optimizer.zero_grad();
    loss.backward();
    optimizer.step();
    loss_value = loss.item<double>();
    if (step == 0) {
      first_loss = loss_value;
      if (ctx.get_world_rank() == 0) std::cout << "Output shape: " << output.sizes() << std::endl;
    }
  }
  cohort::train::report({{"first_loss", first_loss},
                         {"loss", loss_value},
                         {"devices", first.str() + "," + second.str()}});
}

int main(int argc, char** argv) {
  CLI::App app{
      "Seed 001: the two-block model, its blocks on two devices, data-parallel over workers"};
  int workers = 2, steps = 200;
  std::string storage = "./cohort_results";
  app.add_option("--workers", workers);
  app.add_option("--steps", steps);
  app.add_option("--storage-path", storage);
  CLI11_PARSE(app, argc, argv);
  // Two GPUs per worker where the node has them. Only the driver's view counts: each worker then
  // sees just its own two, from the driver.
  const bool two_gpus = cohort::runtime::visible_gpus().size() >= static_cast<size_t>(2 * workers);
  cohort::Trainer trainer(train_loop,
                          {.num_workers = workers,
                           .use_gpu = two_gpus,
                           .resources_per_worker = {.gpus = two_gpus ? 2 : 0}},
                          {.name = "two_block_model", .storage_path = storage, .resume = false},
                          {{"steps", steps}});
  cohort::Result result = trainer.fit();
  if (!result.ok()) {
    std::cerr << "error: " << *result.error << std::endl;
    return 1;
  }
  std::cout << "loss " << result.metrics["first_loss"] << " -> " << result.metrics["loss"] << " on "
            << result.metrics["devices"] << std::endl;
  return result.metrics["loss"].get<double>() < result.metrics["first_loss"].get<double>() ? 0 : 1;
}

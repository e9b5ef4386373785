// Seed 001 (the distributed-training workshop): a network split into two blocks that live on
// two devices (model parallelism), here also replicated over workers with a Trainer (data
// parallelism): hybrid parallelism as in seed 004. With a CUDA libtorch and two GPUs per worker
// the blocks go to cuda:2r and cuda:2r+1; otherwise both stay on the CPU and the program shows
// the same structure.
//
// With --pipeline the blocks live in two worker processes instead: block 1 on rank 0, block 2 on
// rank 1, each batch cut into micro-batches that flow through them on a 1F1B schedule.
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

// A regression target the two blocks can learn: y = sum of the first three inputs.
std::pair<torch::Tensor, torch::Tensor> make_batch(torch::Generator& generator) {
  auto x = torch::randn({64, 10}, generator);
  return {x, x.narrow(1, 0, 3).sum(1, true)};
}

// Block 1 on rank 0, block 2 on rank 1: pipeline parallelism over two processes.
void pipeline_loop(const cohort::Json& config) {
  namespace pipeline = cohort::parallel::pipeline;
  auto& ctx = cohort::train::get_context();
  if (ctx.get_world_size() != 2) {
    throw cohort::UsageError(
        "--pipeline puts block 1 on rank 0 and block 2 on rank 1: use "
        "--workers 2, got " +
        std::to_string(ctx.get_world_size()));
  }
  torch::manual_seed(0);
  auto model = std::make_shared<TwoBlockNN>(c10::Device(c10::kCPU), c10::Device(c10::kCPU));
  const int rank = ctx.get_world_rank();
  torch::nn::Sequential mine = rank == 0 ? model->block1 : model->block2;
  pipeline::Pipeline pipe({mine}, ctx.get_process_group(),
                          [](const torch::Tensor& output, const torch::Tensor& target) {
                            return torch::mse_loss(output, target);
                          },
                          {.schedule = pipeline::ScheduleKind::kOneFOneB, .micro_batches = 4});
  torch::optim::Adam optimizer(mine->parameters(), torch::optim::AdamOptions(1e-2));
  // Both ranks draw the same batches: rank 0 needs the inputs, rank 1 the targets.
  auto generator = torch::make_generator<at::CPUGeneratorImpl>(100);
  if (rank == 0) std::cout << "pipeline: block 1 on rank 0, block 2 on rank 1" << std::endl;
  // The loss lives on the last stage (rank 1); [first, last] go to rank 0 for the report.
  auto losses = torch::zeros({2});
  for (int step = 0; step < config["steps"].get<int>(); ++step) {
    auto [x, y] = make_batch(generator);
    optimizer.zero_grad();
    const torch::Tensor loss = pipe.step(x, y);
    optimizer.step();
    if (loss.defined()) losses[step == 0 ? 0 : 1] = loss.item<double>();
  }
  std::vector<torch::Tensor> both{losses};
  ctx.get_process_group().broadcast(both, /*root=*/1);
  cohort::train::report({{"first_loss", both[0][0].item<double>()},
                         {"loss", both[0][1].item<double>()},
                         {"devices", "rank 0,rank 1"}});
}

void train_loop(const cohort::Json& config) {
  if (config.value("pipeline", false)) return pipeline_loop(config);
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
  auto generator = torch::make_generator<at::CPUGeneratorImpl>(100 + ctx.get_world_rank());
  double first_loss = 0, loss_value = 0;
  for (int step = 0; step < config["steps"].get<int>(); ++step) {
    auto [x, y] = make_batch(generator);
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
  bool pipeline = false;
  std::string storage = "./cohort_results";
  app.add_option("--workers", workers);
  app.add_option("--steps", steps);
  app.add_flag("--pipeline", pipeline, "block 1 on worker 0, block 2 on worker 1 (--workers 2)");
  app.add_option("--storage-path", storage);
  CLI11_PARSE(app, argc, argv);
  // Two GPUs per worker where the node has them. Only the driver's view counts: each worker then
  // sees just its own two, from the driver.
  const bool two_gpus =
      !pipeline && cohort::runtime::visible_gpus().size() >= static_cast<size_t>(2 * workers);
  cohort::Trainer trainer(train_loop,
                          {.num_workers = workers,
                           .use_gpu = two_gpus,
                           .resources_per_worker = {.gpus = two_gpus ? 2 : 0}},
                          {.name = "two_block_model", .storage_path = storage, .resume = false},
                          {{"steps", steps}, {"pipeline", pipeline}});
  cohort::Result result = trainer.fit();
  if (!result.ok()) {
    std::cerr << "error: " << *result.error << std::endl;
    return 1;
  }
  std::cout << "loss " << result.metrics["first_loss"] << " -> " << result.metrics["loss"] << " on "
            << result.metrics["devices"] << std::endl;
  return result.metrics["loss"].get<double>() < result.metrics["first_loss"].get<double>() ? 0 : 1;
}

// Your own model and your own data on cohort's one path for every plan: a network defined here
// (not the zoo's), rows from an image folder (--data images:DIR, a sub-folder per class), a CSV
// (--data csv:FILE --label COLUMN) or MNIST-format files (the default: Fashion-MNIST), trained by
// train::parallelize and the library's loop with the plan's and optimizer's flags, by default pp 2
// x dp 2 (4 workers), ZeRO-1 inside dp, bf16, 2 accumulated batches per step and AdamW; --deepspeed
// FILE and --config FILE set them too.
// --max-steps N stops the run inside an epoch with a checkpoint; run it again with the same --name
// and it resumes with exactly the batches it had not seen.
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <iomanip>
#include <iostream>

#include "cohort/cli/config_file.h"
#include "cohort/cli/data_options.h"
#include "cohort/cli/loop_options.h"
#include "cohort/cli/plan_options.h"
#include "cohort/cli/run_options.h"
#include "cohort/cli/scaling_options.h"
#include "cohort/cohort.h"

namespace train = cohort::train;

void train_loop(const cohort::Json& c) {
  auto& ctx = train::get_context();
  const auto plan = c["plan"].get<cohort::cli::PlanOptions>().plan(ctx.get_world_size());
  const auto data_options = c["data"].get<cohort::cli::DataOptions>();
  const auto loop_options = c["loop"].get<cohort::cli::LoopOptions>();
  const auto data = data_options.open(loop_options.seed);
  torch::manual_seed(loop_options.seed);  // every rank the same weights
  // The model: its layers in order, which a pipeline cuts into stages.
  const int64_t features = data.channels * data.image_size * data.image_size;
  torch::nn::Sequential net(torch::nn::Flatten(), torch::nn::Linear(features, 64),
                            torch::nn::ReLU(), torch::nn::Linear(64, 64), torch::nn::ReLU(),
                            torch::nn::Linear(64, data.num_classes));
  auto model = train::parallelize(
      {.module = net.ptr(),
       .forward = [net](const at::Tensor& x) mutable { return net->forward(x); },
       .layers = net},
      [&c](std::vector<at::Tensor> p) {
        return cohort::optim::make_optimizer(c["optimizer"], std::move(p));
      },
      [](const at::Tensor& out, const at::Tensor& y) {
        return torch::nn::functional::cross_entropy(out, y);
      },
      plan);
  auto stream = train::get_dataset_shard("train");
  // Resumes from the run's checkpoint, inside an epoch where it stopped; reports each epoch.
  train::EpochLoopOptions loop{.test_set = data_options.test_set(data)};
  loop_options.apply(loop);                             // --epochs, --batch-size, --max-steps
  c["run"].get<cohort::cli::RunOptions>().apply(loop);  // --checkpoint-every-steps, snapshots
  train::run_epochs(model, stream, loop);
}

int main(int argc, char** argv) {
  CLI::App app("Your own model and data, trained on a plan of the command line's flags");
  cohort::cli::PlanOptions plan{
      .pp = 2, .zero = {.stage = 1}, .gradient_accumulation_steps = 2, .precision = "bf16"};
  cohort::optim::OptimizerOptions optimizer{.algorithm = "adamw", .lr = 3e-3};
  cohort::cli::ScalingOptions scaling{.workers = 4};                // --workers, --use-gpu, ...
  cohort::cli::LoopOptions loop{.epochs = 2, .batch_size = 16};     // --epochs, --max-steps, ...
  cohort::cli::RunOptions run{.name = "own_model", .quiet = true};  // the run's folder and more
  cohort::cli::DataOptions data;  // --data images:DIR, csv:FILE --label COLUMN, ...
  std::string config, deepspeed;
  app.add_option("--deepspeed", deepspeed, "a DeepSpeed JSON config: its plan and micro-batch");
  cohort::cli::add_scaling_options(&app, scaling);
  cohort::cli::add_data_options(&app, data);
  cohort::cli::add_loop_options(&app, loop);
  cohort::cli::add_plan_options(&app, plan);
  cohort::cli::add_optimizer_options(&app, optimizer);
  cohort::cli::add_run_options(&app, run);
  cohort::cli::add_config_option(&app, config);
  CLI11_PARSE(app, argc, argv);
  try {
    cohort::cli::apply_config_file(&app, config);
    if (!deepspeed.empty())  // its plan, optimizer and micro-batch
      loop.batch_size =
          cohort::cli::load_deepspeed_config(deepspeed, scaling.workers, plan, optimizer)
              .micro_batch_size;
    // A bad plan or worker flag: one line naming the flags, before any worker starts.
    const auto scaling_config = scaling.scaling_config(plan.plan(scaling.workers));
    optimizer.check();
    loop.validate();
    cohort::Json c{
        {"data", data}, {"loop", loop}, {"plan", plan}, {"optimizer", optimizer}, {"run", run}};
    const auto labelled = data.open(loop.seed);  // a bad flag or file: one line, exit code 2
    std::cout << labelled.describe() << std::endl;
    cohort::Trainer trainer(train_loop, scaling_config, run.run_config(loop.max_steps), c,
                            data.datasets(labelled, loop.seed));
    const auto result = trainer.fit();
    if (!result.ok()) throw std::runtime_error(*result.error);
    std::cout << "steps " << result.metrics["steps"] << " accuracy "
              << result.metrics["test_accuracy"] << " test_loss " << std::setprecision(17)
              << result.metrics["test_loss"].get<double>() << std::endl;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return dynamic_cast<const cohort::UsageError*>(&e) != nullptr ? 2 : 1;
  }
}

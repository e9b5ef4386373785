#include "estimate_command.h"

#include <iomanip>
#include <iostream>
#include <string>

#include "cohort/cohort.h"

namespace cohort::cli {

CLI::App* add_estimate_command(CLI::App& app, TrainOptions& options) {
  auto* cmd = app.add_subcommand(
      "estimate",
      "Print the memory each worker of a `cohort train` job needs: parameters, gradients, "
      "optimizer state, ZeRO's buffers, activations (one micro-batch measured) and the runtime; "
      "takes train's options, and --memory-budget GB to check them against");
  cmd->footer(
      "\nExamples:\n"
      "  cohort estimate --model resnet18 --workers 4 --zero-stage 2 --batch-size 128\n"
      "  cohort estimate --model vit --workers 8 --zero-stage 3 --shard-group-size 4 "
      "--activation-checkpointing every:1 --memory-budget 2\n"
      "  cohort estimate --model gpt --layers 24 --width 1024 --heads 16 --context 1024 "
      "--workers 4 --zero-stage 3 --optimizer adamw --batch-size 4");
  add_training_options(cmd, options);
  return cmd;
}

int run_estimate_command(TrainOptions o) {
  apply_deepspeed_config(o);
  // The job's own checks that need no data: the model, the plan, its units and its mesh.
  const auto plan = o.plan.plan(o.scaling.workers);
  parallel::checkpointed_units(*model_shape_of(o), plan.activation_checkpointing,
                               plan.unit_choice());
  validate_mesh(o);
  const auto estimate = estimate_of(o);
  // The plan's degrees where they are not the defaults: what the figures are for.
  std::string degrees;
  if (plan.pp > 1) degrees += " --pp " + std::to_string(plan.pp);
  if (plan.tp > 1) degrees += " --tp " + std::to_string(plan.tp);
  if (plan.zero.stage > 0) degrees += " --zero-stage " + std::to_string(plan.zero.stage);
  if (plan.zero.shard_group_size > 0)
    degrees += " --shard-group-size " + std::to_string(plan.zero.shard_group_size);
  std::cout << "cohort estimate: --model " << o.model << " --workers " << o.scaling.workers
            << degrees << " --batch-size " << o.loop.batch_size
            << ", per worker (the one that holds the most):\n"
            << estimate.table()
            << "  (not counted: the data set each worker loads and its data pipeline's buffers)\n";
  if (o.memory_budget_gb > 0) {
    estimate.check_budget(static_cast<int64_t>(o.memory_budget_gb * 1e9));
    std::cout << "fits --memory-budget " << o.memory_budget_gb << " GB" << std::endl;
  } else {
    const auto& big = estimate.largest();
    std::cout << "largest: " << big.name << "; to shrink it: " << big.shrink << std::endl;
  }
  return 0;
}

}  // namespace cohort::cli

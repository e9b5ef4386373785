#include "train_command.h"

#include <iostream>

#include "cohort/cohort.h"
#include "training_job.h"

namespace cohort::cli {

CLI::App* add_train_command(CLI::App& app, TrainOptions& o) {
  auto* cmd = app.add_subcommand("train", "Train a model of the zoo on an MNIST-format data set");
  add_training_options(cmd, o);
  return cmd;
}

int run_train_command(TrainOptions o, bool workers_given) {
  // Under a launcher its world size is the default; an explicit --workers must match it.
  if (auto launch = runtime::detect_launch(); launch && !workers_given)
    o.workers = launch->world_size;
  apply_deepspeed_config(o);
  validate(o);
  Trainer trainer(train_loop, scaling_of(o), run_config_of(o), to_json(o), datasets_of(o));
  Result result = trainer.fit();
  if (!result.ok()) {
    std::cerr << "error: " << *result.error << "\n(logs: " << (result.path / "logs").string()
              << ")\n";
    return 1;
  }
  const auto& m = result.metrics;
  std::cout << "test_accuracy " << m.value("test_accuracy", 0.0) << " | train_loss "
            << m.value("train_loss", 0.0) << " | samples_per_second "
            << m.value("samples_per_second", 0.0) << " | wall_seconds " << result.wall_seconds
            << "\nresult: " << (result.path / "result.json").string() << std::endl;
  return 0;
}

}  // namespace cohort::cli

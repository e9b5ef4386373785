#include "train_command.h"

#include <csignal>
#include <iomanip>
#include <iostream>

#include "cohort/cli/config_file.h"
#include "cohort/cohort.h"
#include "training_job.h"

namespace cohort::cli {

CLI::App* add_train_command(CLI::App& app, TrainOptions& o) {
  auto* cmd = app.add_subcommand(
      "train", "Train a model of the zoo on an MNIST-format data set, your own, or text");
  add_training_options(cmd, o);
  cmd->footer(
      "Examples:\n"
      "  cohort train --model resnet18 --workers 2 --epochs 10 --name fashion\n"
      "  cohort train --name fashion                       continue that run from its checkpoint\n"
      "  cohort train --config cohort_results/fashion/config.json --epochs 20\n"
      "  cohort train --zero-stage 2 --precision bf16 --profile-steps 100-110\n"
      "  cohort train --deepspeed ds_config.json --workers 4\n"
      "  cohort train --model gpt --data text:book.txt --context 256 --optimizer adamw "
      "--zero-stage 3\n"
      "\n"
      "Bad input is one line naming the value and the fix, exit code 2; a failure while "
      "running, exit code 1.");
  return cmd;
}

int run_train_command(TrainOptions o, const CLI::App& cmd) {
  // Under a launcher its world size is the default; an explicit --workers must match it.
  if (const auto world = runtime::launched_world_size(); world && cmd.count("--workers") == 0)
    o.scaling.workers = *world;
  apply_deepspeed_config(o);
  validate(o);
  RunConfig run = run_config_of(o);
  // Every worker runs this too (re-executed, or each rank under a launcher): said once.
  const bool driver = is_driver(run);
  if (!o.data.data.empty() && !o.run.quiet && driver)
    std::cout << "data: " << o.data.open(o.loop.seed, o.context).describe() << std::endl;
  if (o.memory_budget_gb > 0 && driver) {
    const auto estimate = estimate_of(o);
    estimate.check_budget(static_cast<int64_t>(o.memory_budget_gb * 1e9));
    if (!o.run.quiet) {
      std::cout << "memory: about " << std::fixed << std::setprecision(1)
                << static_cast<double>(estimate.total()) / 1e9
                << " GB per worker, within --memory-budget " << o.memory_budget_gb << " GB"
                << std::defaultfloat << std::endl;
    }
  }
  // `cohort train --config <run>/config.json` runs it again.
  run.extra_files[kConfigFile] = effective_options(&cmd).dump(2) + "\n";
  Trainer trainer(train_loop, scaling_of(o), run, to_json(o), datasets_of(o));
  Result result = trainer.fit();
  if (!result.ok()) {
    std::cerr << "error: " << *result.error << "\n(logs: " << (result.path / "logs").string()
              << ")\n";
    return 1;
  }
  if (result.interrupted) {
    std::cout << "resume with: cohort train --config " << (result.path / kConfigFile).string()
              << std::endl;
    return 128 + SIGINT;
  }
  const auto& m = result.metrics;
  std::cout << "test_accuracy " << m.value("test_accuracy", 0.0) << " | train_loss "
            << m.value("train_loss", 0.0) << " | samples_per_second "
            << (m.contains("samples_per_second") ? m["samples_per_second"].dump()
                                                 : std::string("not measured"))
            << " | wall_seconds " << result.wall_seconds
            << "\nresult: " << (result.path / "result.json").string() << std::endl;
  return 0;
}

}  // namespace cohort::cli

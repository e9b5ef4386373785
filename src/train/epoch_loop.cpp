#include "cohort/train/epoch_loop.h"

#include <chrono>
#include <iostream>
#include <vector>

#include <ATen/ATen.h>

#include "cohort/error.h"
#include "cohort/parallel/mesh.h"
#include "cohort/train/context.h"
#include "cohort/train/throughput.h"

namespace cohort::train {
namespace {

void check_loop_options(const EpochLoopOptions& o) {
  const auto refuse = [](const std::string& what) {
    throw UsageError("run_epochs: EpochLoopOptions::" + what);
  };
  if (o.epochs < 1) refuse("epochs " + std::to_string(o.epochs) + " must be >= 1");
  if (o.batch_size < 1) refuse("batch_size " + std::to_string(o.batch_size) + " must be >= 1");
  if (o.max_steps < 0)
    refuse("max_steps " + std::to_string(o.max_steps) + " must be >= 0 (0: no limit)");
  if (o.checkpoint_every_steps < 0) {
    refuse("checkpoint_every_steps " + std::to_string(o.checkpoint_every_steps) +
           " must be >= 0 (0: a checkpoint at each epoch's end only)");
  }
  if (o.snapshot_every_steps < 0) {
    refuse("snapshot_every_steps " + std::to_string(o.snapshot_every_steps) +
           " must be >= 0 (0: no snapshots)");
  }
  if (o.tokens_per_row < 0)
    refuse("tokens_per_row " + std::to_string(o.tokens_per_row) + " must be >= 0 (0: rows only)");
  if (o.input_column.empty() || o.target_column.empty())
    refuse("input_column and target_column must name the stream's columns (e.g. image, label)");
}

double seconds_since_run_start() {
  return std::chrono::duration<double>(std::chrono::system_clock::now() -
                                       get_context().get_run_start_time())
      .count();
}

}  // namespace

int64_t steps_per_epoch(const data::DataIterator& stream, int64_t batch_size, const Plan& plan) {
  if (batch_size < 1)
    throw UsageError("steps_per_epoch: batch_size " + std::to_string(batch_size) + " must be >= 1");
  const int64_t step_rows = batch_size * plan.gradient_accumulation_steps;
  return (stream.dataset().num_source_rows() + step_rows - 1) / step_rows;
}

Json run_epochs(ParallelModel& model, data::DataIterator& stream, const EpochLoopOptions& o) {
  check_loop_options(o);
  auto& ctx = get_context();
  const bool rank0 = ctx.get_world_rank() == 0;
  const auto& plan = model.plan();
  ResumePoint resumed;
  if (auto checkpoint = get_checkpoint()) {
    // Resume where the checkpoint left off, not at epoch 1.
    model.load(*checkpoint);
    resumed = resume_point(*checkpoint);
  }
  if (o.max_steps > 0 && model.steps() >= o.max_steps) {
    // Nothing left to train: the run keeps the checkpoint's model and report, as a run whose
    // epochs are all done.
    if (rank0) {
      std::cout << "max_steps " << o.max_steps << " already reached: the checkpoint is at step "
                << model.steps() << "; nothing to train (raise max_steps to go on)" << std::endl;
    }
    return Json::object();
  }
  // Each optimizer step takes the plan's accumulated batches.
  const int64_t step_rows = o.batch_size * plan.gradient_accumulation_steps;
  const int64_t epoch_steps = steps_per_epoch(stream, o.batch_size, plan);
  // The rows of one step over the world: each data-parallel replica's.
  const int64_t replicas = ctx.get_world_size() / (plan.pp * plan.tp);
  // A Ctrl-C asks the loop to stop after a checkpoint (should_stop(), a collective): after every
  // step, or where the workers agree anyway (epoch ends) with local SGD, DiLoCo and the parameter
  // server, whose workers must not wait for each other every step.
  const bool stop_every_step = model.synchronous();
  bool stopping = false;
  // Throughput over the steps after the first few (start-up, the first step's probes).
  Throughput throughput;
  const int64_t first_step = model.steps();
  double time_to_first_step = 0;
  Json metrics;
  for (int epoch = resumed.epoch; epoch < o.epochs; ++epoch) {
    stream.set_epoch(epoch);
    double loss_sum = 0;
    int64_t loss_count = 0;
    const std::string label = "epoch " + std::to_string(epoch + 1) + "/" + std::to_string(o.epochs);
    // Resumed inside this epoch: the stream starts after the rows it had taken (the checkpoint's
    // data position), and the steps count on.
    int64_t step_in_epoch = epoch == resumed.epoch ? resumed.epoch_steps_done : 0;
    bool max_reached = false;
    throughput.start();  // not the evaluation's time
    for (auto& batch : stream.iter_batches({.batch_size = step_rows, .device = ctx.get_device()})) {
      const auto& inputs = batch[o.input_column];
      const auto result = model.step(inputs, batch[o.target_column]);
      if (!result.stepped) continue;
      ++step_in_epoch;
      throughput.step(inputs.size(0) * replicas);
      if (model.steps() == first_step + 1) {
        time_to_first_step = seconds_since_run_start();
        if (rank0) {
          std::cout << "first training step done " << time_to_first_step << " s after start"
                    << std::endl;
        }
      }
      std::optional<double> step_loss;
      if (result.loss.defined()) {
        step_loss = result.loss.item<double>();
        loss_sum += *step_loss;
        ++loss_count;
      }
      log_step(model.steps(), [&] {
        Json values{{"lr", model.lr()}};
        if (step_loss) values["train_loss"] = *step_loss;
        return values;
      });
      Json progress{{"label", label}, {"step", step_in_epoch}, {"total", epoch_steps}};
      if (const auto rate = throughput.samples_per_second()) {
        progress["samples_per_s"] = *rate;
        if (o.tokens_per_row > 0) progress["tokens_per_s"] = *rate * o.tokens_per_row;
      }
      if (loss_count > 0) progress["loss"] = loss_sum / static_cast<double>(loss_count);
      report_progress(progress);
      if ((max_reached = o.max_steps > 0 && model.steps() >= o.max_steps)) break;
      if (stop_every_step && should_stop()) {
        stopping = true;
        break;
      }
      // A checkpoint inside the epoch (its end has one anyway), from which a resumed run starts
      // after this step, or else an in-memory snapshot. Local SGD, DiLoCo and the parameter
      // server agree first, as at an epoch's end.
      const bool checkpoint_due =
          o.checkpoint_every_steps > 0 && model.steps() % o.checkpoint_every_steps == 0;
      const bool snapshot_due =
          o.snapshot_every_steps > 0 && model.steps() % o.snapshot_every_steps == 0;
      if ((checkpoint_due || snapshot_due) && step_in_epoch < epoch_steps) {
        model.sync();
        Json step_metrics{{"epoch", epoch + 1},
                          {kEpochStepMetric, step_in_epoch},
                          {"steps", model.steps()},
                          {"world_size", ctx.get_world_size()},
                          {"lr", model.lr()}};
        if (loss_count > 0) step_metrics["train_loss"] = loss_sum / static_cast<double>(loss_count);
        if (checkpoint_due)
          report(step_metrics, model, o.save);
        else
          snapshot(step_metrics, model);
      }
    }
    // Local SGD, DiLoCo and the parameter server: the replicas agree at the end of every epoch
    // too, so that the evaluation and the checkpoint are of one model.
    model.sync();
    if (!stop_every_step) stopping = should_stop();
    // The epoch's mean training loss over the ranks that compute one.
    std::vector<at::Tensor> loss_stats{
        at::tensor({loss_sum, static_cast<double>(loss_count)}, at::kDouble)};
    ctx.get_process_group().allreduce(loss_stats);
    const double train_loss = loss_stats[0][0].item<double>() / loss_stats[0][1].item<double>();
    std::optional<Evaluation> eval;
    if (o.test_set) eval = model.evaluate(*o.test_set);
    const double spread = model.replica_spread();
    const bool last = epoch + 1 == o.epochs || max_reached || stopping;
    metrics = Json{
        {"epoch", epoch + 1},  {"replica_spread", spread}, {"world_size", ctx.get_world_size()},
        {"epochs", epoch + 1}, {"steps", model.steps()},   {"train_loss", train_loss},
        {"lr", model.lr()}};
    if (eval) {
      metrics["test_loss"] = eval->loss;
      metrics["test_accuracy"] = eval->accuracy.value_or(0.0);
    }
    metrics["elapsed_s"] = seconds_since_run_start();
    metrics["time_to_first_step_s"] = time_to_first_step;
    // A run of one step has no throughput to report (not 0): a line says why.
    if (const auto rate = throughput.samples_per_second()) {
      metrics["samples_per_second"] = *rate;
      if (o.tokens_per_row > 0) metrics["tokens_per_second"] = *rate * o.tokens_per_row;
      metrics["throughput_steps"] = throughput.measured_steps();
    } else if (rank0 && last) {
      std::cout << "samples_per_second not measured: " << throughput.why_unmeasured() << std::endl;
    }
    if (ctx.has_mesh()) metrics["mesh"] = parallel::to_string(ctx.get_mesh().shape());
    // Stopped inside the epoch: a resumed run takes its remaining batches.
    if ((stopping || max_reached) && step_in_epoch < epoch_steps)
      metrics[kEpochStepMetric] = step_in_epoch;
    report(metrics, model, o.save);
    if (last) break;
  }
  return metrics;
}

}  // namespace cohort::train

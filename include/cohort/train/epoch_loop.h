/// \file
/// The training loop every plan shares, for programs that need no loop of their own (`cohort
/// train` is one): epochs of ParallelModel::step over a get_dataset_shard stream, resumed from
/// the run's checkpoint (inside an epoch: with exactly the batches it had not trained on),
/// checkpoints and in-memory snapshots every N steps, a Ctrl-C's stop with a checkpoint,
/// throughput, the progress bar and per-step logs, and at each epoch's end the replicas' sync, an
/// evaluation and a report with a checkpoint.
///
///   auto model = train::parallelize(spec, make_optimizer, loss, plan);
///   auto stream = train::get_dataset_shard("train");
///   train::run_epochs(model, stream, {.epochs = 5, .batch_size = 64, .test_set = test_rows});
///
/// A loop of one's own takes the same calls (ParallelModel's step, sync, evaluate; train::report,
/// snapshot, should_stop, resume_point); this one is them in the order every plan needs.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "cohort/data/data_iterator.h"
#include "cohort/data/tensor_dataset.h"
#include "cohort/json.h"
#include "cohort/train/parallel_model.h"
#include "cohort/train/plan.h"
#include "cohort/train/report.h"

namespace cohort::train {

/// How train::run_epochs trains.
struct EpochLoopOptions {
  /// Epochs of the whole run: a resumed run trains the ones its checkpoint had not finished.
  int epochs = 1;
  /// Rows of one batch on this rank (a data-parallel replica's; a pipeline's and a tensor-parallel
  /// group's ranks read the same rows). An optimizer step takes the plan's
  /// gradient_accumulation_steps batches.
  int64_t batch_size = 64;
  /// The stream's column the model reads.
  std::string input_column = "image";
  /// The stream's column of the loss's targets.
  std::string target_column = "label";
  /// The run stops after this many optimizer steps in all, a resumed run's counted (0: no limit),
  /// with a checkpoint that a longer run resumes from where it stopped; a run whose checkpoint is
  /// already there trains nothing. The learning-rate schedule is not shortened by it.
  int64_t max_steps = 0;
  /// A checkpoint after every N-th optimizer step inside an epoch (0: at each epoch's end only):
  /// a failure then loses at most N steps. Local SGD, DiLoCo and the parameter server agree first.
  int64_t checkpoint_every_steps = 0;
  /// An in-memory snapshot (train::snapshot) after every N-th step where no checkpoint is due
  /// (0: none). It needs RunConfig::snapshot_path.
  int64_t snapshot_every_steps = 0;
  /// How each checkpoint is saved (asynchronously; skipped when one is still in flight).
  SaveOptions save;
  /// Scored at each epoch's end (ParallelModel::evaluate): the report's "test_loss" and
  /// "test_accuracy". None: no evaluation.
  std::optional<data::TensorDataset> test_set;
  /// Tokens in one row for a language model (its context): the throughput is reported in tokens
  /// per second too ("tokens_per_second"). 0: rows only.
  int64_t tokens_per_row = 0;
};

/// The optimizer steps one epoch of `stream` takes in batches of `batch_size` rows with `plan`'s
/// accumulation (the last step may be short): times the epochs, what a learning-rate schedule
/// over the whole run spans (optim::LrScheduleOptions, given to parallelize).
int64_t steps_per_epoch(const data::DataIterator& stream, int64_t batch_size, const Plan& plan);

/// Trains `model` on `stream` (this rank's shard of the Trainer's dataset) for the epochs
/// `options` says, resuming from train::get_checkpoint() when the run has one, and returns the
/// last report's metrics (none when nothing was left to train: every epoch done, or max_steps
/// reached by the checkpoint). Every rank calls it alike. Each epoch's report holds "epoch",
/// "epochs", "steps", "world_size", "train_loss" (the epoch's mean over the ranks that compute a
/// loss), "lr", "replica_spread" (ParallelModel::replica_spread), "elapsed_s" and
/// "time_to_first_step_s" since the run began, "samples_per_second" and "throughput_steps" once
/// measured, "test_loss" and "test_accuracy" with a test set, "mesh" with one, and
/// "epoch_step" when it stopped inside the epoch (a Ctrl-C, max_steps). Bad options (an epoch
/// count or batch size below 1, a negative step count, an empty column name) are a UsageError
/// naming the field and the fix, before the checkpoint is loaded or any step is taken.
Json run_epochs(ParallelModel& model, data::DataIterator& stream, const EpochLoopOptions& options);

}  // namespace cohort::train

#pragma once
#include <functional>
#include <optional>
#include <string>

#include "cohort/json.h"
#include "cohort/train/checkpoint.h"

namespace cohort::train {

/// Reports metrics, and optionally a checkpoint, for this iteration (Ray Train's report).
/// Every rank calls it at the same points (a rank that calls it a different number of times ends
/// the run with an error naming it, never a hang); the driver keeps rank 0's metrics. Each rank's
/// checkpoint folder is copied into one checkpoint_NNNNNN of the run directory (same-named files:
/// rank 0's win, so name sharded state per rank, e.g. "optimizer-rank1.pt"); it is whole, with its
/// manifest, before report() returns on any rank.
void report(const Json& metrics, const std::optional<Checkpoint>& checkpoint = std::nullopt);

/// How train::report(metrics, model, options) saves the model's checkpoint.
struct SaveOptions {
  /// Asynchronous: the loop waits only while this rank's files are copied into memory (buffers
  /// kept from one save to the next); a thread of its own writes them into the run directory, and
  /// rank 0's commits the checkpoint once every rank's are in (meta.json, manifest and checksums,
  /// a durable rename), as a synchronous save does. At most one save is in flight per rank: the
  /// next report with a checkpoint waits for it first and says how long in its
  /// "checkpoint_wait_s" metric (beside "checkpoint_snapshot_s", the time the step stood still to
  /// copy). A crash or kill before the commit leaves the previous checkpoint the latest; a failed
  /// write fails the next report, or the loop's end, naming the rank.
  bool async = false;
  /// With async, when a save is still in flight on some rank: true skips this checkpoint (the
  /// report goes without one, its metrics gain "checkpoint_skipped": true) rather than waiting for
  /// that save. Every rank decides alike (one small all-reduce). Snapshots are never skipped.
  bool skip_when_busy = false;
};

/// The checkpoint to resume from: the run's latest valid one when this run continues an earlier
/// one with the same storage path and name (RunConfig::resume), else none.
std::optional<Checkpoint> get_checkpoint();

/// A lightweight, unrecorded progress update for the driver's progress bar, e.g.
/// {{"label", "epoch 1/5"}, {"step", 120}, {"total", 469}, {"loss", 0.41}, {"samples_per_s",
/// 2400}}. Only rank 0's are shown; calls are rate-limited here, so calling every step is cheap.
void report_progress(const Json& progress);

/// Step-level metrics for the charts, between reports: call it on every rank after every
/// optimizer step, with that step's number (from 1) and a function that makes the metrics, e.g.
///   train::log_step(step, [&] { return Json{{"train_loss", `loss.item<double>()}}`; });
/// For the steps RunConfig::log_every_steps picks, rank 0 calls `metrics` and adds "step_time_ms"
/// (the median time between its calls since the last logged step, so an evaluation between two
/// steps does not count); the driver appends the record, with "step" and "timestamp", to
/// `<run>/steps.jsonl` and to TensorBoard as `"step/<metric>"` scalars, and the dashboard draws
/// them. Every other call returns at once without calling `metrics`; no collective, no wait.
void log_step(int64_t step, const std::function<Json()>& metrics);

/// Whether the run was asked to stop: true on every rank alike once any rank received a stop
/// request (the first Ctrl-C of the driver, or runtime::kStopRequestSignal). A collective: every
/// rank calls it at the same points, e.g. after each step; the loop then reports a checkpoint and
/// returns, and the Result says `interrupted`. A loop that calls it tells the driver that it
/// honours requests: from then on the first Ctrl-C asks instead of stopping the workers at once
/// (a second one still does). Costs one all-reduce of one number.
bool should_stop();

/// Waits until every rank got here (within the collective timeout).
void barrier();

/// Rank 0's `value` on every rank (the others' argument is ignored).
Json broadcast_from_rank_zero(const Json& value);

}  // namespace cohort::train

#pragma once
#include "cohort/json.h"

namespace cohort::train {

// Reports metrics for this iteration (Ray Train's report). Every rank calls it at the same
// points; the driver keeps rank 0's metrics (metrics.jsonl, Result) and prints them.
void report(const Json& metrics);

// A lightweight, unrecorded progress update for the driver's progress bar, e.g.
// {{"label", "epoch 1/5"}, {"step", 120}, {"total", 469}, {"loss", 0.41}, {"samples_per_s", 2400}}.
// Only rank 0's are shown; calls are rate-limited here, so calling every step is cheap.
void report_progress(const Json& progress);

}  // namespace cohort::train

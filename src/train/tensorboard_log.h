// What a run writes to TensorBoard (RunConfig::tensorboard): its reports as scalars, rank 0's
// histograms, the config as text and the hparams plugin's session. Kept by the RunRecorder.
#pragma once
#include <filesystem>

#include "cohort/json.h"
#include "cohort/train/config.h"
#include "cohort/train/summary_writer.h"

namespace cohort::train {

inline constexpr const char* kTensorBoardDir = "tensorboard";

class TensorBoardLog {
 public:
  // A new event file under <run_dir>/tensorboard/. `fresh`: the run starts from nothing (the
  // config and the hparams session start are written once, not again by a resumed run).
  TensorBoardLog(const std::filesystem::path& run_dir, const TensorBoardConfig& config,
                 const Json& loop_config, bool fresh);
  // A committed report: `record` as metrics.jsonl holds it; `histograms`: tag -> histogram JSON
  // (histogram_to_json), or null.
  void on_report(const Json& record, const Json& histograms);
  // A train::log_step's metrics as "step/<metric>" scalars at `step`.
  void on_step(int64_t step, const Json& metrics);
  void on_finish(bool ok);

 private:
  SummaryWriter writer_;
  bool session_;
};

// A histogram as a report carries it from rank 0 to the driver.
Json histogram_to_json(const Histogram& histogram);
Histogram histogram_from_json(const Json& json);

}  // namespace cohort::train

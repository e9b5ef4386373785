#include "train/tensorboard_log.h"

#include <cmath>

namespace cohort::train {

namespace {

// The record's bookkeeping fields, which are no metrics.
bool is_bookkeeping(const std::string& key) {
  return key == "training_iteration" || key == "timestamp" || key == "checkpoint";
}

void add_scalars(SummaryWriter& writer, const std::string& prefix, const Json& values,
                 int64_t step) {
  for (const auto& [key, value] : values.items()) {
    if (prefix.empty() && is_bookkeeping(key)) continue;
    const std::string tag = prefix.empty() ? key : prefix + "/" + key;
    if (value.is_object()) {
      add_scalars(writer, tag, value, step);
    } else if (value.is_number() && std::isfinite(value.get<double>())) {
      writer.add_scalar(tag, value.get<double>(), step);
    }
  }
}

}  // namespace

TensorBoardLog::TensorBoardLog(const std::filesystem::path& run_dir,
                               const TensorBoardConfig& config, const Json& loop_config, bool fresh)
    : writer_(run_dir / kTensorBoardDir), session_(!config.hparams.empty()) {
  if (fresh) {
    writer_.add_text("config", "```\n" + loop_config.dump(2) + "\n```", 0);
    if (session_) writer_.add_hparams_session_start(config.hparams);
  }
  writer_.flush();
}

void TensorBoardLog::on_report(const Json& record, const Json& histograms) {
  const int64_t step = record.value("training_iteration", int64_t{0});
  add_scalars(writer_, "", record, step);
  if (histograms.is_object()) {
    for (const auto& [tag, histogram] : histograms.items())
      writer_.add_histogram(tag, histogram_from_json(histogram), step);
  }
  writer_.flush();
}

void TensorBoardLog::on_step(int64_t step, const Json& metrics) {
  add_scalars(writer_, "step", metrics, step);
  writer_.flush();
}

void TensorBoardLog::on_finish(bool ok) {
  if (session_)
    writer_.add_hparams_session_end(ok ? SessionStatus::kSuccess : SessionStatus::kFailure);
  writer_.flush();
}

Json histogram_to_json(const Histogram& h) {
  return Json{{"min", h.min},
              {"max", h.max},
              {"num", h.num},
              {"sum", h.sum},
              {"sum_squares", h.sum_squares},
              {"bucket_limit", h.bucket_limit},
              {"bucket", h.bucket}};
}

Histogram histogram_from_json(const Json& json) {
  Histogram h;
  h.min = json.at("min").get<double>();
  h.max = json.at("max").get<double>();
  h.num = json.at("num").get<double>();
  h.sum = json.at("sum").get<double>();
  h.sum_squares = json.at("sum_squares").get<double>();
  h.bucket_limit = json.at("bucket_limit").get<std::vector<double>>();
  h.bucket = json.at("bucket").get<std::vector<double>>();
  return h;
}

}  // namespace cohort::train

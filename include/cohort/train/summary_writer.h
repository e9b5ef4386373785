/// \file
/// TensorBoard event files, written and read back without TensorFlow (PyTorch's SummaryWriter):
/// scalars, histograms, text and the hparams plugin's records. A run writes them under
/// `<run>/tensorboard/` (RunConfig::tensorboard); `tensorboard --logdir <storage_path>` shows them.
///
/// The file format: TFRecord framing (a little-endian uint64 length, its masked CRC-32C, the
/// bytes, their masked CRC-32C) around tensorflow.Event protocol-buffer messages, encoded here.
#pragma once
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "cohort/json.h"

namespace at {
class Tensor;
}

namespace cohort::train {

/// A histogram as TensorBoard's HistogramProto holds it: bucket i counts the values in
/// (bucket_limit[i-1], bucket_limit[i]].
struct Histogram {
  double min = 0;                    ///< the smallest value
  double max = 0;                    ///< the largest value
  double num = 0;                    ///< how many values
  double sum = 0;                    ///< their sum
  double sum_squares = 0;            ///< the sum of their squares
  std::vector<double> bucket_limit;  ///< upper bounds of the buckets
  std::vector<double> bucket;        ///< counts of the buckets
  /// Of a tensor's finite values (nan and inf are left out) in `bins` equal buckets from min to
  /// max. An empty tensor gives an empty histogram.
  static Histogram of(const at::Tensor& values, int bins = 30);
};

/// A session's end, for the hparams plugin's table.
enum class SessionStatus { kUnknown = 0, kSuccess = 1, kFailure = 2, kRunning = 3 };

/// Writes one event file. TensorBoard merges the files of one folder into one run but expects a
/// single writer per folder at a time: give each writer its own `log_dir`.
class SummaryWriter {
 public:
  /// Creates `log_dir` and a new file in it, `events.out.tfevents.<seconds>.<host>.<pid>.<n>`,
  /// starting with the file-version event. A folder that cannot be written is a UsageError.
  explicit SummaryWriter(const std::filesystem::path& log_dir);
  ~SummaryWriter();
  SummaryWriter(const SummaryWriter&) = delete;
  SummaryWriter& operator=(const SummaryWriter&) = delete;

  /// A scalar `value` of `tag` at `step`.
  void add_scalar(const std::string& tag, double value, int64_t step);
  /// A histogram of `tag` at `step`.
  void add_histogram(const std::string& tag, const Histogram& histogram, int64_t step);
  /// A histogram of `values` (30 buckets over their range) of `tag` at `step`.
  void add_histogram(const std::string& tag, const at::Tensor& values, int64_t step);
  /// Markdown, shown by TensorBoard's Text tab.
  void add_text(const std::string& tag, const std::string& markdown, int64_t step);

  /// The hparams plugin. An experiment (its hyperparameters with their domains, its metrics) is
  /// written once, in a folder of its own or one of the sessions'; each session (a Tune trial, in
  /// its own folder) writes its start with its hyperparameter values and, at the end, its status.
  /// `hparams`: name -> number, string or bool (other JSON values are written as their text).
  /// `domains`: name -> {"values": [...]} or {"min": a, "max": b}; names without one get none.
  void add_hparams_experiment(const Json& domains, const std::vector<std::string>& metrics);
  /// The hparams plugin's session start: this trial's parameter values (a Tune trial's).
  void add_hparams_session_start(const Json& hparams, const std::string& group_name = "");
  /// The hparams plugin's session end: how the trial ended.
  void add_hparams_session_end(SessionStatus status);

  /// Events are buffered; flush() puts them in the file (TensorBoard reads what is there).
  void flush();
  /// The event file written.
  const std::filesystem::path& path() const { return path_; }

 private:
  void write_event(const std::string& event);
  std::filesystem::path path_;
  std::ofstream out_;
};

/// One decoded event of an event file: the file version or a summary value.
struct SummaryEvent {
  /// What the event holds.
  enum class Kind { kFileVersion, kScalar, kHistogram, kText, kPlugin };
  Kind kind = Kind::kPlugin;  ///< this event's kind
  double wall_time = 0;       ///< seconds since the Unix epoch
  int64_t step = 0;           ///< the step it was written at
  /// The summary value's tag; for kFileVersion the version ("brain.Event:2").
  std::string tag;
  double scalar = 0;    ///< kScalar's value
  Histogram histogram;  ///< kHistogram's histogram
  std::string text;     ///< kText's text
  /// The summary's plugin ("hparams", "text", ...) and its content bytes.
  std::string plugin;
  std::string plugin_content;  ///< kPlugin's content (the hparams plugin's serialized protobuf)
};

/// Reads an event file whole, checking both CRCs of every record. A file cut inside a record or a
/// record whose bytes do not match their CRC is a UsageError naming the file and the record's
/// byte offset.
std::vector<SummaryEvent> read_events(const std::filesystem::path& file);

/// The event files of a folder, oldest first.
std::vector<std::filesystem::path> event_files(const std::filesystem::path& log_dir);

}  // namespace cohort::train

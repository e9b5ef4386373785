/// \file
/// The flags of a program's labelled data: one call gives it cohort train's --data (images:DIR,
/// csv:FILE, text:FILE, random-tokens:ROWS, mnist:DIR), --dataset and --data-dir (MNIST-format
/// files), --label, --image-size, --test-size, --train-examples, --test-examples and
/// --data-workers, with their help and defaults; then the Trainer's dataset and the test set come
/// from the same options on the driver and on every worker:
///
///   cohort::cli::DataOptions data_options;
///   cohort::cli::add_data_options(&app, data_options);
///   CLI11_PARSE(app, argc, argv);
///   const auto data = data_options.open(seed);   // UsageError naming the flag and the fix
///   cohort::Trainer trainer(loop, scaling, run, {{"data", data_options}, ...},
///                           data_options.datasets(data, seed));
///   // in the loop, on every worker:
///   const auto options = config["data"].get<cohort::cli::DataOptions>();
///   loop.test_set = options.test_set(options.open(seed));
///
/// Needs CLI11 (Debian's libcli11-dev), as <cohort/cli/plan_options.h>.
#pragma once
#include <cstdint>
#include <map>
#include <string>

#include <CLI/CLI.hpp>

#include "cohort/data/dataset.h"
#include "cohort/data/labelled_data.h"
#include "cohort/data/tensor_dataset.h"
#include "cohort/json.h"

namespace cohort::cli {

/// The data as flags name it: the user's own (--data) or MNIST-format files (--dataset,
/// --data-dir), how it is read and how much of it is used.
struct DataOptions {
  std::string dataset = "fashion-mnist";  ///< --dataset: fashion-mnist or mnist (MNIST-format)
  std::string data_dir;  ///< --data-dir: the IDX files' folder (fashion-mnist: Debian's)
  /// --data images:DIR | csv:FILE | text:FILE | random-tokens:ROWS | mnist:DIR
  /// (data::open_labelled_data); empty: --dataset and --data-dir.
  std::string data;
  std::string label;                                            ///< --label: a CSV's class column
  int64_t image_size = data::LabelledDataOptions{}.image_size;  ///< --image-size
  double test_size = data::LabelledDataOptions{}.test_size;     ///< --test-size
  int64_t train_examples = 0;  ///< --train-examples: the first N training rows only; 0: all
  int64_t test_examples = 0;   ///< --test-examples: the first N test rows only; 0: all
  /// --data-workers: preprocessing processes per worker; 0: its prefetch thread; -1: one per CPU
  /// the workers leave free.
  int data_workers = 0;

  /// What the flags name, as data::open_labelled_data reads it: --data, or mnist:DIR of --dataset
  /// and --data-dir. UsageError naming a bad flag, flags that conflict or a dataset without a
  /// folder.
  std::string spec() const;
  /// Whether the data is a language model's tokens (text:FILE or random-tokens:ROWS).
  bool is_text() const;
  /// Opens the data the flags name (spec(); data::open_labelled_data, its test split drawn with
  /// `seed`, text in rows of `context` tokens; its input_column and target_column name what a
  /// batch holds): UsageError naming the flag and the fix.
  data::LabelledData open(uint64_t seed,
                          int64_t context = data::LabelledDataOptions{}.context) const;
  /// The training rows a run reads: the train split's, at most --train-examples.
  int64_t train_rows(const data::LabelledData& data) const;
  /// The Trainer datasets: "train", the train split (its first --train-examples rows) shuffled
  /// with `seed` and normalised in batches by --data-workers processes.
  std::map<std::string, data::Dataset> datasets(const data::LabelledData& data,
                                                uint64_t seed) const;
  /// The test split normalised in memory (its first --test-examples rows), a loop's test set.
  data::TensorDataset test_set(const data::LabelledData& data) const;
};

/// The options as JSON (e.g. in a Trainer's train_loop_config, for the workers) and back; a
/// missing key keeps its default, a value of the wrong type is a UsageError naming it.
void to_json(Json& json, const DataOptions& options);
/// DataOptions from JSON (see to_json).
void from_json(const Json& json, DataOptions& options);

/// Adds the data's flags to `cmd`, in the group "Model and data".
void add_data_options(CLI::App* cmd, DataOptions& options);

}  // namespace cohort::cli

#pragma once
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <c10/core/Device.h>

#include "cohort/comm/job_secret.h"
#include "cohort/data/block.h"
#include "cohort/data/mnist.h"
#include "cohort/timeouts.h"

namespace cohort::data {

class DataIterator;

/// What a stage does with a batch it cannot process (a map function that throws) or a source with
/// a row it cannot read (an unreadable image file).
enum class OnError {
  kFail,  ///< the run fails with an error naming the stage, the batch and its row ids
  kSkip,  ///< the batch (or row) is dropped and counted; the count is printed at the end
};

/// A stage's function: a batch of rows in, a batch of rows out (rows may be added or dropped).
using BatchFn = std::function<Block(Block)>;
/// Returns a bool tensor with one entry per row: true keeps the row.
using RowPredicate = std::function<at::Tensor(const Block&)>;

/// How a map_batches stage runs: its name, rows per call, workers and what an error does.
struct MapBatchesOptions {
  /// Names the stage in errors, logs and the pipeline's fingerprint: give stages distinct names.
  std::string name = "map_batches";
  /// Rows per call of the function (fewer at the end of a task, or after a filter).
  int64_t batch_size = 32;
  /// Preprocessing processes (this program re-executed in the "data" role). 0: in the consuming
  /// process, on its prefetch thread. -1: one per CPU not used by trainers
  /// (default_data_workers()). The pipeline runs with the most any of its stages asks for: stages
  /// are fused into one task.
  int num_workers = 0;
  OnError on_error = OnError::kFail;  ///< what an exception of the function does: fail the run, or
                                      ///< skip the batch and count it
};

/// How a dataset's pipeline runs: the task window, task sizes, remote workers and restarts.
struct ExecutionOptions {
  /// Tasks handed out or finished but not yet consumed, at most: this bounds memory whatever the
  /// dataset's length. 0: twice the number of workers, plus one.
  int max_tasks_in_flight = 0;
  /// Rows per task when no map stage sets it (a task runs every stage on its rows).
  int64_t rows_per_task = 256;
  /// Preprocessing workers on other hosts connect to this "host:port" (a port of 0 picks one,
  /// see DataIterator::listen_address). Empty: none.
  std::string listen_address;
  /// Wait for this many remote workers before the first task (they add to the local ones).
  int remote_workers = 0;
  /// What every worker, local or remote, proves it holds before the pipeline's consumer parses a
  /// byte it sends (comm/job_secret.h). Empty: the job's (COHORT_JOB_SECRET, which a Trainer's
  /// workers have), else a fresh one that only this process's local workers get.
  comm::JobSecret secret;
  /// Deadline for a worker to start and connect.
  std::chrono::milliseconds worker_start_timeout = kDefaultDataMessageTimeout;
  /// A task that runs longer than this hangs: its worker is dropped (a local one killed and
  /// replaced, counting against max_worker_restarts, with a message naming it and the task) and
  /// the task goes to another worker.
  std::chrono::milliseconds task_timeout = kDefaultDataTaskTimeout;
  /// Replacements started for workers that died, in all, before the run fails.
  int max_worker_restarts = 8;
  /// Once every task of an epoch is handed out, workers with room in the window start on the
  /// next epoch's tasks, so its first batches are ready when the consumer begins it (an epoch
  /// the consumer then skips, with set_epoch, costs that work). materialize(), count() and take()
  /// never do.
  bool prefetch_next_epoch = true;
};

/// How iter_batches() batches: size, prefetch, device and local shuffle.
struct IterBatchesOptions {
  int64_t batch_size = 32;  ///< rows per batch
  /// Batches prepared ahead of the consumer.
  int prefetch_batches = 2;
  c10::Device device = c10::Device(c10::DeviceType::CPU);  ///< the device batches are copied to
  /// Rows mixed in a buffer of this size before batching (0: no local shuffle); seeded by
  /// local_shuffle_seed and the epoch, so runs repeat.
  int64_t local_shuffle_buffer_size = 0;
  uint64_t local_shuffle_seed = 0;  ///< seeds the local shuffle (with the epoch)
  bool drop_last = false;           ///< drop the last, short batch
};

/// What Dataset::synthetic_images() makes: the images' size, the classes and the seed.
struct SyntheticImageOptions {
  int64_t height = 224;      ///< image height
  int64_t width = 224;       ///< image width
  int64_t channels = 3;      ///< channels
  int64_t num_classes = 10;  ///< labels drawn from 0 to num_classes - 1
  uint64_t seed = 0;         ///< seeds the pixels and labels (per row id)
};

/// How read_csv() parses: the label column and the delimiter.
struct CsvOptions {
  /// The column that becomes "label" (int64); the other columns become "features" (float32).
  /// Empty: every column is a feature.
  std::string label_column;
  char delimiter = ',';  ///< the field separator
};

/// How read_images() decodes: the size images are resized to, gray or color, bad files.
struct ImageFolderOptions {
  /// Every image is resized to this size (0: keep; then all images must have the same size).
  int64_t height = 0;
  int64_t width = 0;       ///< the width images are resized to (0: keep)
  bool grayscale = false;  ///< decode to one channel
  /// A file OpenCV cannot decode: fail naming it, or skip it and count it.
  OnError on_bad_file = OnError::kFail;
};

/// A lazily evaluated, streaming dataset (Ray Data's Dataset): a source of rows, then the order
/// operations (random_shuffle, split, shard) and the stages (map_batches, filter). Nothing runs
/// until it is iterated. Every operation returns a new Dataset; copies are cheap.
///
/// Order operations act on the order in which source rows are read, wherever they are called in
/// the chain; stages act on rows in that order. Execution cuts the rows into tasks, runs every
/// stage of a task in one place (inline, or a preprocessing worker), and hands tasks out in order,
/// so the batches a consumer sees do not depend on how many workers ran.
class Dataset {
 public:
  Dataset();  ///< empty

  /// Columns of equal length. An "id" column is used as the row ids if present.
  static Dataset from_tensors(std::map<std::string, at::Tensor> columns);
  /// An MNIST-format pair of IDX files in `dir` ((t10k|train)-images-idx3-ubyte[.gz], ...):
  /// "image" uint8 [N, 1, H, W] and "label" int64.
  static Dataset from_mnist(const std::filesystem::path& dir, Split split);
  /// Row i is a random uint8 image [C, H, W] and a label, both functions of (seed, i) only.
  static Dataset synthetic_images(int64_t rows, SyntheticImageOptions options = {});
  /// Numeric CSV with a header line. Throws UsageError naming the file, line and column of a value
  /// that is not a number.
  static Dataset read_csv(const std::filesystem::path& path, CsvOptions options = {});
  /// Images in the sub-folders of `dir` (PNG, JPEG, ...), decoded with OpenCV: "image" uint8
  /// [C, H, W], "label" the index of the sub-folder's name in sorted order (class_names()).
  static Dataset read_images(const std::filesystem::path& dir, ImageFolderOptions options = {});

  /// Adds a stage that runs `fn` over batches of rows (Ray Data's map_batches), in the consuming
  /// process or in preprocessing workers (options.num_workers).
  Dataset map_batches(BatchFn fn, MapBatchesOptions options = {}) const;
  /// Adds a stage that keeps the rows where `predicate` is true.
  Dataset filter(RowPredicate predicate, std::string name = "filter") const;
  /// A seeded permutation of the rows; a DataIterator draws a new one each epoch (set_epoch).
  Dataset random_shuffle(uint64_t seed) const;
  /// `n` parts of equal length (the remainder of rows dropped), in the current order.
  std::vector<Dataset> split(int n) const;
  /// Part `index` of `count` strided parts of equal length (the remainder dropped).
  Dataset shard(int index, int count) const;
  /// The first `rows` rows in the current order.
  Dataset limit(int64_t rows) const;
  /// Ray Data's train_test_split: {train, test}, test holding `test_size` (0 < test_size < 1) of
  /// the rows (rounded, at least 1 and at most all but 1), drawn with `shuffle_seed`, or the last
  /// rows without one. The parts are the same in every epoch and process, disjoint, and together
  /// every row; each keeps the rows in their current order (shuffle the train part per epoch
  /// with random_shuffle after the split).
  std::pair<Dataset, Dataset> train_test_split(
      double test_size, std::optional<uint64_t> shuffle_seed = std::nullopt) const;
  /// Runs the pipeline once and keeps the result in memory: a new source.
  Dataset materialize() const;
  /// The same pipeline run with `options`.
  Dataset with_execution(ExecutionOptions options) const;

  /// Rows the source yields after the order operations, before any stage.
  int64_t num_source_rows() const;
  /// Rows after every stage: runs the pipeline unless it has no stage.
  int64_t count() const;
  /// Runs the pipeline, returns the first `rows` rows (all with -1).
  Block take(int64_t rows = -1) const;
  /// Of read_images: the label names, in label order.
  const std::vector<std::string>& class_names() const;
  /// Identifies the pipeline's structure (source, order operations, stages by kind and name); a
  /// preprocessing worker serves the pipeline with the same fingerprint.
  std::string fingerprint() const;
  /// One line for logs: the source, its rows and the stages.
  std::string describe() const;
  /// Preprocessing processes the pipeline runs with (after resolving -1).
  int num_workers() const;
  /// Whether it has a map_batches stage (work that preprocessing workers can take).
  bool has_map_stage() const;
  /// How the pipeline runs.
  const ExecutionOptions& execution() const;

  /// A stream over this dataset that keeps its preprocessing workers between epochs.
  DataIterator iterator() const;

  struct Plan;
  /// The pipeline's structure (for the data layer's own use).
  const Plan& plan() const { return *plan_; }

 private:
  explicit Dataset(std::shared_ptr<const Plan> plan);
  std::shared_ptr<const Plan> plan_;
};

/// The number of preprocessing workers `num_workers = -1` stands for: set by the Trainer in each
/// worker to the CPUs its trainers leave free, shared among the ranks of the host; otherwise the
/// CPUs of this host less one. At least 1.
int default_data_workers();
/// Overrides default_data_workers() for this process (the Trainer's worker does).
void set_default_data_workers(int workers);

/// The epoch of the task the calling thread runs, for seeded random preprocessing (0 outside one).
int64_t current_epoch();

}  // namespace cohort::data

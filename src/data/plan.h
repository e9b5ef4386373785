// The inside of a Dataset: its source, order operations and stages, and the function that runs
// one task. Shared by the inline executor, the worker pool and the preprocessing workers.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cohort/data/dataset.h"

namespace cohort::data {

// Rows by index; reads may run on several threads at once.
class Source {
 public:
  virtual ~Source() = default;
  virtual int64_t size() const = 0;
  // The rows at `rows` (source indices), with an "id" column. Rows it cannot read are left out
  // and counted in `skipped` when the source's policy says so; otherwise it throws.
  virtual Block read(const std::vector<int64_t>& rows, int64_t& skipped) const = 0;
  // Kind and parameters, for the fingerprint.
  virtual std::string describe() const = 0;
  virtual const std::vector<std::string>& class_names() const;
  // Whether read() may leave rows out (then the row count is known only once read).
  virtual bool may_skip() const { return false; }
};

struct OrderOp {
  enum Kind { kShuffle, kSplit, kShard, kLimit, kTrainTestSplit } kind;
  uint64_t seed = 0;  // kShuffle; kTrainTestSplit when shuffled
  int index = 0;      // kSplit, kShard; kTrainTestSplit: 0 the train part, 1 the test part
  int count = 1;
  int64_t rows = 0;       // kLimit
  double test_size = 0;   // kTrainTestSplit: the test part's fraction of the rows
  bool shuffled = false;  // kTrainTestSplit: test rows drawn with `seed`, else the last ones
};

struct Stage {
  enum Kind { kMap, kFilter } kind;
  std::string name;
  BatchFn fn;
  RowPredicate predicate;
  MapBatchesOptions options;
};

struct Dataset::Plan {
  std::shared_ptr<const Source> source;
  std::vector<OrderOp> order;
  std::vector<Stage> stages;
  ExecutionOptions execution;
};

// The source rows of `epoch`, in order, after the order operations; a resumed epoch's leave out
// the first `unsharded_rows` of the order before the last shard() (of all, without one).
std::vector<int64_t> epoch_rows(const Dataset::Plan& plan, int64_t epoch,
                                int64_t unsharded_rows = 0);
// Those rows, less the first `own_rows` of them, cut into tasks.
std::vector<std::vector<int64_t>> epoch_tasks(const Dataset::Plan& plan, int64_t epoch,
                                              int64_t unsharded_rows = 0, int64_t own_rows = 0);
// Whether every source row becomes one row: no filter stage and a source that skips no row
// (map_batches functions are taken to return as many rows as they get).
bool keeps_rows(const Dataset::Plan& plan);
int64_t rows_per_task(const Dataset::Plan& plan);

struct TaskResult {
  int64_t index = 0;
  Block block;
  int64_t skipped_rows = 0;
  int64_t skipped_batches = 0;
  std::string error;  // set: the task failed and the run must fail with this message
};

// Reads the task's rows and runs every stage on them. Errors of a stage with OnError::kFail come
// back in `error`, naming the stage, the batch and its row ids.
TaskResult run_task(const Dataset::Plan& plan, int64_t index, const std::vector<int64_t>& rows,
                    int64_t epoch);

}  // namespace cohort::data

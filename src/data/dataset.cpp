#include "cohort/data/dataset.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <numeric>
#include <random>
#include <thread>

#include "cohort/data/data_iterator.h"
#include "cohort/error.h"
#include "cohort/hash.h"
#include "data/plan.h"
#include "data/sources.h"

namespace cohort::data {

namespace {

std::atomic<int> g_default_workers{0};
thread_local int64_t t_epoch = 0;

std::string describe_ids(const at::Tensor& column) {
  if (!column.defined() || column.numel() == 0) return "no ids";
  auto ids = column.to(at::kLong).contiguous();
  const auto* p = ids.data_ptr<int64_t>();
  const int64_t n = ids.numel();
  if (n <= 8) {
    std::string out = "ids ";
    for (int64_t i = 0; i < n; ++i) out += (i ? "," : "") + std::to_string(p[i]);
    return out;
  }
  return "ids " + std::to_string(p[0]) + ".." + std::to_string(p[n - 1]);
}

at::Tensor ids_of(const Block& block) {
  return block.has(kIdColumn) ? block[kIdColumn] : at::Tensor();
}

// Runs one map stage over `block` in batches of its batch_size.
Block run_map(const Stage& stage, size_t position, const Block& block, int64_t task, int64_t epoch,
              TaskResult& result) {
  const int64_t rows = block.num_rows();
  const int64_t size = std::max<int64_t>(1, stage.options.batch_size);
  std::vector<Block> outputs;
  for (int64_t start = 0; start < rows; start += size) {
    Block input = block.slice(start, std::min(size, rows - start));
    const auto ids = ids_of(input);
    const int64_t input_rows = input.num_rows();  // the function may consume its input
    try {
      Block output = stage.fn(std::move(input));
      if (!output.has(kIdColumn) && ids.defined()) {
        if (output.num_rows() != ids.size(0)) {
          throw UsageError("it returned " + std::to_string(output.num_rows()) + " rows for " +
                           std::to_string(ids.size(0)) + " without an '" + kIdColumn +
                           "' column: a function that changes the number of rows must keep the ids "
                           "of the rows it returns");
        }
        output.columns[kIdColumn] = ids;
      }
      output.check("the batch it returned");
      outputs.push_back(std::move(output));
    } catch (const std::exception& e) {
      if (stage.options.on_error == OnError::kSkip) {
        ++result.skipped_batches;
        continue;
      }
      result.error = "stage '" + stage.name + "' (#" + std::to_string(position + 1) +
                     ", map_batches) on a batch of " + std::to_string(input_rows) + " rows (" +
                     describe_ids(ids) + "; task " + std::to_string(task) + ", epoch " +
                     std::to_string(epoch) + ") failed: " + e.what();
      return {};
    }
  }
  if (outputs.empty()) return block.slice(0, 0);
  return Block::concat(outputs);
}

}  // namespace

int64_t current_epoch() { return t_epoch; }

int default_data_workers() {
  const int set = g_default_workers.load();
  if (set > 0) return set;
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()) - 1);
}

void set_default_data_workers(int workers) { g_default_workers = std::max(1, workers); }

const std::vector<std::string>& Source::class_names() const {
  static const std::vector<std::string> none;
  return none;
}

namespace {

// The rows of a train_test_split's test part, of `rows`: at least 1 and at most rows - 1 from 2
// rows on; none of fewer.
int64_t test_rows(int64_t rows, double test_size) {
  if (rows < 2) return 0;
  const auto wanted = static_cast<int64_t>(std::llround(static_cast<double>(rows) * test_size));
  return std::clamp<int64_t>(wanted, 1, rows - 1);
}

// One part of a train/test split of `rows`. The same in every epoch and process (the seed alone
// draws the test rows), and each part keeps the rows in their order before the split.
std::vector<int64_t> train_test_part(std::vector<int64_t> rows, const OrderOp& op) {
  const auto n = static_cast<int64_t>(rows.size());
  const int64_t test = test_rows(n, op.test_size);
  std::vector<char> in_test(rows.size(), 0);
  if (op.shuffled) {
    std::vector<int64_t> positions(rows.size());
    std::iota(positions.begin(), positions.end(), int64_t{0});
    std::mt19937_64 engine(op.seed * 0x9E3779B97F4A7C15ULL + 0x5851F42D4C957F2DULL);
    // The first `test` places of a partial Fisher-Yates shuffle.
    for (int64_t i = 0; i < test; ++i) {
      const auto j = i + static_cast<int64_t>(engine() % static_cast<uint64_t>(n - i));
      std::swap(positions[static_cast<size_t>(i)], positions[static_cast<size_t>(j)]);
      in_test[static_cast<size_t>(positions[static_cast<size_t>(i)])] = 1;
    }
  } else {
    std::fill(in_test.end() - test, in_test.end(), 1);
  }
  std::vector<int64_t> part;
  part.reserve(static_cast<size_t>(op.index == 1 ? test : n - test));
  for (size_t k = 0; k < rows.size(); ++k) {
    if (in_test[k] == op.index) part.push_back(rows[k]);
  }
  return part;
}

}  // namespace

std::vector<int64_t> epoch_rows(const Dataset::Plan& plan, int64_t epoch, int64_t unsharded_rows) {
  std::vector<int64_t> rows(static_cast<size_t>(plan.source ? plan.source->size() : 0));
  std::iota(rows.begin(), rows.end(), int64_t{0});
  size_t last_shard = plan.order.size();
  for (size_t i = 0; i < plan.order.size(); ++i)
    if (plan.order[i].kind == OrderOp::kShard) last_shard = i;
  const auto leave_out_consumed = [&] {
    const auto n = std::min<int64_t>(unsharded_rows, static_cast<int64_t>(rows.size()));
    if (n > 0) rows.erase(rows.begin(), rows.begin() + static_cast<std::ptrdiff_t>(n));
  };
  for (size_t i = 0; i < plan.order.size(); ++i) {
    const auto& op = plan.order[i];
    if (i == last_shard) leave_out_consumed();
    const auto n = static_cast<int64_t>(rows.size());
    switch (op.kind) {
      case OrderOp::kShuffle: {
        // Fisher-Yates with mt19937_64 (fully specified by the standard): the same order
        // everywhere.
        std::mt19937_64 engine(op.seed * 0x9E3779B97F4A7C15ULL + static_cast<uint64_t>(epoch) + 1);
        for (int64_t i = n - 1; i > 0; --i) {
          const auto j = static_cast<int64_t>(engine() % static_cast<uint64_t>(i + 1));
          std::swap(rows[static_cast<size_t>(i)], rows[static_cast<size_t>(j)]);
        }
        break;
      }
      case OrderOp::kSplit: {
        const int64_t per = n / op.count;
        rows = std::vector<int64_t>(rows.begin() + op.index * per,
                                    rows.begin() + (op.index + 1) * per);
        break;
      }
      case OrderOp::kLimit:
        if (n > op.rows) rows.resize(static_cast<size_t>(op.rows));
        break;
      case OrderOp::kTrainTestSplit:
        rows = train_test_part(std::move(rows), op);
        break;
      case OrderOp::kShard: {
        const int64_t per = n / op.count;
        std::vector<int64_t> part;
        part.reserve(static_cast<size_t>(per));
        for (int64_t k = 0; k < per; ++k)
          part.push_back(rows[static_cast<size_t>(k * op.count + op.index)]);
        rows = std::move(part);
        break;
      }
    }
  }
  if (last_shard == plan.order.size()) leave_out_consumed();
  return rows;
}

bool keeps_rows(const Dataset::Plan& plan) {
  if (plan.source && plan.source->may_skip()) return false;
  return std::none_of(plan.stages.begin(), plan.stages.end(),
                      [](const Stage& stage) { return stage.kind == Stage::kFilter; });
}

int64_t rows_per_task(const Dataset::Plan& plan) {
  for (const auto& stage : plan.stages) {
    if (stage.kind == Stage::kMap) return std::max<int64_t>(1, stage.options.batch_size);
  }
  return std::max<int64_t>(1, plan.execution.rows_per_task);
}

std::vector<std::vector<int64_t>> epoch_tasks(const Dataset::Plan& plan, int64_t epoch,
                                              int64_t unsharded_rows, int64_t own_rows) {
  auto rows = epoch_rows(plan, epoch, unsharded_rows);
  own_rows = std::clamp<int64_t>(own_rows, 0, static_cast<int64_t>(rows.size()));
  rows.erase(rows.begin(), rows.begin() + static_cast<std::ptrdiff_t>(own_rows));
  const auto per = static_cast<size_t>(rows_per_task(plan));
  std::vector<std::vector<int64_t>> tasks;
  for (size_t start = 0; start < rows.size(); start += per) {
    tasks.emplace_back(
        rows.begin() + static_cast<std::ptrdiff_t>(start),
        rows.begin() + static_cast<std::ptrdiff_t>(std::min(rows.size(), start + per)));
  }
  return tasks;
}

TaskResult run_task(const Dataset::Plan& plan, int64_t index, const std::vector<int64_t>& rows,
                    int64_t epoch) {
  TaskResult result;
  result.index = index;
  const int64_t saved_epoch = t_epoch;
  t_epoch = epoch;
  struct Restore {
    int64_t value;
    ~Restore() { t_epoch = value; }
  } restore{saved_epoch};
  Block block;
  try {
    block = plan.source->read(rows, result.skipped_rows);
  } catch (const std::exception& e) {
    result.error = "reading the rows of task " + std::to_string(index) + " (epoch " +
                   std::to_string(epoch) + ") from " + plan.source->describe() +
                   " failed: " + e.what();
    return result;
  }
  for (size_t s = 0; s < plan.stages.size(); ++s) {
    const auto& stage = plan.stages[s];
    if (stage.kind == Stage::kMap) {
      block = run_map(stage, s, block, index, epoch, result);
      if (!result.error.empty()) return result;
      continue;
    }
    try {
      auto mask = stage.predicate(block);
      if (mask.scalar_type() != at::kBool || mask.dim() != 1 || mask.size(0) != block.num_rows()) {
        throw UsageError("the predicate must return a bool tensor of shape [" +
                         std::to_string(block.num_rows()) + "], got " +
                         std::string(mask.toString()) + " of " + std::to_string(mask.dim()) +
                         " dimensions");
      }
      block = block.take(mask);
    } catch (const std::exception& e) {
      result.error = "stage '" + stage.name + "' (#" + std::to_string(s + 1) + ", filter) on " +
                     std::to_string(block.num_rows()) + " rows (" + describe_ids(ids_of(block)) +
                     "; task " + std::to_string(index) + ", epoch " + std::to_string(epoch) +
                     ") failed: " + e.what();
      return result;
    }
  }
  result.block = std::move(block);
  return result;
}

Dataset::Dataset() : plan_(std::make_shared<Plan>()) {}
Dataset::Dataset(std::shared_ptr<const Plan> plan) : plan_(std::move(plan)) {}

Dataset Dataset::from_tensors(std::map<std::string, at::Tensor> columns) {
  auto plan = std::make_shared<Plan>();
  plan->source = make_tensor_source(std::move(columns), "tensors");
  return Dataset(plan);
}

Dataset Dataset::from_mnist(const std::filesystem::path& dir, Split split) {
  const int64_t rows = mnist_shape(dir, split)[0];
  auto plan = std::make_shared<Plan>();
  // Loaded when first read: a driver that only hands the dataset to its workers (or counts its
  // rows) never loads it.
  plan->source = make_lazy_source(
      [dir, split] {
        auto loaded = load_mnist(dir, split);
        return make_tensor_source({{"image", loaded.inputs}, {"label", loaded.targets}}, "mnist");
      },
      "mnist:" + dir.string() + (split == Split::kTrain ? ":train" : ":test"), rows);
  return Dataset(plan);
}

Dataset Dataset::synthetic_images(int64_t rows, SyntheticImageOptions options) {
  auto plan = std::make_shared<Plan>();
  plan->source = make_synthetic_image_source(rows, options);
  return Dataset(plan);
}

Dataset Dataset::read_csv(const std::filesystem::path& path, CsvOptions options) {
  auto plan = std::make_shared<Plan>();
  plan->source = make_csv_source(path, options);
  return Dataset(plan);
}

Dataset Dataset::read_images(const std::filesystem::path& dir, ImageFolderOptions options) {
  auto plan = std::make_shared<Plan>();
  plan->source = make_image_folder_source(dir, options);
  return Dataset(plan);
}

Dataset Dataset::map_batches(BatchFn fn, MapBatchesOptions options) const {
  if (!fn) throw UsageError("map_batches: the function is empty");
  if (options.batch_size < 1) {
    throw UsageError("map_batches '" + options.name +
                     "': batch_size=" + std::to_string(options.batch_size) + " must be >= 1");
  }
  if (options.num_workers < -1) {
    throw UsageError("map_batches '" + options.name +
                     "': num_workers=" + std::to_string(options.num_workers) +
                     " must be >= 0, or -1 for one per free CPU");
  }
  auto plan = std::make_shared<Plan>(*plan_);
  plan->stages.push_back(Stage{Stage::kMap, options.name, std::move(fn), {}, options});
  return Dataset(plan);
}

Dataset Dataset::filter(RowPredicate predicate, std::string name) const {
  if (!predicate) throw UsageError("filter: the predicate is empty");
  auto plan = std::make_shared<Plan>(*plan_);
  plan->stages.push_back(Stage{Stage::kFilter, std::move(name), {}, std::move(predicate), {}});
  return Dataset(plan);
}

Dataset Dataset::random_shuffle(uint64_t seed) const {
  auto plan = std::make_shared<Plan>(*plan_);
  plan->order.push_back(OrderOp{OrderOp::kShuffle, seed, 0, 1});
  return Dataset(plan);
}

std::vector<Dataset> Dataset::split(int n) const {
  if (n < 1) throw UsageError("split: n=" + std::to_string(n) + " must be >= 1");
  std::vector<Dataset> parts;
  for (int i = 0; i < n; ++i) {
    auto plan = std::make_shared<Plan>(*plan_);
    plan->order.push_back(OrderOp{OrderOp::kSplit, 0, i, n});
    parts.push_back(Dataset(plan));
  }
  return parts;
}

Dataset Dataset::shard(int index, int count) const {
  if (count < 1 || index < 0 || index >= count) {
    throw UsageError("shard: index " + std::to_string(index) + " of " + std::to_string(count) +
                     " parts: need 0 <= index < count");
  }
  auto plan = std::make_shared<Plan>(*plan_);
  plan->order.push_back(OrderOp{OrderOp::kShard, 0, index, count});
  return Dataset(plan);
}

Dataset Dataset::limit(int64_t rows) const {
  if (rows < 0) throw UsageError("limit: rows=" + std::to_string(rows) + " must be >= 0");
  auto plan = std::make_shared<Plan>(*plan_);
  OrderOp op{OrderOp::kLimit};
  op.rows = rows;
  plan->order.push_back(op);
  return Dataset(plan);
}

std::pair<Dataset, Dataset> Dataset::train_test_split(double test_size,
                                                      std::optional<uint64_t> shuffle_seed) const {
  if (!(test_size > 0 && test_size < 1)) {
    throw UsageError("train_test_split: test_size=" + std::to_string(test_size) +
                     " must be a fraction of the rows, between 0 and 1 (e.g. 0.1)");
  }
  OrderOp op{OrderOp::kTrainTestSplit};
  op.test_size = test_size;
  op.shuffled = shuffle_seed.has_value();
  op.seed = shuffle_seed.value_or(0);
  auto train = std::make_shared<Plan>(*plan_);
  train->order.push_back(op);
  op.index = 1;
  auto test = std::make_shared<Plan>(*plan_);
  test->order.push_back(op);
  return {Dataset(train), Dataset(test)};
}

Dataset Dataset::with_execution(ExecutionOptions options) const {
  if (options.max_tasks_in_flight < 0) throw UsageError("max_tasks_in_flight must be >= 0");
  if (options.rows_per_task < 1) throw UsageError("rows_per_task must be >= 1");
  if (options.remote_workers < 0) throw UsageError("remote_workers must be >= 0");
  if (options.remote_workers > 0 && options.listen_address.empty()) {
    throw UsageError("remote_workers=" + std::to_string(options.remote_workers) +
                     " needs a listen_address (host:port) for them to connect to");
  }
  auto plan = std::make_shared<Plan>(*plan_);
  plan->execution = std::move(options);
  return Dataset(plan);
}

namespace {

// For a single pass (materialize, count, take): workers do not start on a next epoch.
Dataset one_pass(const Dataset& dataset) {
  auto options = dataset.execution();
  options.prefetch_next_epoch = false;
  return dataset.with_execution(options);
}

}  // namespace

Dataset Dataset::materialize() const {
  DataIterator iterator(one_pass(*this));
  std::vector<Block> blocks;
  for (Block& block :
       iterator.iter_batches({.batch_size = rows_per_task(*plan_), .prefetch_batches = 2})) {
    blocks.push_back(std::move(block));
  }
  auto plan = std::make_shared<Plan>();
  plan->execution = plan_->execution;
  Block all = Block::concat(blocks);
  plan->source = make_tensor_source(all.columns, "materialized:" + fingerprint());
  return Dataset(plan);
}

int64_t Dataset::num_source_rows() const {
  return static_cast<int64_t>(epoch_rows(*plan_, 0).size());
}

int64_t Dataset::count() const {
  if (plan_->stages.empty() && (!plan_->source || !plan_->source->may_skip()))
    return num_source_rows();
  DataIterator iterator(one_pass(*this));
  int64_t rows = 0;
  for (Block& block : iterator.iter_batches({.batch_size = rows_per_task(*plan_)}))
    rows += block.num_rows();
  return rows;
}

Block Dataset::take(int64_t rows) const {
  DataIterator iterator(one_pass(*this));
  std::vector<Block> blocks;
  int64_t have = 0;
  for (Block& block : iterator.iter_batches({.batch_size = rows_per_task(*plan_)})) {
    have += block.num_rows();
    blocks.push_back(std::move(block));
    if (rows >= 0 && have >= rows) break;
  }
  Block all = Block::concat(blocks);
  if (rows >= 0 && all.num_rows() > rows) all = all.slice(0, rows);
  return all;
}

const std::vector<std::string>& Dataset::class_names() const {
  static const std::vector<std::string> none;
  return plan_->source ? plan_->source->class_names() : none;
}

std::string Dataset::describe() const {
  std::string out = plan_->source ? plan_->source->describe() : "empty";
  for (const auto& op : plan_->order) {
    switch (op.kind) {
      case OrderOp::kShuffle:
        out += " -> random_shuffle(" + std::to_string(op.seed) + ")";
        break;
      case OrderOp::kSplit:
        out += " -> split(" + std::to_string(op.index) + "/" + std::to_string(op.count) + ")";
        break;
      case OrderOp::kShard:
        out += " -> shard(" + std::to_string(op.index) + "/" + std::to_string(op.count) + ")";
        break;
      case OrderOp::kLimit:
        out += " -> limit(" + std::to_string(op.rows) + ")";
        break;
      case OrderOp::kTrainTestSplit:
        out += std::string(" -> train_test_split(") + (op.index == 1 ? "test" : "train") + ", " +
               std::to_string(op.test_size) +
               (op.shuffled ? ", seed " + std::to_string(op.seed) : std::string(", last rows")) +
               ")";
        break;
    }
  }
  for (const auto& stage : plan_->stages) {
    out += " -> " + std::string(stage.kind == Stage::kMap ? "map_batches" : "filter") + "('" +
           stage.name + "'";
    if (stage.kind == Stage::kMap) {
      out += ", batch_size=" + std::to_string(stage.options.batch_size) +
             (stage.options.on_error == OnError::kSkip ? ", skip errors" : "");
    }
    out += ")";
  }
  return out;
}

std::string Dataset::fingerprint() const {
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(fnv1a(describe())));
  return hex;
}

int Dataset::num_workers() const {
  int workers = 0;
  for (const auto& stage : plan_->stages) {
    if (stage.kind != Stage::kMap) continue;
    workers = std::max(workers, stage.options.num_workers < 0 ? default_data_workers()
                                                              : stage.options.num_workers);
  }
  return workers;
}

const ExecutionOptions& Dataset::execution() const { return plan_->execution; }

bool Dataset::has_map_stage() const {
  return std::any_of(plan_->stages.begin(), plan_->stages.end(),
                     [](const Stage& s) { return s.kind == Stage::kMap; });
}

DataIterator Dataset::iterator() const { return DataIterator(*this); }

}  // namespace cohort::data

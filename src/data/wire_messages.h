// The data plane's messages as a peer sends them (data/wire.h frames them): a preprocessing
// worker's "hello" and "result" headers, its consumer's "task", "stop" and "refuse", and a
// batch's column layout. Each is read from its JSON with every field type- and range-checked, so
// that what a peer announces (a task's rows, a column's offset, shape and type) is refused here,
// with a UsageError naming the field, before anything is allocated or mapped for it. Without
// libtorch's tensors (c10's scalar types only): the fuzz target data_plane_messages decodes them.
#pragma once
#include <c10/core/ScalarType.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cohort/json.h"

namespace cohort::data::wire {

// A preprocessing worker's message to its consumer: "hello" (who it is, the pipeline it built)
// or "result" (a task's counts and error; the batch's columns follow with the payload).
struct WorkerMessage {
  std::string type;
  int pid = -1;
  std::string host = "?";
  bool local = false;
  std::string pipeline;
  int64_t index = -1;
  int64_t epoch = -1;
  int64_t skipped_rows = 0;
  int64_t skipped_batches = 0;
  std::string error;
  size_t payload_bytes = 0;
};

// A consumer's message to a worker: "task" (the rows of task `index` of `epoch`), "stop" or
// "refuse" (with its reason).
struct ConsumerMessage {
  std::string type;
  int64_t index = -1;
  int64_t epoch = -1;
  std::vector<int64_t> rows;
  std::string reason;
};

// One column of a batch: `bytes` at `offset` of the payload, a tensor of `shape` and `dtype`.
struct ColumnLayout {
  std::string name;
  c10::ScalarType dtype = c10::ScalarType::Byte;
  std::vector<int64_t> shape;
  size_t offset = 0, bytes = 0;
};

// A worker's message; a result names its task (index >= 0), its counts are >= 0, and a batch it
// announces is within kMaxDataBlockBytes.
WorkerMessage read_worker_message(const Json& message);
// A consumer's message; a task names its task and epoch (>= 0) and rows that are indexes (>= 0).
ConsumerMessage read_consumer_message(const Json& message);
// A batch's columns (the header's "columns") in a payload of `payload_bytes`: each names a known
// type, a shape of counts whose bytes are its `bytes`, and lies whole and aligned inside the
// payload; names are unique. Checked before any tensor is made over the payload.
std::vector<ColumnLayout> read_columns(const Json& columns, size_t payload_bytes);

}  // namespace cohort::data::wire

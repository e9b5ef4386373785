#include "data/wire_messages.h"

#include <limits>
#include <set>

#include "cohort/error.h"
#include "cohort/limits.h"

namespace cohort::data::wire {
namespace {

// The types a batch's column may have: those a Block's tensors are made of.
constexpr c10::ScalarType kColumnTypes[] = {c10::ScalarType::Byte,  c10::ScalarType::Char,
                                            c10::ScalarType::Short, c10::ScalarType::Int,
                                            c10::ScalarType::Long,  c10::ScalarType::Half,
                                            c10::ScalarType::Float, c10::ScalarType::Double,
                                            c10::ScalarType::Bool,  c10::ScalarType::BFloat16};

c10::ScalarType column_type(const std::string& name, const std::string& where) {
  for (const auto type : kColumnTypes) {
    if (name == c10::toString(type)) return type;
  }
  throw UsageError(where + " has the unknown type '" + name.substr(0, 40) + "'");
}

// An integer >= 0 that fits int64_t: a row index or a size.
bool is_count(const Json& value) {
  if (!value.is_number_integer()) return false;
  return value.is_number_unsigned()
             ? value.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())
             : value.get<int64_t>() >= 0;
}

int64_t count_field(const Json& message, const char* key) {
  const auto value = json_field<int64_t>(message, key, 0);
  if (value < 0) {
    throw UsageError(std::string("field '") + key + "' is " + std::to_string(value) +
                     ", not a count (>= 0)");
  }
  return value;
}

void check_payload(size_t payload_bytes) {
  if (payload_bytes > static_cast<uint64_t>(kMaxDataBlockBytes)) {
    throw UsageError("a batch of " + std::to_string(payload_bytes) + " bytes, over the cap of " +
                     std::to_string(kMaxDataBlockBytes) + " (kMaxDataBlockBytes)");
  }
}

}  // namespace

WorkerMessage read_worker_message(const Json& j) {
  WorkerMessage m;
  m.type = json_field<std::string>(j, "type", "");
  m.pid = json_field<int>(j, "pid", -1);
  m.host = json_field<std::string>(j, "host", "?");
  m.local = json_field<bool>(j, "local", false);
  m.pipeline = json_field<std::string>(j, "pipeline", "");
  m.index = json_field<int64_t>(j, "index", -1);
  m.epoch = json_field<int64_t>(j, "epoch", -1);
  m.skipped_rows = count_field(j, "skipped_rows");
  m.skipped_batches = count_field(j, "skipped_batches");
  m.error = json_field<std::string>(j, "error", "");
  m.payload_bytes = json_field<size_t>(j, "payload_bytes", 0);
  if (m.type == "result" && m.index < 0)
    throw UsageError("a result must name its task: 'index' is " + std::to_string(m.index));
  check_payload(m.payload_bytes);
  return m;
}

ConsumerMessage read_consumer_message(const Json& j) {
  ConsumerMessage m;
  m.type = json_field<std::string>(j, "type", "");
  m.reason = json_field<std::string>(j, "reason", "");
  if (m.type != "task") return m;
  m.index = json_field<int64_t>(j, "index", -1);
  m.epoch = json_field<int64_t>(j, "epoch", -1);
  if (m.index < 0 || m.epoch < 0) {
    throw UsageError("a task must name its task and epoch (>= 0): 'index' is " +
                     std::to_string(m.index) + ", 'epoch' " + std::to_string(m.epoch));
  }
  const auto rows = j.find("rows");
  if (rows == j.end() || !rows->is_array())
    throw UsageError("task " + std::to_string(m.index) + " has no array 'rows'");
  m.rows.reserve(rows->size());
  for (const auto& row : *rows) {
    if (!is_count(row)) {
      throw UsageError("task " + std::to_string(m.index) + " names the row " +
                       row.dump().substr(0, 40) + ", not an index (an integer >= 0)");
    }
    m.rows.push_back(row.get<int64_t>());
  }
  return m;
}

std::vector<ColumnLayout> read_columns(const Json& columns, size_t payload_bytes) {
  check_payload(payload_bytes);
  if (!columns.is_array()) throw UsageError("a batch's 'columns' is no array");
  std::vector<ColumnLayout> out;
  std::set<std::string> names;
  for (const auto& c : columns) {
    ColumnLayout column;
    column.name = json_field<std::string>(c, "name", "");
    const auto where = "column '" + column.name.substr(0, 40) + "' of a batch";
    if (column.name.empty() || !names.insert(column.name).second)
      throw UsageError(where + ": a column needs a name of its own");
    column.dtype = column_type(json_field<std::string>(c, "dtype", ""), where);
    column.offset = json_field<size_t>(c, "offset", 0);
    column.bytes = json_field<size_t>(c, "bytes", 0);
    const auto shape = c.find("shape");
    if (shape == c.end() || !shape->is_array()) throw UsageError(where + " has no shape");
    for (const auto& d : *shape) {
      if (!is_count(d)) {
        throw UsageError(where + " has the size " + d.dump().substr(0, 40) +
                         ", not a count (an integer >= 0)");
      }
      column.shape.push_back(d.get<int64_t>());
    }
    const auto element = c10::elementSize(column.dtype);
    const auto bytes = bytes_up_to(column.shape, static_cast<int64_t>(element),
                                   static_cast<int64_t>(payload_bytes));
    if (static_cast<uint64_t>(bytes) != column.bytes || column.offset > payload_bytes ||
        column.bytes > payload_bytes - column.offset || column.offset % element != 0) {
      throw UsageError(where + " (offset " + std::to_string(column.offset) + ", " +
                       std::to_string(column.bytes) + " bytes, shape " +
                       shape->dump().substr(0, 80) + ", " + c10::toString(column.dtype) +
                       ") does not lie whole and aligned inside the batch's " +
                       std::to_string(payload_bytes) + " bytes, or its shape is not its size");
    }
    out.push_back(std::move(column));
  }
  return out;
}

}  // namespace cohort::data::wire

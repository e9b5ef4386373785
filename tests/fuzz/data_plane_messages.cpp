// Fuzz target: the data plane's messages (src/data/wire_messages.h), one JSON header per line, as
// a consumer reads a preprocessing worker's (with the batch layout it announces) and a worker
// reads its consumer's. A message may be refused (not JSON, a field of the wrong type or range),
// never crash the reader; a batch layout it accepts has columns that each lie whole, aligned and
// sized by their shape inside the payload, so that the tensors made over the payload (a memfd's
// mapping or a buffer) stay inside it: the target reads each column's bytes from a buffer of the
// payload's size, where AddressSanitizer sees any byte outside it.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "cohort/error.h"
#include "cohort/limits.h"
#include "data/wire_messages.h"

namespace {

// Payloads up to this size are allocated and each accepted column's bytes read.
constexpr size_t kProbedPayload = size_t{1} << 20;

void check_columns(const std::vector<cohort::data::wire::ColumnLayout>& columns,
                   size_t payload_bytes) {
  std::set<std::string> names;
  std::vector<char> payload(payload_bytes <= kProbedPayload ? payload_bytes : 0, 1);
  for (const auto& c : columns) {
    if (c.name.empty() || !names.insert(c.name).second) std::abort();
    const auto element = c10::elementSize(c.dtype);
    uint64_t bytes = element;
    bool overflow = false;
    for (const int64_t d : c.shape) {
      if (d < 0) std::abort();
      overflow = __builtin_mul_overflow(bytes, static_cast<uint64_t>(d), &bytes) || overflow;
    }
    for (const int64_t d : c.shape) bytes = d == 0 ? 0 : bytes;
    if ((overflow && bytes != 0) || bytes != c.bytes || c.offset % element != 0 ||
        c.offset > payload_bytes || c.bytes > payload_bytes - c.offset) {
      std::abort();
    }
    if (!payload.empty() && c.bytes > 0) {
      uint64_t sum = 0;
      for (size_t i = c.offset; i < c.offset + c.bytes; ++i)
        sum += static_cast<uint8_t>(payload[i]);
      if (sum != c.bytes) std::abort();
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace cohort::data::wire;
  const std::string input(reinterpret_cast<const char*>(data), size);
  size_t start = 0;
  while (start <= input.size()) {
    size_t end = input.find('\n', start);
    if (end == std::string::npos) end = input.size();
    cohort::Json header;
    try {
      header = cohort::Json::parse(input.substr(start, end - start));
    } catch (const cohort::Json::exception&) {
      start = end + 1;
      continue;
    }
    try {
      const auto message = read_worker_message(header);
      if (message.type == "result" && message.index < 0) std::abort();
      if (message.skipped_rows < 0 || message.skipped_batches < 0) std::abort();
      if (message.payload_bytes > static_cast<uint64_t>(cohort::kMaxDataBlockBytes)) std::abort();
      if (header.is_object() && header.contains("columns"))
        check_columns(read_columns(header["columns"], message.payload_bytes),
                      message.payload_bytes);
    } catch (const cohort::UsageError&) {
    }
    try {
      const auto message = read_consumer_message(header);
      if (message.type == "task") {
        if (message.index < 0 || message.epoch < 0) std::abort();
        for (const int64_t row : message.rows) {
          if (row < 0) std::abort();
        }
      }
    } catch (const cohort::UsageError&) {
    }
    start = end + 1;
  }
  return 0;
}

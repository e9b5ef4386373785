// Fuzz target: an IDX file's header (include/cohort/data/idx_header.h), as data::read_idx reads
// it from a data directory it did not write. Every input is the start of a file: decoding never
// reads past it, and a header it accepts has 1 to 4 dimensions whose product (the bytes read_idx
// then allocates) stays within kMaxIdxBytes.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "cohort/data/idx_header.h"
#include "cohort/error.h"
#include "cohort/limits.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  try {
    const auto header = cohort::data::parse_idx_header(bytes, "input");
    if (header.shape.empty() || header.shape.size() > 4) std::abort();
    // The payload: zero with a zero size, else a product that must not overflow.
    int64_t payload = 1;
    bool overflow = false;
    for (const int64_t d : header.shape) {
      if (d < 0) std::abort();
      overflow = __builtin_mul_overflow(payload, d, &payload) || overflow;
    }
    for (const int64_t d : header.shape) payload = d == 0 ? 0 : payload;
    if ((overflow && payload != 0) || payload > cohort::kMaxIdxBytes ||
        payload != header.payload_bytes()) {
      std::abort();
    }
  } catch (const cohort::UsageError&) {
    // A malformed header: read_idx names the file and allocates nothing.
  }
  return 0;
}

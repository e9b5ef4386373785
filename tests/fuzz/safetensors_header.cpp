// Fuzz target: a safetensors file's header (include/cohort/train/safetensors_header.h), as the
// checkpointer reads it from a file it did not write. Every input is a whole file: decoding never
// reads past it, never allocates what a length merely announces, and every tensor it accepts lies
// inside the file's data and holds exactly its shape's bytes.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "cohort/error.h"
#include "cohort/train/safetensors_header.h"

namespace safetensors = cohort::safetensors;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view file(reinterpret_cast<const char*>(data), size);
  const auto file_size = static_cast<int64_t>(size);
  try {
    const uint64_t length = safetensors::header_length(file, file_size, "input");
    const auto header = safetensors::parse_header(file.substr(8, length), file_size, "input");
    if (header.data_start != 8 + static_cast<int64_t>(length)) std::abort();
    for (const auto& [name, t] : header.tensors) {
      // The shape's bytes: zero with a zero size, else a product that must not overflow.
      int64_t bytes = static_cast<int64_t>(c10::elementSize(t.dtype));
      bool overflow = false;
      for (const int64_t d : t.shape)
        overflow = __builtin_mul_overflow(bytes, d, &bytes) || overflow;
      for (const int64_t d : t.shape) bytes = d == 0 ? 0 : bytes;
      if ((overflow && bytes != 0) || t.begin < 0 || t.end > file_size - header.data_start ||
          t.end - t.begin != bytes) {
        std::abort();  // a range the reader would trust outside the file or its shape
      }
    }
  } catch (const cohort::UsageError&) {
    // A malformed file: the checkpointer names it and reads nothing.
  }
  return 0;
}

#include "cohort/data/idx_header.h"

#include <c10/util/ArrayRef.h>
#include <c10/util/StringUtil.h>

#include "cohort/error.h"
#include "cohort/limits.h"

namespace cohort::data {

int64_t IdxHeader::payload_bytes() const {
  // Multiplied without overflow: a zero size makes it 0 whatever the others (fuzzing found
  // dimensions whose product overflowed before their zero), and a parsed header is within the cap.
  return bytes_up_to(shape, 1, kMaxIdxBytes);
}

int64_t idx_header_bytes(std::string_view magic, const std::string& file) {
  if (magic.size() < 4) throw UsageError("IDX file " + file + " is truncated: no 4-byte header");
  const auto byte = [&](size_t i) { return static_cast<unsigned char>(magic[i]); };
  if (byte(0) != 0 || byte(1) != 0) {
    throw UsageError("IDX file " + file +
                     " has a wrong magic number (not an IDX file): expected 00 00 08 0N");
  }
  if (byte(2) != kIdxUnsignedByte) {
    throw UsageError("IDX file " + file + " has element type code " + std::to_string(byte(2)) +
                     ": only unsigned bytes (code 8) are supported");
  }
  const int dims = byte(3);
  if (dims < 1 || dims > 4) {
    throw UsageError("IDX file " + file + " announces " + std::to_string(dims) +
                     " dimensions: expected 1 to 4");
  }
  return 4 + 4 * int64_t{dims};
}

IdxHeader parse_idx_header(std::string_view bytes, const std::string& file) {
  const int64_t length = idx_header_bytes(bytes, file);
  if (static_cast<int64_t>(bytes.size()) < length)
    throw UsageError("IDX file " + file + " is truncated inside its header");
  IdxHeader header;
  for (int64_t at = 4; at < length; at += 4) {
    int64_t size = 0;
    for (int64_t i = at; i < at + 4; ++i)
      size = (size << 8) | static_cast<unsigned char>(bytes[static_cast<size_t>(i)]);
    header.shape.push_back(size);
  }
  // The data's bytes, multiplied without overflow, against the cap before anything is allocated.
  if (bytes_up_to(header.shape, 1, kMaxIdxBytes) > kMaxIdxBytes) {
    throw UsageError("IDX file " + file + " announces dimensions " +
                     c10::str(c10::IntArrayRef(header.shape)) + ", over the cap of " +
                     std::to_string(kMaxIdxBytes) +
                     " data bytes (kMaxIdxBytes): its header is corrupt");
  }
  return header;
}

}  // namespace cohort::data

/// \file
/// An IDX file's header (the MNIST format), decoded and checked without libtorch's tensors: what
/// data::inspect_idx and data::read_idx read first, and what the fuzz target idx_header decodes.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace cohort::data {

/// The element type code of unsigned bytes, the only element type cohort reads and writes.
inline constexpr unsigned char kIdxUnsignedByte = 0x08;

/// The header of an IDX file (the MNIST format): unsigned bytes, 1 to 4 dimensions.
struct IdxHeader {
  std::vector<int64_t> shape;  ///< the dimensions, as the header gives them
  /// Bytes of the payload the header announces (the product of the dimensions).
  int64_t payload_bytes() const;
};

/// The bytes of the header of the IDX file named `file` whose first bytes are `magic` (at least
/// 4): 4 + 4 per dimension. UsageError naming the file for fewer than 4 bytes, a wrong magic
/// number, an element type other than unsigned bytes, or dimensions other than 1 to 4.
int64_t idx_header_bytes(std::string_view magic, const std::string& file);
/// The header of the IDX file named `file` from its first bytes (at least idx_header_bytes()),
/// checked as idx_header_bytes does and its dimensions multiplied without overflow against
/// kMaxIdxBytes. UsageError naming the file otherwise.
IdxHeader parse_idx_header(std::string_view bytes, const std::string& file);

}  // namespace cohort::data

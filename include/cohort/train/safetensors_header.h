/// \file
/// A safetensors file's header, read and checked without libtorch's tensors (only c10's scalar
/// types): what train::load_by_name and the checkpointer read before any tensor, and what the
/// fuzz target safetensors_header decodes.
#pragma once
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include <c10/core/ScalarType.h>

namespace cohort::safetensors {

/// A file's header: each tensor's dtype, shape and byte range (from the start of the data).
struct TensorInfo {
  c10::ScalarType dtype = c10::ScalarType::Float;  ///< the tensor's element type
  std::vector<int64_t> shape;                      ///< its shape
  int64_t begin = 0;                               ///< its first byte, counted from data_start
  int64_t end = 0;                                 ///< one past its last byte
};
/// A safetensors file's header: its tensors, its metadata and where the data starts.
struct Header {
  std::map<std::string, TensorInfo> tensors;    ///< by name
  std::map<std::string, std::string> metadata;  ///< the `__metadata__` object
  int64_t data_start = 0;  ///< the file offset of the first tensor's first byte
};

/// The safetensors name of `dtype` ("F32", "BF16", ...); UsageError for a dtype the format
/// cannot hold, naming `what` (the tensor).
const std::string& dtype_name(c10::ScalarType dtype, const std::string& what);

/// The JSON header's length that a file's first 8 bytes (`prefix`, little-endian) announce, in a
/// file of `file_size` bytes named `file`: UsageError naming the file when there are fewer than 8
/// bytes, or the length passes kMaxSafetensorsHeader or the file's end.
uint64_t header_length(std::string_view prefix, int64_t file_size, const std::string& file);
/// The header of a file of `file_size` bytes named `file` from its JSON `text` (header_length()
/// bytes after the first 8), checked: every tensor of a known dtype, a shape of sizes >= 0 and a
/// byte range inside the data that holds exactly its shape (multiplied without overflow), the
/// metadata strings. UsageError naming the file, the tensor and the field otherwise.
Header parse_header(std::string_view text, int64_t file_size, const std::string& file);
/// Reads and checks the header only (header_length, then parse_header); UsageError naming the
/// file when it is truncated or corrupt.
Header read_header(const std::filesystem::path& file);

}  // namespace cohort::safetensors

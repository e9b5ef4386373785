#pragma once
#include <cstdint>
#include <filesystem>
#include <vector>

#include <ATen/core/Tensor.h>

#include "cohort/data/idx_header.h"

namespace cohort::data {

/// Reads the header and checks that the file holds exactly the payload it announces, without
/// reading the payload (gzip: from the trailer). Throws UsageError naming the file and the
/// problem: missing, wrong magic, unsupported type, truncated, trailing bytes.
IdxHeader inspect_idx(const std::filesystem::path& path);

/// Reads an IDX file, gzipped or not, into a uint8 tensor of the file's shape. Same errors.
at::Tensor read_idx(const std::filesystem::path& path);

/// Writes a uint8 tensor as an IDX file; gzipped when the name ends in ".gz".
void write_idx(const std::filesystem::path& path, const at::Tensor& tensor);

}  // namespace cohort::data

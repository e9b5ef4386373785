#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace cohort::data {

/// A batch of rows held by column: every column is a tensor whose first dimension is the row.
/// Datasets add an int64 "id" column, the row's index in its source, which survives every stage
/// (ids make a run checkable: nothing lost, nothing duplicated).
struct Block {
  std::map<std::string, at::Tensor> columns;

  int64_t num_rows() const;
  bool has(const std::string& column) const { return columns.count(column) != 0; }
  /// Throws UsageError naming the columns there are.
  at::Tensor& operator[](const std::string& column);
  const at::Tensor& operator[](const std::string& column) const;
  std::vector<std::string> column_names() const;

  /// Rows [start, start + length).
  Block slice(int64_t start, int64_t length) const;
  /// The rows at `indices` (int64) or where `mask` (bool) is true, in that order.
  Block take(const at::Tensor& indices_or_mask) const;
  /// Throws UsageError when the blocks' columns differ.
  static Block concat(const std::vector<Block>& blocks);
  /// Throws UsageError naming the column when the columns' row counts differ.
  void check(const std::string& what) const;
};

inline constexpr const char* kIdColumn = "id";

}  // namespace cohort::data

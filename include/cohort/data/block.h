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
  std::map<std::string, at::Tensor> columns;  ///< column name to tensor (first dimension: the row)

  /// Rows of the block (0 when it has no column).
  int64_t num_rows() const;
  /// Whether it has `column`.
  bool has(const std::string& column) const { return columns.count(column) != 0; }
  /// Throws UsageError naming the columns there are.
  at::Tensor& operator[](const std::string& column);
  /// The column `column`; throws UsageError naming the columns there are.
  const at::Tensor& operator[](const std::string& column) const;
  /// Its column names, in order.
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

/// The column of row ids every dataset adds.
inline constexpr const char* kIdColumn = "id";

}  // namespace cohort::data

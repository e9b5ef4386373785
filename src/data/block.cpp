#include "cohort/data/block.h"

#include <torch/types.h>

#include "cohort/error.h"

namespace cohort::data {

int64_t Block::num_rows() const {
  for (const auto& [name, column] : columns) {
    if (column.defined()) return column.dim() == 0 ? 1 : column.size(0);
  }
  return 0;
}

std::vector<std::string> Block::column_names() const {
  std::vector<std::string> names;
  for (const auto& [name, column] : columns) names.push_back(name);
  return names;
}

namespace {
std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}
}  // namespace

at::Tensor& Block::operator[](const std::string& column) {
  auto it = columns.find(column);
  if (it == columns.end()) {
    throw UsageError("no column '" + column + "' in this batch (it has [" + join(column_names()) +
                     "])");
  }
  return it->second;
}

const at::Tensor& Block::operator[](const std::string& column) const {
  return const_cast<Block&>(*this)[column];
}

Block Block::slice(int64_t start, int64_t length) const {
  Block out;
  for (const auto& [name, column] : columns) out.columns[name] = column.narrow(0, start, length);
  return out;
}

Block Block::take(const at::Tensor& indices_or_mask) const {
  const auto indices = indices_or_mask.scalar_type() == at::kBool
                           ? indices_or_mask.nonzero().flatten()
                           : indices_or_mask.to(at::kLong);
  Block out;
  for (const auto& [name, column] : columns)
    out.columns[name] = column.index_select(0, indices.to(column.device()));
  return out;
}

Block Block::concat(const std::vector<Block>& blocks) {
  if (blocks.empty()) return {};
  if (blocks.size() == 1) return blocks.front();
  Block out;
  for (const auto& [name, first] : blocks.front().columns) {
    std::vector<at::Tensor> parts;
    for (const auto& b : blocks) {
      auto it = b.columns.find(name);
      if (it == b.columns.end() || b.columns.size() != blocks.front().columns.size()) {
        throw UsageError("cannot concatenate batches with different columns: [" +
                         join(blocks.front().column_names()) + "] and [" + join(b.column_names()) +
                         "]");
      }
      parts.push_back(it->second);
    }
    out.columns[name] = at::cat(parts, 0);
  }
  return out;
}

void Block::check(const std::string& what) const {
  const int64_t rows = num_rows();
  for (const auto& [name, column] : columns) {
    if (!column.defined() || column.dim() == 0 || column.size(0) != rows) {
      throw UsageError(what + ": column '" + name + "' has " +
                       (column.defined() && column.dim() > 0 ? std::to_string(column.size(0))
                                                             : std::string("no")) +
                       " rows where the others have " + std::to_string(rows));
    }
  }
}

}  // namespace cohort::data

#pragma once
#include <functional>

#include <ATen/core/Tensor.h>

namespace cohort::data {

/// One batch: inputs and targets, first dimension the batch.
struct Batch {
  at::Tensor data;    ///< inputs, first dimension the batch
  at::Tensor target;  ///< targets, first dimension the batch
};

/// Examples held in memory as two tensors with the same first dimension. `transform` runs on each
/// gathered batch of inputs (in the loader's prefetch thread), e.g. uint8 pixels to normalised
/// floats, so the dataset itself stays compact.
struct TensorDataset {
  at::Tensor inputs;   ///< the examples' inputs (first dimension: the example)
  at::Tensor targets;  ///< their targets
  std::function<at::Tensor(const at::Tensor&)>
      transform;  ///< runs on each gathered batch of inputs; empty: none

  /// The number of examples.
  int64_t size() const { return inputs.defined() ? inputs.size(0) : 0; }
  /// Gathers the examples at `indices` (an int64 tensor) and applies the transform.
  Batch get_batch(const at::Tensor& indices) const;
};

}  // namespace cohort::data

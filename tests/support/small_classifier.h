// A small classification task for the train loops of tests: 96 rows whose first feature is the
// row's id (a rank can say which rows it trained on), and an MLP for them made parallel by a plan.
#pragma once
#include <cstdint>
#include <string>
#include <utility>

#include <ATen/core/Tensor.h>

#include "cohort/data/dataset.h"
#include "cohort/train/parallel_model.h"
#include "cohort/train/plan.h"

namespace cohort::testing {

inline constexpr int64_t kClassifierRows = 96;
inline constexpr int64_t kClassifierBatch = 8;  // rows per rank and step

// Row i: 8 features, the first i itself, a label of 4 classes.
std::pair<at::Tensor, at::Tensor> classifier_examples();
// classifier_examples() as a Dataset of columns "x" and "y", shuffled (seed 7).
data::Dataset classifier_dataset();

// The plan families by name: "ddp" (any name not below), "zero1", "zero2", "zero3", "hsdp",
// "pipeline", "mesh", "zero_bubble", "local_sgd", "diloco", "parameter_server".
train::Plan plan_named(const std::string& name);

// An MLP of 8 features, `hidden_layers` of 16 and 4 classes, every rank the same weights, made
// parallel by `plan` with AdamW (or, `stateless`, plain SGD: no state per parameter); with ZeRO-3
// or activation checkpointing each linear layer is a unit (parallel::FullyShard). With `dropout`
// above 0, dropout of that probability after each hidden layer.
train::ParallelModel classifier_net(const train::Plan& plan, int hidden_layers, double dropout = 0,
                                    bool stateless = false);

}  // namespace cohort::testing

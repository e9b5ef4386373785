/// \file
/// A zoo model as train::parallelize takes it, on the worker's mesh: what `cohort train` and the
/// benchmarks train, in one call.
#pragma once
#include <cstdint>
#include <string>

#include "cohort/models/zoo.h"
#include "cohort/optim/precision.h"
#include "cohort/train/parallel_model.h"

namespace cohort::models {

/// The zoo's model `name` for train::parallelize on this worker's mesh (get_context()): built
/// after torch::manual_seed(`seed`), so every rank holds the same weights; with a mesh, cut at its
/// pipeline_layers(model, pp); with tp > 1 the ViT's or GPT's blocks tensor-parallel over the
/// mesh's tp group, beside the dense model of the same seed that checkpoints hold. Every rank calls
/// it alike (the tp group's slices are cut from the same dense weights). UsageError as
/// create_model().
train::ModelSpec model_spec(const std::string& name, ModelOptions options, uint64_t seed);

/// What model_spec and train::parallelize refuse of `plan` for the zoo's model `name`, checked
/// before any worker starts (the model built deferred, for its layers): a GPT with tied
/// embeddings cut into stages under ZeRO, fewer layers than pipeline stages, tensor parallelism for
/// a model without tensor-parallel layers or a degree that does not divide its heads and MLP
/// features. A UsageError naming the flags (--pp, --zero-stage, --tp, --heads, --width, --layers)
/// and the fix.
void check_plan(const std::string& name, const ModelOptions& options, const train::Plan& plan);

/// The activations one step of `model` adds on a worker, for train::estimate_memory's
/// activation_bytes: two forwards and backwards of sample_batch(`rows`) in training mode, the
/// forward under autocast to `precision`, with logits_cross_entropy, as train::measure_step_memory
/// measures them (the second step counts the heap's slack: the first step's freed blocks that
/// its activations do not fit). What `cohort estimate` and the memory benches probe. To see a
/// worker's heap, build the model after runtime::heap_for_setup() and call this after
/// runtime::heap_for_steps(), as a worker does; in a fresh process, since a probe after other work
/// finds less.
int64_t measure_step_activations(ZooModelImpl& model, int64_t rows,
                                 optim::Precision precision = optim::Precision::kFp32);

}  // namespace cohort::models

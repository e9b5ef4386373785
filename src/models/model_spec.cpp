#include "cohort/models/model_spec.h"

#include <torch/torch.h>

#include "cohort/error.h"
#include "cohort/parallel/mesh.h"
#include "cohort/train/context.h"
#include "cohort/train/memory_estimate.h"

namespace cohort::models {

namespace {

// The mesh's pipeline ranks (1 without a mesh).
int pipeline_ranks() {
  const auto& ctx = train::get_context();
  return ctx.has_mesh() ? ctx.get_mesh().shape().pp : 1;
}

// A transformer (vit, gpt) whose blocks are cut over the mesh's tp group, beside the dense model
// of the same seed that checkpoints hold.
template <typename Transformer>
train::ModelSpec tensor_parallel_spec(const std::string& name, const ModelOptions& options,
                                      uint64_t seed, const comm::ProcessGroup& tp) {
  // A mesh holds the whole model (and the dense one beside it): nothing to defer.
  auto dense_options = options;
  dense_options.deferred_init = false;
  auto sliced_options = dense_options;
  sliced_options.tensor_parallel_group = tp;
  // The dense model made first: after the same seed, the sliced model's weights are its slices.
  torch::manual_seed(seed);
  auto dense = std::dynamic_pointer_cast<Transformer>(create_model(name, dense_options));
  torch::manual_seed(seed);
  auto sliced = std::dynamic_pointer_cast<Transformer>(create_model(name, sliced_options));
  train::ModelSpec spec;
  spec.module = sliced;
  spec.forward = [sliced](const at::Tensor& x) { return sliced->forward(x); };
  spec.layers = pipeline_layers(*sliced, pipeline_ranks());
  spec.dense = dense;
  spec.copy_to_dense = [sliced, dense] { sliced->copy_to_dense(*dense); };
  spec.load_from_dense = [sliced, dense] { sliced->load_from_dense(*dense); };
  return spec;
}

}  // namespace

train::ModelSpec model_spec(const std::string& name, ModelOptions options, uint64_t seed) {
  const auto& ctx = train::get_context();
  const bool mesh = ctx.has_mesh();
  if (mesh && ctx.get_mesh().shape().tp > 1) {
    const auto& tp = ctx.get_mesh().tp();
    if (name == "gpt") return tensor_parallel_spec<GptImpl>(name, options, seed, tp);
    // Only the transformers have tensor-parallel layers: create_model names the fix for others.
    if (name != "vit") {
      auto sliced_options = options;
      sliced_options.tensor_parallel_group = tp;
      create_model(name, sliced_options);
    }
    return tensor_parallel_spec<VisionTransformerImpl>(name, options, seed, tp);
  }
  torch::manual_seed(seed);
  auto model = create_model(name, options);
  train::ModelSpec spec;
  spec.module = model;
  spec.forward = [model](const at::Tensor& x) { return model->forward(x); };
  if (mesh) spec.layers = pipeline_layers(*model, pipeline_ranks());
  return spec;
}

void check_plan(const std::string& name, const ModelOptions& options, const train::Plan& plan) {
  if (plan.tp > 1 && name != "vit" && name != "gpt") {
    throw UsageError("--tp " + std::to_string(plan.tp) + ": " + name +
                     " has no tensor-parallel layers; use --model vit or gpt, or --pp to cut " +
                     name + " into pipeline stages");
  }
  if (plan.tp > 1 &&
      (options.heads % plan.tp != 0 || (options.width * options.mlp_ratio) % plan.tp != 0)) {
    throw UsageError("--tp " + std::to_string(plan.tp) + " must divide the " + name + "'s " +
                     std::to_string(options.heads) + " heads (--heads) and " +
                     std::to_string(options.width * options.mlp_ratio) + " MLP features (" +
                     std::to_string(options.mlp_ratio) + " x --width)");
  }
  if (plan.pp <= 1) return;
  auto shape = options;
  shape.deferred_init = true;  // its layers, without their weights
  const auto model = create_model(name, shape);
  const int stages = plan.pp * plan.virtual_stages();
  const auto layers = static_cast<int>(model->pipeline_layers()->size());
  if (layers < stages) {
    throw UsageError(
        name + " has " + std::to_string(layers) + " layers, too few for " + std::to_string(stages) +
        " pipeline stages (--pp " + std::to_string(plan.pp) +
        (plan.virtual_stages() > 1 ? ", 2 per worker with --schedule interleaved" : "") +
        "): use a smaller --pp or a deeper model (resnet18 has 10, vit and gpt --layers + 2)");
  }
}

int64_t measure_step_activations(ZooModelImpl& model, int64_t rows, optim::Precision precision) {
  const auto [x, y] = model.sample_batch(rows);
  model.train();
  // Two steps: the first lands in a heap that grows to fit it; the second reuses the first's
  // freed blocks in another order, and the heap grows again by what does not fit the holes, as
  // a worker's steps find it (the zoo's GPT: 566 MB after one step, 612 MB after two, 637 MB
  // after three, at half again the probe's time).
  return train::measure_step_memory(model, [&] {
    for (int step = 0; step < 2; ++step) {
      at::Tensor loss;
      {
        optim::AutocastGuard autocast(precision, torch::kCPU);
        loss = logits_cross_entropy(model.forward(x), y);
      }
      loss.backward();
    }
  });
}

}  // namespace cohort::models

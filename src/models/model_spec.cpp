#include "cohort/models/model_spec.h"

#include <torch/torch.h>

#include "cohort/parallel/mesh.h"
#include "cohort/train/context.h"

namespace cohort::models {

train::ModelSpec model_spec(const std::string& name, ModelOptions options, uint64_t seed) {
  const auto& ctx = train::get_context();
  const bool mesh = ctx.has_mesh();
  train::ModelSpec spec;
  if (mesh && ctx.get_mesh().shape().tp > 1) {
    auto sliced_options = options;
    sliced_options.tensor_parallel_group = ctx.get_mesh().tp();
    // Only the ViT has tensor-parallel layers: create_model names the fix for the others.
    if (name != "vit") create_model(name, sliced_options);
    // The dense ViT that checkpoints hold, made first: after the same seed, the sliced model's
    // weights are its slices.
    torch::manual_seed(seed);
    auto dense = std::static_pointer_cast<VisionTransformerImpl>(create_model(name, options));
    torch::manual_seed(seed);
    auto sliced =
        std::static_pointer_cast<VisionTransformerImpl>(create_model(name, sliced_options));
    spec.module = sliced;
    spec.forward = [sliced](const at::Tensor& x) { return sliced->forward(x); };
    spec.layers = sliced->pipeline_layers();
    spec.dense = dense;
    spec.copy_to_dense = [sliced, dense] { sliced->copy_to_dense(*dense); };
    spec.load_from_dense = [sliced, dense] { sliced->load_from_dense(*dense); };
    return spec;
  }
  torch::manual_seed(seed);
  auto model = create_model(name, options);
  spec.module = model;
  spec.forward = [model](const at::Tensor& x) { return model->forward(x); };
  if (mesh) spec.layers = model->pipeline_layers();
  return spec;
}

}  // namespace cohort::models

// A model file (model.safetensors): what save_model writes and load_model checks, shared with
// ZeRO stage 3's unit-by-unit save and load (zero_checkpoint.h).
#pragma once
#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include "cohort/train/safetensors_header.h"

namespace cohort::train::detail {

// The module's parameters and buffers by their dotted names.
std::map<std::string, at::Tensor> model_tensors(const torch::nn::Module& module);
// Before anything is loaded: a UsageError naming the first of the module's tensors (parameters,
// then buffers, in the module's order) that `file` lacks or holds with another shape, else the
// first tensor of `file` (by name) that the module lacks.
void check_model_file(const std::filesystem::path& file, const torch::nn::Module& module,
                      const std::map<std::string, std::vector<int64_t>>& shapes_in_file);
// Fills `target` with elements [first, first + target.numel()) of tensor `name` of `file`: read
// straight into it when it is a contiguous CPU tensor of the file's dtype, else through a staging
// tensor of its size. A load then holds at most one tensor beside the model, never the file.
void read_into(const std::filesystem::path& file, const safetensors::Header& header,
               const std::string& name, int64_t first, at::Tensor& target);

}  // namespace cohort::train::detail

namespace cohort::safetensors {

// The bytes of a safetensors file before its tensors' (the header's length and the header), for
// tensors of `layout` (each name's dtype and shape) and `metadata`: safetensors::write's.
// `data_bytes` is set to the bytes of the tensors that follow: in name order, or in `order` (the
// layout's names, each once) where given.
std::string file_prefix(
    const std::map<std::string, std::pair<at::ScalarType, std::vector<int64_t>>>& layout,
    const std::map<std::string, std::string>& metadata, int64_t& data_bytes,
    const std::vector<std::string>& order = {});

}  // namespace cohort::safetensors

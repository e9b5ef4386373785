// The row sources behind Dataset's factory functions.
#pragma once
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "data/plan.h"

namespace cohort::data {

std::shared_ptr<const Source> make_tensor_source(std::map<std::string, at::Tensor> columns,
                                                 std::string description);
// Builds the real source on first use; `rows` >= 0: its size, known without building it.
std::shared_ptr<const Source> make_lazy_source(std::function<std::shared_ptr<const Source>()> make,
                                               std::string description, int64_t rows = -1);
std::shared_ptr<const Source> make_synthetic_image_source(int64_t rows,
                                                          const SyntheticImageOptions& options);
std::shared_ptr<const Source> make_csv_source(const std::filesystem::path& path,
                                              const CsvOptions& options);
std::shared_ptr<const Source> make_image_folder_source(const std::filesystem::path& dir,
                                                       const ImageFolderOptions& options);

}  // namespace cohort::data

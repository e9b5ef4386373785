// The RunConfig of a test's run.
#pragma once
#include <chrono>
#include <filesystem>
#include <string>

#include "cohort/train/config.h"

namespace cohort::testing {

// A silent run `name` under `dir`, with deadlines that end a hung test within a minute.
inline RunConfig quiet_run(const std::filesystem::path& dir, const std::string& name) {
  return RunConfig{.name = name,
                   .storage_path = dir,
                   .verbose = 0,
                   .setup_timeout = std::chrono::seconds(60),
                   .collective_timeout = std::chrono::seconds(60)};
}

}  // namespace cohort::testing

// Debian's netlib reference BLAS, for the tests that put it under libtorch (LD_PRELOAD).
#pragma once
#include <filesystem>
#include <string>

namespace cohort::testing {

// Debian's libblas3 library where it is installed, whichever library libblas.so.3 points to;
// empty otherwise.
inline std::string reference_blas_file() {
  for (const auto* dir : {"/usr/lib/x86_64-linux-gnu/blas", "/usr/lib/aarch64-linux-gnu/blas"}) {
    const auto file = std::filesystem::path(dir) / "libblas.so.3";
    if (std::filesystem::exists(file)) return file.string();
  }
  return "";
}

}  // namespace cohort::testing

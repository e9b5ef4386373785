/// \file
/// Which BLAS libtorch's CPU matrix products run on. Debian's libtorch calls the system's
/// libblas.so.3 (the alternatives system picks the library behind it), and where nothing else is
/// installed that is netlib's reference BLAS (Debian's libblas3): plain loops on one thread. On a
/// 2-vCPU machine a ViT step (batch 128) took 1.59 s on it and 0.10 s on OpenBLAS; convolutions
/// (oneDNN) are not affected. A worker prints blas_advice() when it is not empty.
#pragma once

#include <string>

namespace cohort::runtime {

/// The library that provides sgemm_ to this process, as far as the process can tell.
struct BlasLibrary {
  /// The file sgemm_ comes from, symbolic links resolved; empty when no library in the process
  /// exports it (a libtorch that carries its own BLAS, as PyTorch's wheels carry MKL).
  std::string path;
  /// What it is: "OpenBLAS <its configuration>", "BLIS <version>", "MKL", "the reference BLAS",
  /// or "unknown" (another BLAS, or none found).
  std::string name;
  /// Whether it is netlib's reference BLAS as Debian installs it (libblas3, under .../blas/):
  /// unoptimised and single-threaded.
  bool reference = false;
};

/// Looks the library up (dlsym and dladdr on sgemm_, then each optimised BLAS's own entry points
/// in that library). Cheap; nothing is cached.
BlasLibrary blas_library();

/// One line saying that libtorch's matrix products run on the reference BLAS and how to get an
/// optimised one, where they do (workers print it, and `cohort env` as a warning); empty
/// otherwise.
std::string blas_advice();

}  // namespace cohort::runtime

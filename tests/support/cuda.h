// CUDA tests run where a GPU is; elsewhere they are skipped with the reason printed.
#pragma once
#include <gtest/gtest.h>
#include <torch/cuda.h>

#define COHORT_REQUIRE_CUDA()                                                                \
  do {                                                                                       \
    if (!torch::cuda::is_available()) {                                                      \
      GTEST_SKIP() << "no CUDA device: this libtorch is a CPU build or the host has no GPU " \
                      "(scripts/gpu_check.sh runs these on a GPU host)";                     \
    }                                                                                        \
  } while (0)

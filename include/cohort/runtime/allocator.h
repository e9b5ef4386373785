/// \file
/// Writing a c10::Allocator for every libtorch cohort builds with (1.13 on): libtorch 2.3 made
/// Allocator::allocate non-const and added copy_data, which each allocator then defines.
///
///     c10::DataPtr allocate(size_t bytes) COHORT_ALLOCATE_CONST override;
///     #if COHORT_ALLOCATOR_COPIES_DATA
///     void copy_data(void* dest, const void* src, std::size_t count) const override;
///     #endif
#pragma once

#include <torch/version.h>

/// 1 where an allocator must define Allocator::copy_data (libtorch 2.3 on), 0 before.
#define COHORT_ALLOCATOR_COPIES_DATA \
  (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3))

/// \def COHORT_ALLOCATE_CONST
/// The qualifier of Allocator::allocate: empty from libtorch 2.3 on, `const` before.
#if COHORT_ALLOCATOR_COPIES_DATA
#define COHORT_ALLOCATE_CONST
#else
#define COHORT_ALLOCATE_CONST const
#endif

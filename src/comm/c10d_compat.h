// What differs between the libtorch lines cohort builds against (Debian's 1.13 and 2.x), in one
// place. Private to comm/, the only layer that includes c10d.
#pragma once
#include <torch/version.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#else
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#endif

namespace cohort::comm {

// The c10d class a transport (ProcessGroupGloo, ProcessGroupNCCL) derives from.
#if TORCH_VERSION_MAJOR >= 2
using NativeGroup = c10d::Backend;
#else
using NativeGroup = c10d::ProcessGroup;
#endif

// libtorch 2.x types a collective's failure (c10::DistNetworkError for a broken connection,
// c10::DistBackendError for a backend's own error); 1.13 throws the transport's exception.
constexpr bool kTypedDistErrors = TORCH_VERSION_MAJOR >= 2;

}  // namespace cohort::comm

#include "cohort/runtime/gpu_usage.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include "support/cuda.h"

namespace cohort::runtime {
namespace {

// NVML's interface through a stand-in library (tests/support/fake_nvml.cpp): what a host with
// NVIDIA's driver answers, on a host without one.
TEST(GpuUsage, AProcessesMemoryIsSummedOverItsGpusAndItsUtilisationIsTheBusiest) {
  const Nvml nvml(COHORT_FAKE_NVML_PATH);
  ASSERT_TRUE(nvml.available()) << nvml.error();
  const int self = ::getpid();
  // pid 1 holds memory NVML cannot tell; 999999 runs on no GPU.
  const auto usage = nvml.usage_of({self, 1, 999999});
  ASSERT_EQ(usage.count(self), 1u);
  EXPECT_EQ(usage.at(self).memory_mb, 1536 + 512);  // found after 40 others on device 1
  EXPECT_EQ(usage.at(self).utilization, 70);
  ASSERT_EQ(usage.count(1), 1u);
  EXPECT_EQ(usage.at(1).memory_mb, 0);
  EXPECT_EQ(usage.count(999999), 0u);
  EXPECT_TRUE(nvml.usage_of({}).empty());
}

TEST(GpuUsage, WithoutNvidiasLibraryThereIsNothingToReportAndTheReasonIsSaid) {
  const Nvml nvml("/nonexistent/libnvidia-ml.so.1");
  EXPECT_FALSE(nvml.available());
  EXPECT_NE(nvml.error().find("cannot load /nonexistent/libnvidia-ml.so.1"), std::string::npos)
      << nvml.error();
  EXPECT_TRUE(nvml.usage_of({::getpid()}).empty());
  // A library that is not NVML.
  const Nvml other("libc.so.6");
  EXPECT_FALSE(other.available());
  EXPECT_NE(other.error().find("lacks an NVML function"), std::string::npos) << other.error();
}

// The driver's own library, where a GPU is: this process's CUDA memory is seen under its pid.
TEST(GpuUsage, TheDriversLibrarySeesThisProcessesGpuMemory) {
  COHORT_REQUIRE_CUDA();
  const Nvml nvml;
  ASSERT_TRUE(nvml.available()) << nvml.error();
  const auto held = torch::empty({256 << 20}, torch::dtype(torch::kUInt8).device(torch::kCUDA));
  torch::cuda::synchronize();
  const auto usage = nvml.usage_of({::getpid()});
  ASSERT_EQ(usage.count(::getpid()), 1u) << "NVML lists no compute process with this pid";
  EXPECT_GE(usage.at(::getpid()).memory_mb, 256);
  EXPECT_GE(usage.at(::getpid()).utilization, 0);
  EXPECT_LE(usage.at(::getpid()).utilization, 100);
}

}  // namespace
}  // namespace cohort::runtime

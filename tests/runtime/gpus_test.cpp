#include "cohort/runtime/gpus.h"

#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <cstdlib>
#include <optional>
#include <string>

#include "cohort/error.h"
#include "support/expect.h"

namespace cohort::runtime {
namespace {

using cohort::testing::expect_error;

// Sets CUDA_VISIBLE_DEVICES for one scope and puts back what was there.
class VisibleDevices {
 public:
  explicit VisibleDevices(const char* value) {
    if (const char* old = std::getenv("CUDA_VISIBLE_DEVICES")) saved_ = old;
    ::setenv("CUDA_VISIBLE_DEVICES", value, 1);
  }
  ~VisibleDevices() {
    if (saved_) {
      ::setenv("CUDA_VISIBLE_DEVICES", saved_->c_str(), 1);
    } else {
      ::unsetenv("CUDA_VISIBLE_DEVICES");
    }
  }

 private:
  std::optional<std::string> saved_;
};

TEST(Gpus, VisibleDevicesStopAtTheFirstEntryThatNamesNone) {
  {
    VisibleDevices v("2,4,-1,5");
    EXPECT_EQ(visible_gpus(), (std::vector<std::string>{"2", "4"}));
  }
  {
    VisibleDevices v("GPU-8a1c,GPU-77f0");
    EXPECT_EQ(visible_gpus(), (std::vector<std::string>{"GPU-8a1c", "GPU-77f0"}));
  }
  VisibleDevices v("");
  EXPECT_TRUE(visible_gpus().empty());
}

TEST(Gpus, EachSlotGetsItsOwnGpusInOrder) {
  const std::vector<std::string> node{"3", "5", "7", "9"};
  EXPECT_EQ(gpus_of_slot(node, 0, 1), "3");
  EXPECT_EQ(gpus_of_slot(node, 3, 1), "9");
  EXPECT_EQ(gpus_of_slot(node, 1, 2), "7,9");
  expect_error<UsageError>([&] { gpus_of_slot(node, 2, 2); },
                           "worker slot 2 needs GPU #4 but the node has 4 GPUs");
}

TEST(Gpus, ALaunchedRankTakesItsLocalRanksGpus) {
  EXPECT_EQ(device_index_of_local_rank(3, 1, 1), 0);  // the launcher gave it its own GPU
  EXPECT_EQ(device_index_of_local_rank(1, 2, 4), 2);
  EXPECT_EQ(device_index_of_local_rank(0, 1, 8), 0);
  expect_error<UsageError>(
      [] { device_index_of_local_rank(2, 1, 2); },
      "local rank 2 with 1 GPUs per worker needs GPUs 2-2 but this node shows 2");
}

TEST(Gpus, RequestsAreCheckedBeforeWorkersStart) {
  EXPECT_EQ(check_gpu_request(false, 0, 4, {}), 0);
  expect_error<UsageError>([] { check_gpu_request(false, 2, 1, {}); },
                           "resources_per_worker.gpus = 2 without use_gpu");
  expect_error<UsageError>([] { check_gpu_request(true, -1, 1, {}); }, "gpus = -1 is negative");
  if (!torch::cuda::is_available()) {
    expect_error<UsageError>([] { check_gpu_request(true, 0, 1, {"0"}); },
                             "use_gpu is set but this libtorch sees no CUDA device");
  } else {
    EXPECT_EQ(check_gpu_request(true, 0, 1, {"0"}), 1);
    expect_error<UsageError>(
        [] {
          check_gpu_request(true, 2, 2, {"0", "1", "2"});
        },
        "2 workers x 2 GPUs need 4 GPUs, but this node has 3 (0,1,2)");
  }
}

}  // namespace
}  // namespace cohort::runtime

#include "train/run_status.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>

#include "cohort/train/dashboard.h"
#include "support/tiny_mnist.h"

namespace cohort::train {
namespace {

namespace fs = std::filesystem;

// A worker on a GPU gets its GPU memory and utilisation in status.json and /metrics, from NVML:
// here a stand-in library with NVML's interface (tests/support/fake_nvml.cpp), which has this
// process on two GPUs. A worker on the CPU gets none.
TEST(RunStatus, AWorkerOnAGpuShowsItsGpuMemoryAndUtilisation) {
  const runtime::Nvml nvml(COHORT_FAKE_NVML_PATH);
  ASSERT_TRUE(nvml.available()) << nvml.error();
  const auto storage = testing::temp_dir("run_status_gpu");
  std::ofstream(storage / "metrics.jsonl") << "{\"training_iteration\": 1}\n";
  RunStatus status(storage, &nvml);
  status.on_group_start({::getpid(), ::getpid()}, {"cuda:0", "cpu"});
  status.on_training();
  status.write("running", Json::array(), true);
  const auto written = Json::parse(std::ifstream(storage / kStatusFile));
  const auto& workers = written.at("workers");
  ASSERT_EQ(workers.size(), 2u);
  EXPECT_EQ(workers[0].value("gpu_memory_mb", -1.0), 2048.0) << workers[0].dump();
  EXPECT_EQ(workers[0].value("gpu_utilization", -1.0), 70.0) << workers[0].dump();
  EXPECT_FALSE(workers[1].contains("gpu_memory_mb")) << workers[1].dump();
  const std::string text = prometheus_metrics(storage.parent_path());
  const std::string run = storage.filename().string();
  for (const std::string& line :
       {"cohort_rank_gpu_memory_bytes{run=\"" + run + "\",rank=\"0\"} 2147483648.0\n",
        "cohort_rank_gpu_utilization_ratio{run=\"" + run + "\",rank=\"0\"} 0.7\n"}) {
    EXPECT_NE(text.find(line), std::string::npos) << line << " missing from\n" << text;
  }
  fs::remove_all(storage);
}

// A worker that failed and was replaced (live recovery) shows the replacement's pid, starting up.
TEST(RunStatus, AReplacedWorkerShowsItsReplacement) {
  const auto storage = testing::temp_dir("run_status_restart");
  RunStatus status(storage);
  status.on_group_start({::getpid(), ::getppid()}, {"cpu", "cpu"});
  status.on_training();
  status.on_exit(1, /*ok=*/false);
  status.on_restart(1, ::getpid());
  status.write("running", Json::array(), true);
  const auto workers = Json::parse(std::ifstream(storage / kStatusFile)).at("workers");
  ASSERT_EQ(workers.size(), 2u);
  EXPECT_EQ(workers[1]["pid"], ::getpid()) << workers.dump();
  EXPECT_EQ(workers[1]["state"], "starting") << workers.dump();
  EXPECT_EQ(workers[0]["state"], "running") << workers.dump();
  fs::remove_all(storage);
}

}  // namespace
}  // namespace cohort::train

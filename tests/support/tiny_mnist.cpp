#include "support/tiny_mnist.h"

#include <cstdlib>
#include <system_error>
#include <vector>

#include <torch/torch.h>
#include <unistd.h>

#include "cohort/data/idx.h"
#include "cohort/runtime/worker_info.h"

namespace cohort::testing {

std::filesystem::path write_tiny_mnist(const std::filesystem::path& dir, int64_t n_train,
                                       int64_t n_test, bool gzip) {
  std::filesystem::create_directories(dir);
  auto generator = torch::make_generator<at::CPUGeneratorImpl>(1234);
  const std::string ext = gzip ? ".gz" : "";
  for (auto [stem, n] : {std::pair<std::string, int64_t>{"train", n_train}, {"t10k", n_test}}) {
    auto labels = torch::randint(0, 10, {n}, generator, torch::kLong);
    // Class c lights up row band c; noise on top.
    auto images = torch::rand({n, 28, 28}, generator) * 60;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t c = labels[i].item<int64_t>();
      images[i].narrow(0, 2 + c * 2, 3).add_(150);
    }
    data::write_idx(dir / (stem + "-images-idx3-ubyte" + ext),
                    images.clamp(0, 255).to(torch::kUInt8));
    data::write_idx(dir / (stem + "-labels-idx1-ubyte" + ext), labels.to(torch::kUInt8));
  }
  return dir;
}

std::filesystem::path temp_dir(const std::string& tag) {
  // A worker (or trial) re-executing a test gets the folder of the test process, untouched.
  const bool spawned = !runtime::spawned_role().empty();
  const char* root = std::getenv(kTestRootPidVar);
  auto dir = std::filesystem::temp_directory_path() /
             ("cohort_test_" + tag + "_" + (spawned && root ? root : std::to_string(::getpid())));
  if (spawned) return dir;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  // The test process removes its folders when it exits, whether or not the test did.
  static std::vector<std::filesystem::path> made;
  if (made.empty()) {
    std::atexit([] {
      std::error_code ignored;
      for (const auto& d : made) std::filesystem::remove_all(d, ignored);
    });
  }
  made.push_back(dir);
  return dir;
}

}  // namespace cohort::testing

// A small MNIST-format data set written by tests, so they do not depend on the real one.
#pragma once
#include <filesystem>

namespace cohort::testing {

// Writes train (n_train) and test (n_test) IDX files, gzipped or not, with learnable labels
// (each class has its own brightness pattern). Returns `dir`.
std::filesystem::path write_tiny_mnist(const std::filesystem::path& dir, int64_t n_train = 512,
                                       int64_t n_test = 128, bool gzip = true);

// The pid of the test process, set by the test main for the processes it starts.
inline constexpr const char* kTestRootPidVar = "COHORT_TEST_ROOT_PID";

// A fresh empty folder under the system temp dir, unique to this test process and `tag`. In a
// worker that the test started, the same folder as its driver's, left as it is.
std::filesystem::path temp_dir(const std::string& tag);

}  // namespace cohort::testing

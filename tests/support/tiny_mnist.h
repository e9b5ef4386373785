// Small data sets written by tests, so they do not depend on the real ones: MNIST-format files, an
// image folder and a CSV, each with learnable labels.
#pragma once
#include <filesystem>

namespace cohort::testing {

// Writes train (n_train) and test (n_test) IDX files, gzipped or not, with learnable labels
// (each class has its own brightness pattern). Returns `dir`.
std::filesystem::path write_tiny_mnist(const std::filesystem::path& dir, int64_t n_train = 512,
                                       int64_t n_test = 128, bool gzip = true);

// An image folder of `classes` sub-folders ("class0", ...) of `per_class` size x size grayscale
// PGM images each (class c lights up its own row band); under dir/train and dir/test (with a
// quarter as many test images) when `split_folders`. Returns `dir`.
std::filesystem::path write_tiny_image_folder(const std::filesystem::path& dir, int classes = 3,
                                              int per_class = 40, int size = 28,
                                              bool split_folders = false);

// A CSV of `rows` rows: a header "f0,...,f<features-1>,label" and features whose mean depends on
// the label (0 .. classes-1). Returns `file`.
std::filesystem::path write_tiny_csv(const std::filesystem::path& file, int64_t rows = 300,
                                     int features = 6, int classes = 3);

// The pid of the test process, set by the test main for the processes it starts.
inline constexpr const char* kTestRootPidVar = "COHORT_TEST_ROOT_PID";

// A fresh empty folder under the system temp dir, unique to this test process and `tag`. In a
// worker that the test started, the same folder as its driver's, left as it is.
std::filesystem::path temp_dir(const std::string& tag);

}  // namespace cohort::testing

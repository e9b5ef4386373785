#include "support/tiny_mnist.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>
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

namespace {

// One grayscale image of class `c` (its band lit, noise on top) as a binary PGM file.
void write_pgm(const std::filesystem::path& file, int size, int64_t c, at::Generator& generator) {
  auto image = torch::rand({size, size}, generator) * 60;
  const int64_t band = (c * 3) % std::max(1, size - 3);
  image.narrow(0, band, 3).add_(150);
  auto pixels = image.clamp(0, 255).to(torch::kUInt8).contiguous();
  std::ofstream out(file, std::ios::binary);
  out << "P5\n" << size << " " << size << "\n255\n";
  out.write(reinterpret_cast<const char*>(pixels.data_ptr<uint8_t>()), size * size);
}

}  // namespace

std::filesystem::path write_tiny_image_folder(const std::filesystem::path& dir, int classes,
                                              int per_class, int size, bool split_folders) {
  auto generator = torch::make_generator<at::CPUGeneratorImpl>(4321);
  const auto write = [&](const std::filesystem::path& root, int count) {
    for (int c = 0; c < classes; ++c) {
      const auto folder = root / ("class" + std::to_string(c));
      std::filesystem::create_directories(folder);
      for (int i = 0; i < count; ++i)
        write_pgm(folder / (std::to_string(i) + ".pgm"), size, c, generator);
    }
  };
  if (split_folders) {
    write(dir / "train", per_class);
    write(dir / "test", std::max(1, per_class / 4));
  } else {
    write(dir, per_class);
  }
  return dir;
}

std::filesystem::path write_tiny_csv(const std::filesystem::path& file, int64_t rows, int features,
                                     int classes) {
  std::filesystem::create_directories(file.parent_path());
  auto generator = torch::make_generator<at::CPUGeneratorImpl>(99);
  auto labels = torch::randint(0, classes, {rows}, generator, torch::kLong);
  auto values = torch::randn({rows, features}, generator, torch::kDouble);
  std::ofstream out(file);
  for (int f = 0; f < features; ++f) out << "f" << f << ",";
  out << "label\n";
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t c = labels[r].item<int64_t>();
    for (int f = 0; f < features; ++f) {
      // Feature c carries the class; the scale of another column tests the standardisation.
      const double shift = f == c % features ? 3.0 : 0.0;
      out << (values[r][f].item<double>() + shift) * (f == features - 1 ? 100.0 : 1.0) << ",";
    }
    out << c << "\n";
  }
  return file;
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

#include "cohort/runtime/blas.h"

#include <ATen/ATen.h>
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <string>

#include "support/reference_blas.h"
#include "support/scoped_variable.h"

namespace cohort::runtime {
namespace {

using cohort::testing::reference_blas_file;
using cohort::testing::ScopedVariable;

TEST(Blas, NamesTheLibraryWhoseSgemmTheProcessCalls) {
  // A product first, so that libtorch has done whatever loading its BLAS takes.
  ASSERT_EQ(at::mm(at::ones({2, 3}), at::ones({3, 2})).sum().item<float>(), 12.0f);
  const auto blas = blas_library();
  if (blas.path.empty()) {
    EXPECT_EQ(dlsym(RTLD_DEFAULT, "sgemm_"), nullptr) << "a library exports sgemm_, not found";
    GTEST_SKIP() << "no library of this process exports sgemm_ (libtorch carries its own BLAS)";
  }
  void* handle = dlopen(blas.path.c_str(), RTLD_LAZY | RTLD_NOLOAD);
  ASSERT_NE(handle, nullptr) << blas.path << " is not a library this process has loaded";
  EXPECT_EQ(dlsym(handle, "sgemm_"), dlsym(RTLD_DEFAULT, "sgemm_")) << blas.path;
  dlclose(handle);
  EXPECT_FALSE(blas.name.empty());
  // Debian's optimised libraries, each in a folder of its own (openblas-openmp/, blis-pthread/):
  // their libblas.so.3 is a thin library over the one that says what it is.
  const auto folder = std::filesystem::path(blas.path).parent_path().filename().string();
  if (folder.starts_with("openblas")) {
    EXPECT_TRUE(blas.name.starts_with("OpenBLAS")) << blas.name;
  }
  if (folder.starts_with("blis")) {
    EXPECT_TRUE(blas.name.starts_with("BLIS")) << blas.name;
  }
  EXPECT_EQ(blas.reference, !blas_advice().empty()) << blas.name;
  std::cout << "this process's BLAS: " << blas.name << " (" << blas.path << ")" << std::endl;
}

// The reference library put first (as libblas.so.3 pointing to it would), in a process of its
// own: it is named, with what to install.
TEST(Blas, TheReferenceBlasIsNamedWithWhatToInstallInstead) {
  const auto reference = reference_blas_file();
  if (reference.empty()) {
    GTEST_SKIP() << "Debian's reference BLAS (libblas3, <libdir>/blas/libblas.so.3) is not "
                    "installed here";
  }
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const ScopedVariable preload("LD_PRELOAD", reference.c_str());
#ifdef __SANITIZE_ADDRESS__
  // AddressSanitizer's runtime must otherwise come first of the libraries a process loads.
  const ScopedVariable asan("ASAN_OPTIONS", "verify_asan_link_order=0:detect_leaks=0");
#endif
  EXPECT_EXIT(
      {
        const auto blas = blas_library();
        const auto advice = blas_advice();
        std::cerr << blas.name << "|" << advice << std::endl;
        std::exit(blas.reference ? 0 : 1);
      },
      ::testing::ExitedWithCode(0),
      "the reference BLAS\\|libtorch's matrix products run on the reference BLAS "
      "\\(/.*/blas/libblas\\.so\\.3.*\\).*install an optimised BLAS.*apt install "
      "libopenblas0-openmp");
}

}  // namespace
}  // namespace cohort::runtime

#include "cohort/runtime/blas.h"

#include <dlfcn.h>

#include <filesystem>
#include <system_error>

namespace cohort::runtime {

BlasLibrary blas_library() {
  BlasLibrary blas{.name = "unknown"};
  // What libtorch's calls resolve to: the first definition in the process's global scope.
  void* sgemm = dlsym(RTLD_DEFAULT, "sgemm_");
  Dl_info info{};
  if (sgemm == nullptr || dladdr(sgemm, &info) == 0 || info.dli_fname == nullptr) return blas;
  std::error_code error;
  const auto resolved = std::filesystem::canonical(info.dli_fname, error);
  blas.path = error ? std::string(info.dli_fname) : resolved.string();
  void* handle = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
  if (handle == nullptr) return blas;
  // dlsym on the handle searches the library and then the ones it depends on: Debian's OpenBLAS and
  // BLIS install libblas.so.3 as a thin library of the BLAS symbols over libopenblas.so.0 or
  // libblis.so.4, which define their own entry points.
  if (void* config = dlsym(handle, "openblas_get_config")) {
    blas.name = reinterpret_cast<const char* (*)()>(config)();  // "OpenBLAS 0.3.21 ..."
  } else if (void* version = dlsym(handle, "bli_info_get_version_str")) {
    blas.name = std::string("BLIS ") + reinterpret_cast<const char* (*)()>(version)();
  } else if (dlsym(handle, "mkl_get_version_string") != nullptr ||
             dlsym(handle, "MKL_Get_Version_String") != nullptr) {
    blas.name = "MKL";
  } else if (!error && resolved.parent_path().filename() == "blas") {
    // Debian's libblas3 installs netlib's library as <libdir>/blas/libblas.so.3.*; the optimised
    // ones sit in folders of their own (openblas-openmp/, blis-pthread/, atlas/ ...).
    blas.name = "the reference BLAS";
    blas.reference = true;
  }
  dlclose(handle);
  return blas;
}

std::string blas_advice() {
  const auto blas = blas_library();
  if (!blas.reference) return "";
  return "libtorch's matrix products run on the reference BLAS (" + blas.path +
         "), unoptimised and on one thread: linear layers and attention run several times slower "
         "than on an optimised one; install an optimised BLAS, which libblas.so.3 then points to "
         "(Debian: apt install libopenblas0-openmp)";
}

}  // namespace cohort::runtime

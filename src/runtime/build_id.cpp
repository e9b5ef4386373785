// runtime::program_build_id (declared in process.h) apart from the spawning of processes, so
// that what reads it (the worker spec, and that spec's fuzz target) needs nothing else.
#include <elf.h>
#include <link.h>
#include <sys/stat.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "cohort/runtime/process.h"

namespace cohort::runtime {
namespace {

// The NT_GNU_BUILD_ID note of the executable (the first object dl_iterate_phdr reports).
int find_build_id(dl_phdr_info* info, size_t, void* out) {
  auto& id = *static_cast<std::string*>(out);
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const auto& ph = info->dlpi_phdr[i];
    if (ph.p_type != PT_NOTE) continue;
    const char* p = reinterpret_cast<const char*>(info->dlpi_addr + ph.p_vaddr);
    const char* end = p + ph.p_memsz;
    while (p + sizeof(ElfW(Nhdr)) <= end) {
      const auto* note = reinterpret_cast<const ElfW(Nhdr)*>(p);
      const char* name = p + sizeof(ElfW(Nhdr));
      const char* desc = name + ((note->n_namesz + 3) & ~3u);
      if (note->n_type == NT_GNU_BUILD_ID && note->n_namesz == 4 &&
          std::memcmp(name, "GNU", 4) == 0) {
        static const char* hex = "0123456789abcdef";
        for (uint32_t k = 0; k < note->n_descsz; ++k) {
          const auto byte = static_cast<unsigned char>(desc[k]);
          id += hex[byte >> 4];
          id += hex[byte & 15];
        }
        return 1;
      }
      p = desc + ((note->n_descsz + 3) & ~3u);
    }
  }
  return 1;  // only the executable
}

}  // namespace

std::string program_build_id() {
  static const std::string id = [] {
    std::string found;
    dl_iterate_phdr(find_build_id, &found);
    if (!found.empty()) return found;
    struct stat st {};
    if (::stat("/proc/self/exe", &st) != 0) return std::string("unknown");
    return "exe:" + std::to_string(st.st_size) + "-" + std::to_string(st.st_mtime);
  }();
  return id;
}

}  // namespace cohort::runtime

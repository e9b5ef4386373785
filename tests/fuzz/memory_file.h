// For fuzz targets whose decoder reads a file: a path that reads given bytes, an anonymous memory
// file of this process (nothing is written to disk, nothing is left behind).
#pragma once
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

namespace cohort::fuzz {

struct MemoryFile {
  int fd = -1;
  explicit MemoryFile(const std::string& content) : fd(memfd_create("fuzz-input", 0)) {
    if (fd < 0) std::abort();
    for (size_t done = 0; done < content.size();) {
      const ssize_t n = write(fd, content.data() + done, content.size() - done);
      if (n <= 0) std::abort();
      done += static_cast<size_t>(n);
    }
  }
  MemoryFile(const MemoryFile&) = delete;
  MemoryFile& operator=(const MemoryFile&) = delete;
  ~MemoryFile() { close(fd); }
  std::string path() const { return "/proc/self/fd/" + std::to_string(fd); }
};

}  // namespace cohort::fuzz

#include "cohort/runtime/control_channel.h"

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "cohort/error.h"
#include "cohort/runtime/worker_info.h"

namespace cohort::runtime {
namespace {

int control_fd() {
  static const int fd = [] {
    const char* value = std::getenv(kControlFdVar);
    return value ? std::atoi(value) : -1;
  }();
  return fd;
}

std::mutex& control_mutex() {
  static std::mutex mutex;
  return mutex;
}

}  // namespace

bool has_control_channel() { return control_fd() >= 0; }

void send_control_message(const std::string& line) {
  if (line.find('\n') != std::string::npos) {
    throw RuntimeError("control message must be one line");
  }
  const int fd = control_fd();
  if (fd < 0) throw RuntimeError("no control channel: this process was not started by a driver");
  std::string framed = line + "\n";
  std::lock_guard lock(control_mutex());
  const char* data = framed.data();
  size_t left = framed.size();
  while (left > 0) {
    ssize_t n = ::write(fd, data, left);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      throw RuntimeError(std::string("cannot reach the driver over the control channel: ") +
                         std::strerror(errno));
    }
    data += n;
    left -= static_cast<size_t>(n);
  }
}

}  // namespace cohort::runtime

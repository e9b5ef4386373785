#include "cohort/runtime/control_channel.h"

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

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

std::function<void(const std::string&)>& control_sink() {
  static std::function<void(const std::string&)> sink;
  return sink;
}

}  // namespace

void set_control_sink(std::function<void(const std::string&)> sink) {
  control_sink() = std::move(sink);
}

bool has_control_channel() { return control_fd() >= 0 || control_sink() != nullptr; }

void send_control_message(const std::string& line) {
  if (line.find('\n') != std::string::npos) {
    throw RuntimeError("control message must be one line");
  }
  if (control_sink()) {
    control_sink()(line);
    return;
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

namespace {

std::mutex& status_mutex() {
  static std::mutex mutex;
  return mutex;
}

std::function<std::string()>& status_source() {
  static std::function<std::string()> source;
  return source;
}

}  // namespace

void set_heartbeat_status(std::function<std::string()> status) {
  std::lock_guard lock(status_mutex());
  status_source() = std::move(status);
}

void start_heartbeat(std::chrono::milliseconds interval) {
  static std::once_flag started;
  if (!has_control_channel()) return;
  std::call_once(started, [interval] {
    std::thread([interval] {
      while (true) {
        std::string status = "null";
        {
          std::lock_guard lock(status_mutex());
          if (status_source()) status = status_source()();
        }
        try {
          send_control_message(R"({"type":"heartbeat","status":)" + status + "}");
        } catch (const std::exception&) {
          return;  // the driver is gone; PDEATHSIG ends this process
        }
        std::this_thread::sleep_for(interval);
      }
    }).detach();
  });
}

}  // namespace cohort::runtime

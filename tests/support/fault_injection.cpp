#include "support/fault_injection.h"

#include <fcntl.h>
#include <unistd.h>

#include "cohort/train/context.h"

namespace cohort::testing {

bool first_time_in_run(const std::string& tag) {
  const auto marker = train::get_context().get_storage_path() / ("injected-" + tag);
  const int fd = ::open(marker.c_str(), O_CREAT | O_EXCL | O_WRONLY, 0644);
  if (fd < 0) return false;
  ::close(fd);
  return true;
}

}  // namespace cohort::testing

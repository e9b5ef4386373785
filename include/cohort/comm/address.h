/// \file
/// "host:port" as every address of a run is written (the store, the coordinator, preprocessing
/// workers, --master), parsed and checked in one place.
#pragma once
#include <string>

namespace cohort::comm {

struct HostPort {
  std::string host;
  int port = 0;
};

/// Splits at the last colon; the host must not be empty and the port must be a whole number in
/// 0..65535. UsageError naming `what` ("--master", "coordinator address") and the value, with an
/// example, otherwise.
HostPort parse_host_port(const std::string& text, const std::string& what = "address");

}  // namespace cohort::comm

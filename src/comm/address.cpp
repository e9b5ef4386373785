#include "cohort/comm/address.h"

#include <algorithm>
#include <cctype>

#include "cohort/error.h"

namespace cohort::comm {

HostPort parse_host_port(const std::string& text, const std::string& what) {
  const auto colon = text.rfind(':');
  const auto bad = [&](const std::string& why) {
    return UsageError(what + " '" + text + "' " + why + ": give HOST:PORT, e.g. 10.0.0.1:29500");
  };
  if (colon == std::string::npos) throw bad("must be HOST:PORT");
  if (colon == 0) throw bad("names no host");
  HostPort address{.host = text.substr(0, colon)};
  const std::string port = text.substr(colon + 1);
  if (port.empty() || port.size() > 5 ||
      !std::all_of(port.begin(), port.end(), [](unsigned char c) { return std::isdigit(c); })) {
    throw bad("has no port number after its last colon");
  }
  address.port = std::stoi(port);
  if (address.port > 65535) throw bad("has port " + port + ", out of range (0..65535)");
  return address;
}

HostPort parse_etcd_endpoint(const std::string& text, const std::string& what) {
  const std::string scheme = "etcd://";
  if (text.compare(0, scheme.size(), scheme) != 0) {
    throw UsageError(what + " '" + text +
                     "' is no etcd endpoint: give etcd://HOST:PORT (an etcd's client URL, e.g. "
                     "etcd://10.0.0.9:2379), or leave it out for cohort's own store");
  }
  auto address = parse_host_port(text.substr(scheme.size()), what);
  if (address.port == 0) throw UsageError(what + " '" + text + "' needs etcd's client port");
  return address;
}

}  // namespace cohort::comm

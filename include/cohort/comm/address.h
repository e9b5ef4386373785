/// \file
/// "host:port" as every address of a run is written (the store, the coordinator, preprocessing
/// workers, --master), parsed and checked in one place.
#pragma once
#include <string>

namespace cohort::comm {

/// A host and a port, as parse_host_port() reads "host:port" (IPv6 in brackets).
struct HostPort {
  std::string host;  ///< a name or an address
  int port = 0;      ///< the TCP port
};

/// Splits at the last colon; the host must not be empty and the port must be a whole number in
/// 0..65535. UsageError naming `what` ("--master", "coordinator address") and the value, with an
/// example, otherwise.
HostPort parse_host_port(const std::string& text, const std::string& what = "address");

/// The etcd endpoint of a rendezvous given as "etcd://HOST:PORT" (`--rdzv`, COHORT_RDZV).
/// UsageError naming `what` and the value, with the form to give, for another scheme or a bad
/// address.
HostPort parse_etcd_endpoint(const std::string& text, const std::string& what);

}  // namespace cohort::comm

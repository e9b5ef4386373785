// A real etcd (Debian's etcd-server, which scripts/setup.sh unpacks into .tools/) on loopback for
// one test: its own free ports and data folder, stopped and removed when the test ends.
#pragma once
#include <memory>
#include <string>

#include "support/subprocess.h"

namespace cohort::testing {

class EtcdServer {
 public:
  // Starts etcd and waits until it serves; nullptr with `why_not` set when there is no etcd
  // binary (the test then skips, saying so). Fails the calling test when etcd does not start.
  static std::unique_ptr<EtcdServer> start(std::string& why_not);
  ~EtcdServer();
  EtcdServer(const EtcdServer&) = delete;
  EtcdServer& operator=(const EtcdServer&) = delete;

  int port() const { return port_; }  // its client port on 127.0.0.1
  std::string endpoint() const;       // "etcd://127.0.0.1:<port>"
  // POSTs JSON `body` to etcd's gateway at `path` (/v3/...) as another client would, and returns
  // the reply's body ("" when none came).
  std::string post(const std::string& path, const std::string& body) const;
  // Stops it at once (SIGKILL), as a lost host would.
  void kill();

 private:
  EtcdServer() = default;
  std::unique_ptr<Process> process_;
  std::string data_dir_;
  int port_ = 0;
};

// The etcd binary: .tools/etcd, else etcd on PATH; "" when there is none.
std::string etcd_binary();

}  // namespace cohort::testing

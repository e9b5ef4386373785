// cohort's own rendezvous store: a small TCP key-value server bound to one given address (c10d's
// TCPStore in libtorch 1.13 listens on every interface), and a client that is a c10d::Store, so
// Gloo rendezvous through it. A job id is checked when a client joins: two jobs given the same
// address fail fast instead of mixing their keys. Before that, each connection proves that it holds
// the job secret (comm/handshake.h). Private to comm/.
#pragma once
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cohort/comm/job_secret.h"
#include "comm/store_client.h"

namespace cohort::comm {

class TcpStoreServer {
 public:
  // Binds host:port (port 0: a free one) and serves on a thread until destroyed. Throws
  // RuntimeError naming the address when it cannot bind (e.g. the port is taken). Clients must
  // prove they hold `secret`.
  TcpStoreServer(const std::string& host, int port, std::string job_id, JobSecret secret);
  ~TcpStoreServer();
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;
  int port() const { return port_; }

 private:
  void serve();
  int listen_fd_ = -1;
  int wake_[2] = {-1, -1};
  int port_ = 0;
  std::string job_id_;
  JobSecret secret_;
  std::thread thread_;
};

class TcpStoreClient : public StoreClient {
 public:
  // Connects (retrying until `timeout` while nobody listens yet), proves it holds `secret` and
  // presents `job_id`. SecretRefused when the server holds another secret.
  TcpStoreClient(const std::string& host, int port, const std::string& job_id, JobSecret secret,
                 std::chrono::milliseconds timeout);
  ~TcpStoreClient() override;

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override;
  // Waits for the key (within the store's timeout) as c10d's TCPStore does.
  std::vector<uint8_t> get(const std::string& key) override;
  std::string get_present(const std::string& key) override;
  std::vector<std::string> get_many(const std::vector<std::string>& keys) override;
  int64_t delete_prefix(const std::string& prefix) override;
  std::vector<int64_t> stats() override;
  std::string where() const override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;
  // Another connection to the same server. Overrides c10d::Store::clone, pure from libtorch 2.7
  // or so on (absent in 1.13 and 2.6), hence without `override`.
  c10::intrusive_ptr<c10d::Store> clone();

 private:
  struct Reply;
  Reply call(uint8_t op, const std::vector<std::string>& fields, std::chrono::milliseconds timeout);

  std::mutex mutex_;
  int fd_ = -1;
  std::string pending_;  // received bytes not yet taken as a reply
  uint64_t next_id_ = 1;
  std::string host_;
  int port_ = 0;
  std::string job_id_;
  JobSecret secret_;
};

}  // namespace cohort::comm

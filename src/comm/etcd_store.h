// The rendezvous store kept in etcd (`--rdzv etcd://HOST:PORT`), through etcd's JSON gateway (its
// v3 API over HTTP, which Debian's etcd-server serves on its client port): a c10d store, so that
// Gloo rendezvous through it, and what cohort::comm::Store needs. No process of the job serves
// it, so the job outlives any of its nodes. Private to comm/.
//
// A job's keys live under "/cohort/<job id>/", every one attached to the job's lease: the first
// client grants it and records it there, every client keeps it alive, and when no process of the
// job is left it expires and etcd drops the job's keys. The first client also records a proof of
// the job secret (its HMAC of the job id); a client holding another secret is refused.
#pragma once
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cohort/comm/job_secret.h"
#include "comm/store_client.h"

namespace cohort::comm {

class EtcdStoreClient : public StoreClient {
 public:
  // Reaches etcd at host:port (retrying until `timeout`: a TimeoutError naming the endpoint),
  // joins or starts job `job_id`'s lease of `lease_ttl` and checks its secret (SecretRefused).
  EtcdStoreClient(const std::string& host, int port, const std::string& job_id, JobSecret secret,
                  std::chrono::milliseconds timeout, std::chrono::seconds lease_ttl);
  ~EtcdStoreClient() override;
  EtcdStoreClient(const EtcdStoreClient&) = delete;
  EtcdStoreClient& operator=(const EtcdStoreClient&) = delete;

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;
  std::string get_present(const std::string& key) override;
  std::vector<std::string> get_many(const std::vector<std::string>& keys) override;
  int64_t delete_prefix(const std::string& prefix) override;
  std::vector<int64_t> stats() override;
  std::string where() const override;
  // Another client of the same job (see TcpStoreClient::clone).
  c10::intrusive_ptr<c10d::Store> clone();

  struct Http;  // one keep-alive connection to the gateway (comm/etcd_store.cpp)

 private:
  // The values of `keys` (nullopt for one that is not set), in as few transactions as etcd allows.
  std::vector<std::optional<std::string>> range_many(const std::vector<std::string>& keys);
  // Joins the job's lease (or grants it, as its first client) and checks the job secret.
  void join_job();
  void keep_lease_alive();

  std::string host_;
  int port_ = 0;
  std::string job_id_;
  JobSecret secret_;
  std::chrono::seconds lease_ttl_;
  std::string prefix_;  // "/cohort/<job id>/"
  std::unique_ptr<Http> http_;
  std::string lease_;  // the job's lease id, as etcd writes it (a decimal)
  std::mutex stop_mutex_;
  std::condition_variable stop_;
  bool stopping_ = false;
  std::thread keeper_;  // keeps the job's lease alive
};

}  // namespace cohort::comm

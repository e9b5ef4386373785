// The c10d store behind cohort::comm::Store; private to comm/.
#pragma once
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "cohort/comm/store.h"
#include "comm/store_client.h"
#include "comm/tcp_store.h"

namespace cohort::comm {

struct Store::State {
  std::unique_ptr<TcpStoreServer> server;  // when this handle serves the store
  c10::intrusive_ptr<StoreClient> store;
  bool etcd = false;
  std::chrono::seconds etcd_lease_ttl{};
  std::string host;
  int port = 0;
  std::chrono::milliseconds timeout{};
  JobSecret secret;
  std::string job_id;
};

// The c10d store behind a Store handle, for the transports of comm/.
struct StoreAccess {
  static c10::intrusive_ptr<c10d::Store> native(const Store& store) { return store.state_->store; }
};

}  // namespace cohort::comm

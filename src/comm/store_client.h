// The c10d store behind cohort::comm::Store, whichever server holds the keys: cohort's own TCP
// store (comm/tcp_store.h) or etcd (comm/etcd_store.h). Gloo rendezvous through it as through any
// c10d store; Store's own calls use the few more that both provide. Private to comm/.
#pragma once
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace cohort::comm {

class StoreClient : public c10d::Store {
 public:
  using c10d::Store::Store;
  // One round trip, for a key known to be set; throws RuntimeError when it is not.
  virtual std::string get_present(const std::string& key) = 0;
  // The values of keys known to be set, in one round trip; throws RuntimeError naming one that
  // is not.
  virtual std::vector<std::string> get_many(const std::vector<std::string>& keys) = 0;
  // Deletes the keys that start with `prefix`; returns how many.
  virtual int64_t delete_prefix(const std::string& prefix) = 0;
  // Keys, bytes of keys and values, clients (-1 when the server does not tell).
  virtual std::vector<int64_t> stats() = 0;
  // The server, as messages name it: "store at 10.0.0.1:29500", "etcd at 10.0.0.9:2379".
  virtual std::string where() const = 0;
};

}  // namespace cohort::comm

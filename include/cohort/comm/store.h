#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cohort/comm/job_secret.h"
#include "cohort/timeouts.h"

namespace cohort::comm {

/// How Store::connect() starts or reaches the store.
struct StoreOptions {
  /// The server listens on this address only (never on every interface); clients connect to it.
  /// With `etcd`, etcd's host.
  std::string host = "127.0.0.1";
  /// 0 lets the server pick a free port (read it back with Store::port()). With `etcd`, etcd's
  /// client port.
  int port = 0;
  /// This process runs the server (and is its first client); ignored with `etcd`, which serves.
  bool is_server = false;
  /// Deadline for connecting and for every get/wait.
  std::chrono::milliseconds timeout = kDefaultStoreTimeout;
  /// Checked when a client joins: a client of another job is refused with an error naming both.
  std::string job_id;
  /// The job's secret: the server lets in only clients that prove they hold it; a client checks
  /// the server holds it too (a UsageError naming the store otherwise). Empty:
  /// an insecure job's store, which any client of the same version may join.
  JobSecret secret;
  /// Keep the keys in etcd at host:port (`--rdzv etcd://HOST:PORT`; Debian's etcd-server) rather
  /// than in cohort's own TCP store: no process of the job serves them, so the job outlives any of
  /// its nodes. The keys live under "/cohort/<job_id>/" with a lease that every client keeps
  /// alive; etcd drops them etcd_lease_ttl after the job's last process is gone.
  bool etcd = false;
  /// The job's lease in etcd: how long its keys outlive its last process.
  std::chrono::seconds etcd_lease_ttl = kDefaultEtcdLeaseTtl;
};

/// A key-value rendezvous store (cohort's own TCP store, bound to one address, or etcd; usable by
/// Gloo): set/get/add/wait, every blocking call bounded by the store's timeout. Copies share one
/// connection; the server lives as long as a copy of the handle that started it.
class Store {
 public:
  /// An empty handle; use connect().
  Store() = default;
  /// Starts the server (options.is_server) or connects to it; throws TimeoutError past
  /// options.timeout (UsageError with etcd: the named endpoint never answered), UsageError for a
  /// client of another job.
  static Store connect(const StoreOptions& options);

  /// A second client of the same server, with this handle's options and its own connection: for
  /// a thread that waits on the store while this handle's thread goes on using it (a blocking call
  /// holds its connection until it returns).
  Store connect_again() const;
  /// The server's port.
  int port() const;
  /// The server's address.
  const std::string& host() const;
  /// The server, as messages name it: "store at 10.0.0.1:29500" or "etcd at 10.0.0.9:2379".
  std::string where() const;
  /// Whether the keys live in etcd (StoreOptions::etcd).
  bool in_etcd() const;
  /// The deadline of connecting and of each blocking call.
  std::chrono::milliseconds timeout() const;
  /// The job secret this handle joined with: what the job's other servers (the coordinator,
  /// parameter servers, data plane) check as well.
  const JobSecret& secret() const;

  /// Sets `key` to `value` (replacing it).
  void set(const std::string& key, const std::string& value);
  /// The value of `key`, waiting for it to be set (up to the timeout).
  std::string get(const std::string& key);
  /// Adds `delta` to the integer at `key` (0 when unset); returns the new value.
  int64_t add(const std::string& key, int64_t delta);
  /// Whether every key is set (without waiting).
  bool check(const std::vector<std::string>& keys);
  /// The values of keys that are set, in one round trip; throws RuntimeError naming a key that is
  /// not.
  std::vector<std::string> get_many(const std::vector<std::string>& keys);
  /// Deletes every key that starts with `prefix` (a step that is done); returns how many.
  int64_t remove_prefix(const std::string& prefix);
  /// What the server holds: keys, bytes of keys and values, connected clients.
  struct Stats {
    int64_t keys = 0;     ///< keys held
    int64_t bytes = 0;    ///< bytes of keys and values
    int64_t clients = 0;  ///< clients connected
  };
  /// The server's counts (see Stats).
  Stats stats();
  /// Waits until every key exists; throws TimeoutError naming the missing keys.
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);
  /// A named barrier of `world` ranks: sets `"<prefix><rank>"` to `value`, waits for every rank's
  /// key and returns the values by rank (one round trip for them all). At the deadline, throws
  /// TimeoutError `"<members> [1, 2] of 3 did not <what> within N ms"` (members: "ranks", "nodes",
  /// ...). The barrier records its participants (`"<prefix>@participants"`): the same name entered
  /// with another world is a UsageError naming both. Its keys stay until remove_prefix(prefix).
  std::vector<std::string> arrive_and_wait(const std::string& prefix, int rank, int world,
                                           const std::string& value, const std::string& what,
                                           std::chrono::milliseconds timeout,
                                           const std::string& members = "ranks");

  struct State;  ///< defined in src/comm/store_state.h

 private:
  friend struct StoreAccess;  ///< comm/'s own access to the c10d store (src/comm/store_state.h)
  explicit Store(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;
};

}  // namespace cohort::comm

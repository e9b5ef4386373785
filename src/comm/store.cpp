#include "cohort/comm/store.h"

#include "cohort/error.h"
#include "comm/etcd_store.h"
#include "comm/store_state.h"

namespace cohort::comm {

Store::Store(std::shared_ptr<State> state) : state_(std::move(state)) {}

Store Store::connect(const StoreOptions& options) {
  if (options.port < 0 || options.port > 65535) {
    throw UsageError("store port " + std::to_string(options.port) +
                     " is out of range: use 0 (pick a free port) or 1-65535");
  }
  auto state = std::make_shared<State>();
  state->host = options.host;
  state->timeout = options.timeout;
  state->port = options.port;
  state->secret = options.secret;
  state->job_id = options.job_id;
  state->etcd = options.etcd;
  state->etcd_lease_ttl = options.etcd_lease_ttl;
  if (options.etcd) {
    if (options.port == 0) throw UsageError("etcd at " + options.host + " needs its client port");
    if (options.etcd_lease_ttl.count() < 3) {
      throw UsageError("etcd lease of " + std::to_string(options.etcd_lease_ttl.count()) +
                       " s is too short to renew: give at least 3 s");
    }
    state->store = c10::make_intrusive<EtcdStoreClient>(options.host, options.port, options.job_id,
                                                        options.secret, options.timeout,
                                                        options.etcd_lease_ttl);
    return Store(std::move(state));
  }
  if (options.is_server) {
    state->server = std::make_unique<TcpStoreServer>(options.host, options.port, options.job_id,
                                                     options.secret);
    state->port = state->server->port();
  } else if (options.port == 0) {
    throw UsageError("a store client needs the server's port: got port 0 for " + options.host);
  }
  state->store = c10::make_intrusive<TcpStoreClient>(options.host, state->port, options.job_id,
                                                     options.secret, options.timeout);
  return Store(std::move(state));
}

Store Store::connect_again() const {
  if (!state_) throw RuntimeError("Store::connect_again() on an empty handle: connect() first");
  return connect({.host = state_->host,
                  .port = state_->port,
                  .timeout = state_->timeout,
                  .job_id = state_->job_id,
                  .secret = state_->secret,
                  .etcd = state_->etcd,
                  .etcd_lease_ttl = state_->etcd_lease_ttl});
}

int Store::port() const { return state_->port; }
const std::string& Store::host() const { return state_->host; }
std::chrono::milliseconds Store::timeout() const { return state_->timeout; }
const JobSecret& Store::secret() const { return state_->secret; }
std::string Store::where() const { return state_->store->where(); }
bool Store::in_etcd() const { return state_->etcd; }

void Store::set(const std::string& key, const std::string& value) {
  state_->store->set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

std::string Store::get(const std::string& key) {
  wait({key}, state_->timeout);  // names the key at the deadline
  return state_->store->get_present(key);
}

int64_t Store::add(const std::string& key, int64_t delta) { return state_->store->add(key, delta); }

bool Store::check(const std::vector<std::string>& keys) { return state_->store->check(keys); }

std::vector<std::string> Store::get_many(const std::vector<std::string>& keys) {
  return state_->store->get_many(keys);
}

int64_t Store::remove_prefix(const std::string& prefix) {
  return state_->store->delete_prefix(prefix);
}

Store::Stats Store::stats() {
  const auto values = state_->store->stats();
  return {.keys = values.at(0), .bytes = values.at(1), .clients = values.at(2)};
}

void Store::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  try {
    state_->store->wait(keys, timeout);
  } catch (const std::exception& e) {
    std::string missing;
    for (const auto& key : keys) {
      if (!state_->store->check({key})) missing += (missing.empty() ? "" : ", ") + key;
    }
    throw TimeoutError(where() + ": keys [" + missing + "] did not appear within " +
                       std::to_string(timeout.count()) + " ms");
  }
}

std::vector<std::string> Store::arrive_and_wait(const std::string& prefix, int rank, int world,
                                                const std::string& value, const std::string& what,
                                                std::chrono::milliseconds timeout,
                                                const std::string& members) {
  // One name, one set of participants: a second barrier of another size under the same name
  // would pass on the first one's keys.
  const std::string participants = std::to_string(world) + " " + members;
  const std::vector<uint8_t> held =
      state_->store->compareSet(prefix + "@participants", std::vector<uint8_t>{},
                                std::vector<uint8_t>(participants.begin(), participants.end()));
  if (std::string(held.begin(), held.end()) != participants) {
    throw UsageError("barrier '" + prefix + "' was entered by rank " + std::to_string(rank) +
                     " as a barrier of " + participants + " but it is a barrier of " +
                     std::string(held.begin(), held.end()) +
                     ": give each barrier its own name (e.g. add the step)");
  }
  set(prefix + std::to_string(rank), value);
  std::vector<std::string> keys;
  for (int r = 0; r < world; ++r) keys.push_back(prefix + std::to_string(r));
  try {
    state_->store->wait(keys, timeout);
  } catch (const std::exception&) {
    std::string missing;
    for (int r = 0; r < world; ++r) {
      if (!check({keys[static_cast<size_t>(r)]}))
        missing += (missing.empty() ? "" : ", ") + std::to_string(r);
    }
    throw TimeoutError(members + " [" + missing + "] of " + std::to_string(world) + " did not " +
                       what + " within " + std::to_string(timeout.count()) + " ms");
  }
  return get_many(keys);
}

}  // namespace cohort::comm

#include "comm/etcd_store.h"

#include <httplib.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <optional>

#include "cohort/error.h"
#include "cohort/json.h"
#include "comm/handshake.h"

namespace cohort::comm {
namespace {

using Clock = std::chrono::steady_clock;

// etcd's gateway allows this many operations in one transaction (its --max-txn-ops default).
constexpr size_t kMaxTxnOps = 128;

constexpr char kBase64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

std::string base64(const std::string& bytes) {
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  for (size_t i = 0; i < bytes.size(); i += 3) {
    const size_t n = std::min<size_t>(3, bytes.size() - i);
    uint32_t v = 0;
    for (size_t j = 0; j < 3; ++j)
      v = (v << 8) | (j < n ? static_cast<unsigned char>(bytes[i + j]) : 0u);
    for (size_t j = 0; j < 4; ++j) out += j <= n ? kBase64[(v >> (18 - 6 * j)) & 63] : '=';
  }
  return out;
}

std::string unbase64(const std::string& text) {
  std::array<int, 256> value{};
  value.fill(-1);
  for (int i = 0; i < 64; ++i) value[static_cast<unsigned char>(kBase64[i])] = i;
  std::string out;
  uint32_t bits = 0;
  int held = 0;
  for (const char c : text) {
    const int v = value[static_cast<unsigned char>(c)];
    if (v < 0) continue;  // '=' and line breaks
    bits = (bits << 6) | static_cast<uint32_t>(v);
    held += 6;
    if (held >= 8) {
      held -= 8;
      out += static_cast<char>((bits >> held) & 0xff);
    }
  }
  return out;
}

// The first key after every key that starts with `prefix` (etcd's range_end of a prefix).
std::string prefix_end(std::string prefix) {
  while (!prefix.empty() && static_cast<unsigned char>(prefix.back()) == 0xff) prefix.pop_back();
  if (prefix.empty()) return std::string(1, '\0');  // every key
  prefix.back() = static_cast<char>(static_cast<unsigned char>(prefix.back()) + 1);
  return prefix;
}

// etcd writes 64-bit integers as JSON strings, and leaves out fields that are 0.
int64_t int_field(const Json& object, const char* name) {
  if (!object.is_object() || !object.contains(name)) return 0;
  const Json& v = object[name];
  return v.is_string() ? std::stoll(v.get<std::string>()) : v.get<int64_t>();
}

Json range_request(const std::string& key) { return {{"request_range", {{"key", base64(key)}}}}; }

std::string as_text(const std::vector<uint8_t>& bytes) { return {bytes.begin(), bytes.end()}; }
std::vector<uint8_t> as_bytes(const std::string& text) { return {text.begin(), text.end()}; }

// The first value of a range response; nullopt when the key is not set.
std::optional<std::string> first_value(const Json& range) {
  if (!range.contains("kvs") || range["kvs"].empty()) return std::nullopt;
  const Json& kv = range["kvs"][0];
  return kv.contains("value") ? unbase64(kv["value"].get<std::string>()) : std::string();
}

std::string hex(const std::array<uint8_t, 32>& bytes) {
  std::string out;
  char digits[3];
  for (const uint8_t b : bytes) {
    std::snprintf(digits, sizeof digits, "%02x", b);
    out += digits;
  }
  return out;
}

}  // namespace

// etcd's answer that the lease a request names is gone: it expired (no client renewed it within
// its TTL) or was revoked, and etcd dropped the keys attached to it.
class LeaseNotFound : public PeerFailureError {
 public:
  using PeerFailureError::PeerFailureError;
};

struct EtcdStoreClient::Http {
  Http(const std::string& host, int port, std::chrono::milliseconds timeout)
      : client(host, port),
        where("etcd at " + host + ":" + std::to_string(port)),
        timeout(timeout) {
    client.set_keep_alive(true);
    client.set_connection_timeout(std::chrono::seconds(2));
    client.set_read_timeout(std::max<std::chrono::milliseconds>(timeout, std::chrono::seconds(5)));
    client.set_write_timeout(std::chrono::seconds(10));
  }

  // What one request got back: the status (0 when none came) and the body as far as it came.
  struct Reply {
    int status = 0;
    std::string body;
    httplib::Error error = httplib::Error::Success;
  };

  // The status and body are taken as they arrive, not from httplib's finished response: etcd's
  // gateway ends an error's chunked body with a gRPC trailer, which Debian 12's cpp-httplib
  // (0.11) cannot read and calls a failed read, although the whole reply has come.
  Reply send(const std::string& path, const std::string& text) {
    Reply reply;
    httplib::Request request;
    request.method = "POST";
    request.path = path;
    request.body = text;
    request.set_header("Content-Type", "application/json");
    request.response_handler = [&](const httplib::Response& r) {
      reply.status = r.status;
      return true;
    };
    request.content_receiver = [&](const char* data, size_t size, uint64_t, uint64_t) {
      reply.body.append(data, size);
      return true;
    };
    httplib::Response response;
    client.send(request, response, reply.error);
    return reply;
  }

  // POSTs `body` to the gateway's `path` and returns its reply. A connection that fails, or an
  // etcd that is unavailable for now (a leader election), is tried again until the timeout: then
  // PeerFailureError naming etcd. LeaseNotFound when the lease the request names is gone;
  // RuntimeError when etcd refuses the request otherwise.
  Json post(const std::string& path, const Json& body) {
    const std::string text = body.dump();
    const auto deadline = Clock::now() + timeout;
    std::lock_guard lock(mutex);
    std::string last;
    while (true) {
      const Reply reply = send(path, text);
      // A JSON object is a whole reply (a cut one does not parse), whatever httplib said after it.
      const Json json = Json::parse(reply.body, nullptr, /*allow_exceptions=*/false);
      const bool whole = !json.is_discarded() && json.is_object();
      const bool answered = reply.status != 0 && reply.status != 503 &&
                            (whole || reply.error == httplib::Error::Success);
      if (answered && reply.status == 200) {
        if (whole) return json;
        throw RuntimeError(where + ": " + path + " answered no JSON: " + reply.body.substr(0, 200));
      }
      if (answered) {
        const std::string message =
            whole ? json.value("message", reply.body) : reply.body.substr(0, 300);
        if (message.find("requested lease not found") != std::string::npos) {
          throw LeaseNotFound(where + " no longer holds the job's lease (" + path + ": " + message +
                              "): no process of the job renewed it within its time to live, so "
                              "etcd dropped the job's keys; start the job again");
        }
        throw RuntimeError(where + " refused " + path + " (HTTP " + std::to_string(reply.status) +
                           "): " + message);
      }
      last = reply.status == 503 ? "HTTP 503: " + reply.body.substr(0, 200)
                                 : httplib::to_string(reply.error);
      if (Clock::now() >= deadline) {
        throw PeerFailureError("lost the rendezvous " + where + " (" + last + ", for " +
                               std::to_string(timeout.count()) + " ms)");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }

  // A transaction of `ops` (no comparison) in one round trip: its responses.
  Json transact(const Json& ops) {
    const Json reply = post("/v3/kv/txn", {{"success", ops}});
    return reply.contains("responses") ? reply["responses"] : Json::array();
  }

  std::mutex mutex;
  httplib::Client client;
  std::string where;
  std::chrono::milliseconds timeout;
};

namespace {

// Renews `lease` for its whole time to live and returns that (0 when etcd no longer holds it).
int64_t renew_lease(EtcdStoreClient::Http& http, const std::string& lease) {
  const Json reply = http.post("/v3/lease/keepalive", {{"ID", lease}});
  return int_field(reply.contains("result") ? reply["result"] : reply, "TTL");
}

}  // namespace

EtcdStoreClient::EtcdStoreClient(const std::string& host, int port, const std::string& job_id,
                                 JobSecret secret, std::chrono::milliseconds timeout,
                                 std::chrono::seconds lease_ttl)
    : StoreClient(timeout),
      host_(host),
      port_(port),
      job_id_(job_id),
      secret_(std::move(secret)),
      lease_ttl_(lease_ttl),
      prefix_("/cohort/" + (job_id.empty() ? std::string("default") : job_id) + "/"),
      http_(std::make_unique<Http>(host, port, timeout)) {
  // The job's lease can run out between reading its record and using it (the job's last process
  // went just before). The record goes with the lease, or is removed here where it is left, and a
  // second try starts the job's lease afresh.
  const auto deadline = Clock::now() + timeout;
  while (true) {
    try {
      join_job();
      break;
    } catch (const LeaseNotFound&) {
      if (Clock::now() >= deadline) throw;
      const std::string lease_key = base64(prefix_ + "@lease");
      http_->post(
          "/v3/kv/txn",
          {{"compare", {{{"key", lease_key}, {"target", "VALUE"}, {"value", base64(lease_)}}}},
           {"success", {{{"request_delete_range", {{"key", lease_key}}}}}}});
    }
  }
  keeper_ = std::thread([this] { keep_lease_alive(); });
}

void EtcdStoreClient::join_job() {
  const std::string lease_key = prefix_ + "@lease";
  try {
    // The job's lease: the one recorded, or ours when none is (the first client).
    const Json held = http_->post("/v3/kv/range", {{"key", base64(lease_key)}});
    if (const auto value = first_value(held)) {
      lease_ = *value;
      // Renewed at once: a lease that ran out since it was recorded is found here, and one about
      // to run out has its whole time to live again for this client's first writes.
      if (renew_lease(*http_, lease_) <= 0)
        throw LeaseNotFound(where() + " no longer holds lease " + lease_ + " of job '" + job_id_ +
                            "'");
    } else {
      const Json granted = http_->post("/v3/lease/grant", {{"TTL", lease_ttl_.count()}});
      const std::string ours = std::to_string(int_field(granted, "ID"));
      const Json txn = http_->post(
          "/v3/kv/txn",
          {{"compare",
            {{{"key", base64(lease_key)}, {"target", "CREATE"}, {"create_revision", "0"}}}},
           {"success",
            {{{"request_put",
               {{"key", base64(lease_key)}, {"value", base64(ours)}, {"lease", ours}}}}}},
           {"failure", {range_request(lease_key)}}});
      if (txn.value("succeeded", false)) {
        lease_ = ours;
      } else {  // another client of the job was first
        http_->post("/v3/lease/revoke", {{"ID", ours}});
        lease_ = first_value(txn["responses"][0]["response_range"]).value_or(ours);
      }
    }
  } catch (const LeaseNotFound&) {
    throw;
  } catch (const PeerFailureError& e) {
    // The endpoint this process was given never answered: a wrong --rdzv, or an etcd not started
    // (bad input, exit code 2 in the CLI), not a peer lost mid-job.
    throw UsageError("cannot reach the rendezvous " + where() + " within " +
                     std::to_string(timeout_.count()) + " ms (" + e.what() +
                     "): start etcd there (Debian's etcd-server: etcd --listen-client-urls "
                     "http://HOST:PORT --advertise-client-urls http://HOST:PORT) or fix --rdzv");
  }
  // The job secret's proof: the first client's, which every other must match.
  const std::string proof = secret_.empty()
                                ? std::string("insecure")
                                : hex(secret_.mac("cohort etcd rendezvous of job " + job_id_));
  const std::vector<uint8_t> held = compareSet("@secret", std::vector<uint8_t>{}, as_bytes(proof));
  if (as_text(held) != proof) {
    throw SecretRefused(where() + " holds job '" + job_id_ + "' " +
                        (as_text(held) == "insecure" ? "without a job secret (--insecure)"
                                                     : "with another job secret") +
                        ": give every process of the job the same " +
                        (secret_.empty() ? "setting" : std::string("COHORT_JOB_SECRET")) +
                        ", or give this job another id (cohort launch --job-id, or COHORT_JOB_ID)");
  }
}

EtcdStoreClient::~EtcdStoreClient() {
  {
    std::lock_guard lock(stop_mutex_);
    stopping_ = true;
  }
  stop_.notify_all();
  if (keeper_.joinable()) keeper_.join();
}

void EtcdStoreClient::keep_lease_alive() {
  Http http(host_, port_, std::chrono::milliseconds(lease_ttl_) / 3);
  std::unique_lock lock(stop_mutex_);
  while (!stop_.wait_for(lock, lease_ttl_ / 3, [this] { return stopping_; })) {
    lock.unlock();
    try {
      renew_lease(http, lease_);
    } catch (const std::exception&) {
      // etcd is away for now: the job's own calls say so; the next beat tries again.
    }
    lock.lock();
  }
}

std::string EtcdStoreClient::where() const {
  return "etcd at " + host_ + ":" + std::to_string(port_);
}

void EtcdStoreClient::set(const std::string& key, const std::vector<uint8_t>& value) {
  http_->post(
      "/v3/kv/put",
      {{"key", base64(prefix_ + key)}, {"value", base64(as_text(value))}, {"lease", lease_}});
}

std::vector<uint8_t> EtcdStoreClient::compareSet(const std::string& key,
                                                 const std::vector<uint8_t>& expected,
                                                 const std::vector<uint8_t>& desired) {
  // As c10d's TCPStore: set `desired` when the key holds `expected` (or is unset and `expected`
  // is empty) and return it; otherwise return what the key holds (`expected` when unset).
  const std::string full = base64(prefix_ + key);
  const Json compare =
      expected.empty()
          ? Json{{"key", full}, {"target", "CREATE"}, {"create_revision", "0"}}
          : Json{{"key", full}, {"target", "VALUE"}, {"value", base64(as_text(expected))}};
  const Json txn =
      http_->post("/v3/kv/txn",
                  {{"compare", {compare}},
                   {"success",
                    {{{"request_put",
                       {{"key", full}, {"value", base64(as_text(desired))}, {"lease", lease_}}}}}},
                   {"failure", {range_request(prefix_ + key)}}});
  if (txn.value("succeeded", false)) return desired;
  const auto held = first_value(txn["responses"][0]["response_range"]);
  return held ? as_bytes(*held) : expected;
}

std::vector<uint8_t> EtcdStoreClient::get(const std::string& key) {
  wait({key}, timeout_);
  return as_bytes(get_present(key));
}

std::string EtcdStoreClient::get_present(const std::string& key) {
  const auto value = first_value(http_->post("/v3/kv/range", {{"key", base64(prefix_ + key)}}));
  if (!value) throw RuntimeError(where() + ": key '" + key + "' is not set");
  return *value;
}

std::vector<std::optional<std::string>> EtcdStoreClient::range_many(
    const std::vector<std::string>& keys) {
  std::vector<std::optional<std::string>> values;
  for (size_t first = 0; first < keys.size(); first += kMaxTxnOps) {
    Json ops = Json::array();
    for (size_t i = first; i < std::min(keys.size(), first + kMaxTxnOps); ++i)
      ops.push_back(range_request(prefix_ + keys[i]));
    for (const Json& response : http_->transact(ops))
      values.push_back(first_value(response["response_range"]));
  }
  if (values.size() != keys.size())
    throw RuntimeError(where() + ": a transaction of reads answered " +
                       std::to_string(values.size()) + " of " + std::to_string(keys.size()));
  return values;
}

std::vector<std::string> EtcdStoreClient::get_many(const std::vector<std::string>& keys) {
  const auto values = range_many(keys);
  std::vector<std::string> out;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (!values[i]) throw RuntimeError(where() + ": key '" + keys[i] + "' is not set");
    out.push_back(*values[i]);
  }
  return out;
}

int64_t EtcdStoreClient::add(const std::string& key, int64_t value) {
  // Read, then write the sum only if nobody wrote in between (the key's revision); else again.
  const std::string full = base64(prefix_ + key);
  while (true) {
    const Json held = http_->post("/v3/kv/range", {{"key", full}});
    const bool set = held.contains("kvs") && !held["kvs"].empty();
    int64_t now = 0;
    if (set) {
      const std::string text = first_value(held).value_or("0");
      try {
        now = text.empty() ? 0 : std::stoll(text);
      } catch (const std::exception&) {
        throw RuntimeError(where() + ": add to key '" + key + "', which holds '" + text +
                           "', not a number");
      }
    }
    const int64_t sum = now + value;
    const Json compare =
        set ? Json{{"key", full},
                   {"target", "MOD"},
                   {"mod_revision", std::to_string(int_field(held["kvs"][0], "mod_revision"))}}
            : Json{{"key", full}, {"target", "CREATE"}, {"create_revision", "0"}};
    const Json txn = http_->post(
        "/v3/kv/txn",
        {{"compare", {compare}},
         {"success",
          {{{"request_put",
             {{"key", full}, {"value", base64(std::to_string(sum))}, {"lease", lease_}}}}}}});
    if (txn.value("succeeded", false)) return sum;
  }
}

bool EtcdStoreClient::deleteKey(const std::string& key) {
  return int_field(http_->post("/v3/kv/deleterange", {{"key", base64(prefix_ + key)}}), "deleted") >
         0;
}

bool EtcdStoreClient::check(const std::vector<std::string>& keys) {
  const auto values = range_many(keys);
  return std::all_of(values.begin(), values.end(), [](const auto& v) { return v.has_value(); });
}

int64_t EtcdStoreClient::getNumKeys() {
  return int_field(http_->post("/v3/kv/range", {{"key", base64(prefix_)},
                                                {"range_end", base64(prefix_end(prefix_))},
                                                {"count_only", true}}),
                   "count");
}

void EtcdStoreClient::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void EtcdStoreClient::wait(const std::vector<std::string>& keys,
                           const std::chrono::milliseconds& timeout) {
  // Polled, from every millisecond up to every 50: a rendezvous takes a few rounds.
  const auto deadline = Clock::now() + timeout;
  auto pause = std::chrono::milliseconds(1);
  while (!check(keys)) {
    if (Clock::now() >= deadline) {
      throw TimeoutError(where() + ": keys did not appear within " +
                         std::to_string(timeout.count()) + " ms");
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(50));
  }
}

int64_t EtcdStoreClient::delete_prefix(const std::string& prefix) {
  return int_field(
      http_->post("/v3/kv/deleterange", {{"key", base64(prefix_ + prefix)},
                                         {"range_end", base64(prefix_end(prefix_ + prefix))}}),
      "deleted");
}

std::vector<int64_t> EtcdStoreClient::stats() {
  const Json all = http_->post(
      "/v3/kv/range", {{"key", base64(prefix_)}, {"range_end", base64(prefix_end(prefix_))}});
  int64_t keys = 0, bytes = 0;
  if (all.contains("kvs")) {
    for (const Json& kv : all["kvs"]) {
      ++keys;
      bytes += static_cast<int64_t>(unbase64(kv["key"].get<std::string>()).size() - prefix_.size());
      if (kv.contains("value"))
        bytes += static_cast<int64_t>(unbase64(kv["value"].get<std::string>()).size());
    }
  }
  return {keys, bytes, -1};  // etcd does not say which clients are the job's
}

c10::intrusive_ptr<c10d::Store> EtcdStoreClient::clone() {
  return c10::make_intrusive<EtcdStoreClient>(host_, port_, job_id_, secret_, timeout_, lease_ttl_);
}

}  // namespace cohort::comm

#include "cohort/runtime/node_launcher.h"

#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <optional>
#include <thread>

#include "cohort/comm/address.h"
#include "cohort/comm/store.h"
#include "cohort/error.h"
#include "cohort/json.h"
#include "cohort/runtime/coordinator.h"
#include "cohort/runtime/environment.h"
#include "cohort/runtime/worker_group.h"
#include "cohort/runtime/worker_info.h"

namespace cohort::runtime {
namespace {

using Clock = std::chrono::steady_clock;

// The program as posix_spawn needs it: a path, looked up in PATH when it has no '/'.
std::string resolve_program(const std::string& program) {
  if (program.find('/') != std::string::npos) {
    if (::access(program.c_str(), X_OK) != 0)
      throw UsageError("cohort launch: '" + program + "' is not an executable file");
    return program;
  }
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "/usr/bin:/bin";
  size_t start = 0;
  while (start <= dirs.size()) {
    const size_t end = std::min(dirs.find(':', start), dirs.size());
    const auto candidate = std::filesystem::path(dirs.substr(start, end - start)) / program;
    if (::access(candidate.c_str(), X_OK) == 0) return candidate.string();
    start = end + 1;
  }
  throw UsageError("cohort launch: program '" + program + "' is not in PATH");
}

std::string default_job_id(const NodeLaunchOptions& o) {
  std::string text = std::to_string(o.nnodes) + " nodes";
  for (const auto& arg : o.command) text += '\0' + arg;
  char id[32];
  std::snprintf(id, sizeof id, "launch-%08lx",
                crc32(crc32(0, nullptr, 0), reinterpret_cast<const Bytef*>(text.data()),
                      static_cast<uInt>(text.size())));
  return id;
}

class NodeLauncher {
 public:
  explicit NodeLauncher(NodeLaunchOptions o) : o_(std::move(o)) {}
  int run();

 private:
  void say(const std::string& line) const {
    if (o_.verbose >= 1)
      std::cerr << "cohort launch (node " << node_ << "/" << nodes_ << "): " << line << std::endl;
  }
  std::string key(const std::string& what) const {
    return "launch/" + std::to_string(round_) + "/" + what;
  }
  // What check_peers saw: a reason to stop the round ("" when none), and whether it is a node
  // that went away (rather than one that reported a failure).
  struct PeerState {
    std::string reason;
    bool node_lost = false;
  };
  // Heart-beats and looks at the others.
  PeerState check_peers();
  // After a local failure: a node whose launcher went silent, or another node whose worker failed
  // first, is the likelier cause; names it ("" when there is none).
  std::string find_root_cause();
  // Waits until every node set key(what)/<node>, while watching the others; "" or a reason.
  std::string wait_for_nodes(const std::string& what);
  void mark_failed(const std::string& reason);

  // Every node's share of the round, from what each said when it joined.
  void lay_out(const std::vector<std::string>& joined);
  // With etcd: joins the round, which needs as many nodes as the last round had less those it
  // lost; returns what every node said, in the order of their --node-rank (node_ set to this
  // node's place). Empty, with the reason in `error`, when the round cannot be.
  std::vector<std::string> join_elastic_round(const std::string& share, std::string& error);
  // Records that `node` of this round is lost (counted once however many nodes see it).
  void mark_lost(int node);
  bool rendezvous_in_etcd() const { return !o_.etcd.empty(); }
  // Local worker `local` is a rank of the job, or (after the ranks) one of its data workers, or
  // on node 0 (after them) the job host; its index among the ranks or the data workers.
  bool is_rank(int local) const { return local < o_.nproc_per_node; }
  int host_local() const { return o_.nproc_per_node + o_.data_workers; }
  bool is_host(int local) const { return node_ == 0 && local == host_local(); }
  int index_in_job(int local) const {
    return is_rank(local) ? first_rank_ + local : first_member_ + local - o_.nproc_per_node;
  }

  NodeLaunchOptions o_;
  std::optional<comm::Store> store_;
  // This node's index in the round and the round's nodes: --node-rank and --nnodes, except with
  // etcd, where each round numbers the nodes that join it.
  int node_ = 0;
  int nodes_ = 1;
  std::vector<std::string> hosts_;
  int world_ = 0;         // ranks of the job
  int first_rank_ = 0;    // this node's first
  int members_ = 0;       // data workers of the job
  int first_member_ = 0;  // this node's first
  int round_ = 0;
  // The nodes' launchers beat by counting up a store key each; the coordinator's monitor tells
  // a lost one. Made afresh every round.
  std::optional<HeartbeatMonitor> monitor_;
  std::vector<int64_t> beats_;  // each node's count when last seen changing
  Clock::time_point last_beat_{};
};

NodeLauncher::PeerState NodeLauncher::check_peers() {
  const auto now = Clock::now();
  if (now - last_beat_ < std::chrono::milliseconds(200)) return {};
  last_beat_ = now;
  try {
    store_->add(key("heartbeat/") + std::to_string(node_), 1);
    if (store_->check({key("failed")})) return {.reason = store_->get(key("failed"))};
    if (!monitor_) {
      monitor_.emplace(nodes_, HeartbeatOptions{.interval = std::chrono::milliseconds(200),
                                                .timeout = o_.heartbeat_timeout});
      beats_.assign(static_cast<size_t>(nodes_), -1);
      monitor_->finished(node_);  // this node is not watched by itself
    }
    for (int node = 0; node < nodes_; ++node) {
      if (node == node_) continue;
      const int64_t beats = store_->add(key("heartbeat/") + std::to_string(node), 0);
      if (beats != beats_[static_cast<size_t>(node)]) {
        beats_[static_cast<size_t>(node)] = beats;
        monitor_->heard(node);
      }
    }
    if (const auto silent = monitor_->find_silent()) {
      const auto node = static_cast<size_t>(silent->member);
      if (rendezvous_in_etcd()) mark_lost(silent->member);
      return {.reason = silent->describe("node " + std::to_string(node) + " (" + hosts_.at(node) +
                                         ")'s launcher") +
                        ": node " + std::to_string(node) + " is lost",
              .node_lost = true};
    }
  } catch (const PeerFailureError& e) {
    if (rendezvous_in_etcd()) return {.reason = e.what()};  // etcd is gone
    return {.reason = "lost node 0 (" + o_.master_addr + ":" + std::to_string(o_.master_port) +
                      "), which holds the rendezvous: its launcher or host is gone",
            .node_lost = true};
  }
  return {};
}

void NodeLauncher::mark_lost(int node) {
  if (store_->add(key("lost/") + std::to_string(node), 1) == 1) store_->add(key("lost"), 1);
}

std::vector<std::string> NodeLauncher::join_elastic_round(const std::string& share,
                                                          std::string& error) {
  // Round 0 has --nnodes; a later one the nodes of the last less those it lost.
  int expected = o_.nnodes;
  if (round_ > 0) {
    const std::string last = "launch/" + std::to_string(round_ - 1) + "/";
    expected = static_cast<int>(store_->add(last + "nodes", 0) - store_->add(last + "lost", 0));
  }
  const int fewest = o_.min_nodes > 0 ? o_.min_nodes : o_.nnodes;
  if (expected < fewest) {
    error = std::to_string(expected) + " node(s) are left, fewer than --min-nodes " +
            std::to_string(fewest) + ": the job cannot go on (lower --min-nodes to run smaller)";
    return {};
  }
  node_ = static_cast<int>(store_->add(key("joined"), 1)) - 1;
  if (node_ >= expected) {
    error = "round " + std::to_string(round_) + " already has its " + std::to_string(expected) +
            " node(s): this node joined too late (start it for a new job, or with --job-id)";
    return {};
  }
  nodes_ = expected;
  store_->set(key("nodes"), std::to_string(expected));  // every node alike: any may be lost next
  const int slot = node_;
  auto joined =
      store_->arrive_and_wait(key("join/"), slot, expected, share,
                              "join round " + std::to_string(round_) + " of job " + o_.job_id,
                              o_.rendezvous_timeout, "nodes");
  // The nodes in the order of their --node-rank, whatever their order of arrival: the first round
  // is laid out as given, a later one keeps the survivors' order.
  std::vector<std::pair<int, std::string>> by_label;
  for (const auto& text : joined)
    by_label.emplace_back(Json::parse(text)["node_rank"].get<int>(), text);
  std::stable_sort(by_label.begin(), by_label.end(),
                   [](const auto& x, const auto& y) { return x.first < y.first; });
  joined.clear();
  for (size_t i = 0; i < by_label.size(); ++i) {
    if (i > 0 && by_label[i].first == by_label[i - 1].first) {
      error = "two nodes joined round " + std::to_string(round_) + " as --node-rank " +
              std::to_string(by_label[i].first) + ": give each node its own";
      return {};
    }
    if (by_label[i].first == o_.node_rank) node_ = static_cast<int>(i);
    joined.push_back(by_label[i].second);
  }
  return joined;
}

std::string NodeLauncher::find_root_cause() {
  const auto until = Clock::now() + o_.heartbeat_timeout + std::chrono::seconds(1);
  while (Clock::now() < until) {
    // A lost node, or another node's failure it marked in the store.
    if (auto peers = check_peers(); !peers.reason.empty()) return peers.reason;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return "";
}

std::string NodeLauncher::wait_for_nodes(const std::string& what) {
  std::vector<std::string> keys;
  for (int node = 0; node < nodes_; ++node) keys.push_back(key(what) + "/" + std::to_string(node));
  store_->set(keys[static_cast<size_t>(node_)], "1");
  while (true) {
    try {
      if (store_->check(keys)) return "";
    } catch (const PeerFailureError&) {
    }
    if (auto peers = check_peers(); !peers.reason.empty()) return peers.reason;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

void NodeLauncher::mark_failed(const std::string& reason) {
  try {
    if (!store_->check({key("failed")})) store_->set(key("failed"), reason);
  } catch (const std::exception&) {
    // The store is gone with node 0: the others learn it themselves.
  }
}

void NodeLauncher::lay_out(const std::vector<std::string>& joined) {
  hosts_.clear();
  world_ = members_ = 0;
  for (int node = 0; node < nodes_; ++node) {
    const Json share = Json::parse(joined.at(static_cast<size_t>(node)));
    if (node == node_) {
      first_rank_ = world_;
      first_member_ = members_;
    }
    hosts_.push_back(share["host"]);
    world_ += share["nproc"].get<int>();
    members_ += share["data_workers"].get<int>();
  }
  if (world_ == 0)
    throw UsageError("no node of the job runs a train worker (every one has --nproc-per-node 0)");
}

namespace {

// The job's secret: none with --insecure; else the environment's; else, for a single node, a fresh
// one (its processes get it from this launcher). Nodes of a multi-node job cannot agree on a fresh
// one: they must be given the same.
comm::JobSecret job_secret(const NodeLaunchOptions& o) {
  auto given = job_secret_from_env();
  if (o.insecure) {
    if (given && !given->empty()) {
      throw UsageError(std::string("--insecure with ") + kJobSecretVar + " or " +
                       kJobSecretFileVar + " set: run with the secret, or unset it");
    }
    return comm::JobSecret();
  }
  if (given) return *given;
  if (o.nnodes == 1) return comm::JobSecret::generate();
  throw UsageError(std::string("a job of ") + std::to_string(o.nnodes) +
                   " nodes needs one secret on every node: set " + kJobSecretVar + " (or " +
                   kJobSecretFileVar + ", a file of mode 0600) to the same secret of at least " +
                   std::to_string(comm::JobSecret::kMinBytes) +
                   " bytes for every node's cohort launch, or give --insecure");
}

}  // namespace

int NodeLauncher::run() {
  const std::string program = resolve_program(o_.command.front());
  if (o_.job_id.empty()) o_.job_id = default_job_id(o_);
  // Node 0's launcher serves the store, unless etcd holds it.
  const bool serve = !rendezvous_in_etcd() && o_.node_rank == 0;
  const auto store_address = rendezvous_in_etcd() ? comm::parse_etcd_endpoint(o_.etcd, "--rdzv")
                                                  : comm::HostPort{o_.master_addr, o_.master_port};
  node_ = o_.node_rank;
  nodes_ = o_.nnodes;
  store_ = comm::Store::connect({.host = store_address.host,
                                 .port = store_address.port,
                                 .is_server = serve,
                                 .timeout = o_.rendezvous_timeout,
                                 .job_id = o_.job_id,
                                 .secret = job_secret(o_),
                                 .etcd = rendezvous_in_etcd()});
  round_ = static_cast<int>(store_->add("launch/round", 0));
  Json about_node;
  about_node["host"] = host_name();
  about_node["node_rank"] = o_.node_rank;
  about_node["nproc"] = o_.nproc_per_node;
  about_node["data_workers"] = o_.data_workers;
  const std::string share = about_node.dump();
  while (true) {
    say("joining round " + std::to_string(round_) + " at the " + store_->where() + " (job " +
        o_.job_id + ")");
    try {
      if (rendezvous_in_etcd()) {
        std::string error;
        const auto joined = join_elastic_round(share, error);
        if (!error.empty()) {
          std::cerr << "error: cohort launch: " << error << std::endl;
          return 1;
        }
        lay_out(joined);
      } else {
        lay_out(
            store_->arrive_and_wait(key("join/"), node_, nodes_, share,
                                    "join round " + std::to_string(round_) + " of job " + o_.job_id,
                                    o_.rendezvous_timeout, "nodes"));
      }
    } catch (const TimeoutError& e) {
      std::cerr << "error: cohort launch: " << e.what() << " (lost, or not started?)" << std::endl;
      return 1;
    } catch (const PeerFailureError& e) {
      if (rendezvous_in_etcd()) {
        std::cerr << "error: cohort launch: " << e.what() << std::endl;
      } else {
        std::cerr << "error: cohort launch: lost node 0 (" << o_.master_addr << ":"
                  << o_.master_port << "), which holds the rendezvous" << std::endl;
      }
      return 1;
    }
    monitor_.reset();
    WorkerGroupOptions group_options;
    // Node 0 keeps a place for the job host, started when rank 0 asks (launch_host_key).
    group_options.num_workers = host_local() + (node_ == 0 ? 1 : 0);
    group_options.started_later = [this](int local) { return is_host(local); };
    // The ranks' coordinator (on rank 0 or the job host) stops them itself after a failure,
    // naming its cause: the launcher lets it speak first.
    group_options.failure_grace = std::chrono::seconds(2);
    group_options.executable = program;
    group_options.argv = o_.command;
    group_options.role.clear();
    group_options.rank_name = [this](int local) {
      if (is_host(local)) return std::string("the job host");
      return (is_rank(local) ? "rank " : "data worker ") + std::to_string(index_in_job(local));
    };
    group_options.rank_role = [this](int local) {
      if (is_host(local)) return std::string(kJobHostRole);
      return is_rank(local) ? std::string() : std::string(kDataWorkerRole);
    };
    group_options.rank_env = [this, &store_address](int local) {
      std::map<std::string, std::string> env;
      if (is_rank(local)) {
        // With etcd, MASTER_ADDR is etcd's host: the data plane binds to the interface that
        // reaches it.
        env = worker_env({.world_rank = index_in_job(local),
                          .local_rank = local,
                          .node_rank = node_,
                          .world_size = world_,
                          .local_world_size = o_.nproc_per_node,
                          .master_addr = store_address.host,
                          .master_port = store_address.port});
      } else {
        // A data worker or the job host holds no rank: it finds its work through the store.
        env["MASTER_ADDR"] = store_address.host;
        if (!is_host(local)) env[kDataMemberVar] = std::to_string(index_in_job(local));
        env[kTrainRanksVar] = std::to_string(world_);
      }
      env[kDataMembersVar] = std::to_string(members_);
      env[kLauncherVar] = "cohort-launch";
      env[kJobIdVar] = o_.job_id;
      env[kRestartRoundVar] = std::to_string(round_);
      env[kStoreOnLauncherVar] = "1";
      env[kStorePortVar] = std::to_string(store_address.port);
      env[kRendezvousVar] = o_.etcd;
      add_job_secret_env(env, store_->secret());
      return env;
    };
    WorkerGroup group(group_options);
    std::string peer_reason;
    WorkerGroupHandlers handlers;
    handlers.on_output = [this](int local, int pid, bool is_stderr, const std::string& line) {
      const std::string who = is_host(local)   ? "host"
                              : is_rank(local) ? "rank=" + std::to_string(index_in_job(local))
                                               : "data=" + std::to_string(index_in_job(local));
      (is_stderr ? std::cerr : std::cout)
          << "(" << who << ", pid=" << pid << ") " << line << std::endl;  // line by line
    };
    // Live recovery (launch_live_key): this node's ranks that the job goes on without, by local
    // index, with whether its place is said free; and each rank's losses over the round (the
    // latest is the one the job host's keys name).
    std::map<int, bool> lost;
    std::map<int, int> losses;
    handlers.on_exit = [&](const WorkerExit& exit) {
      const int local = exit.rank;
      if (exit.signal == 0 || exit.stopped_by_driver || group.stopping()) return;
      // The job host keeps the coordinator and the decisions of live recovery: its loss ends the
      // round, which the launchers restart (--max-restarts) from the ranks' snapshots or the last
      // checkpoint.
      if (is_host(local)) {
        say(exit.describe() +
            ": it hosts the coordinator of live recovery, so the job cannot go on without it: " +
            (round_ < o_.max_restarts
                 ? std::string("the round ends, and the job restarts from the ranks' snapshots "
                               "or the last checkpoint")
                 : "the job ends (give cohort launch --max-restarts N to restart it from the "
                   "ranks' snapshots or the last checkpoint)"));
        // The round's cause, before the ranks that lost their coordinator with it.
        group.request_stop(exit.describe(), /*failure=*/true);
        return;
      }
      if (!is_rank(local)) return;
      try {
        if (!store_->check({launch_live_key(round_)})) return;
      } catch (const std::exception&) {
        return;  // the store is gone: the round fails, and check_peers names why
      }
      group.tolerate(local);
      group.kill(local);  // what it started goes with it: its place is free once they are gone
      ++losses[local];
      lost[local] = false;
      say(exit.describe() +
          ": the job goes on without it (live recovery); a replacement starts when the job host "
          "asks for one");
    };
    // A rank that hangs is killed when the job host asks (its end then reaches on_exit as a loss).
    int64_t kills_seen = 0;
    auto next_kill_check = Clock::now();
    const auto kill_hung = [&] {
      if (Clock::now() < next_kill_check) return;
      next_kill_check = Clock::now() + std::chrono::milliseconds(200);
      if (!store_->check({launch_kills_key(round_)})) return;
      const int64_t kills = store_->add(launch_kills_key(round_), 0);
      if (kills == kills_seen) return;
      kills_seen = kills;
      for (int local = 0; local < o_.nproc_per_node; ++local) {
        const std::string kill = launch_kill_key(round_, index_in_job(local), losses[local] + 1);
        if (!store_->check({kill})) continue;
        say("rank " + std::to_string(index_in_job(local)) + " hangs (" + store_->get(kill) +
            "): killing it at the job host's word (live recovery)");
        group.kill(local);
      }
    };
    // A lost rank's place is said free once nothing of it is left; the replacement the job host
    // asks for starts there, as the rank and in the group it names.
    const auto replace_lost = [&] {
      for (auto it = lost.begin(); it != lost.end();) {
        const int local = it->first;
        bool& place_free = it->second;
        const int rank = index_in_job(local);
        if (!place_free && !process_group_alive(group.pids()[static_cast<size_t>(local)])) {
          store_->set(launch_place_free_key(round_, rank, losses[local]), "1");
          place_free = true;
        }
        const std::string start = launch_replacement_key(round_, rank, losses[local]);
        if (!place_free || !store_->check({start})) {
          ++it;
          continue;
        }
        Json join = Json::parse(store_->get(start));
        auto env = worker_env({.world_rank = join.at("rank").get<int>(),
                               .local_rank = local,
                               .node_rank = node_,
                               .world_size = join.at("world_size").get<int>(),
                               .local_world_size = o_.nproc_per_node,
                               .master_addr = store_address.host,
                               .master_port = store_address.port});
        join["index"] = rank;
        env[kLiveJoinVar] = join.dump();
        group.restart(local, env);
        say("started the replacement of rank " + std::to_string(rank) + " as rank " +
            std::to_string(join.at("rank").get<int>()) + " of " +
            std::to_string(join.at("world_size").get<int>()) + " (pid " +
            std::to_string(group.pids()[static_cast<size_t>(local)]) + ")");
        it = lost.erase(it);
      }
    };
    // Node 0 starts the job host when rank 0 asks for one (a run that recovers live), and stops
    // looking once rank 0 said either way.
    bool host_decided = false;
    auto next_host_check = Clock::now();
    const auto start_host = [&] {
      if (node_ != 0 || host_decided || Clock::now() < next_host_check) return;
      next_host_check = Clock::now() + std::chrono::milliseconds(200);
      if (!store_->check({launch_host_key(round_)})) return;
      host_decided = true;
      if (store_->get(launch_host_key(round_)) != "1") return;
      group.restart(host_local(), {});
      say("started the job host (pid " +
          std::to_string(group.pids()[static_cast<size_t>(host_local())]) +
          "): it keeps the run and its coordinator, so that any rank can be replaced");
    };
    handlers.on_tick = [&] {
      if (group.stopping() || !peer_reason.empty()) return;
      peer_reason = check_peers().reason;
      if (!peer_reason.empty()) {
        group.request_stop(peer_reason);
        return;
      }
      try {
        start_host();
        kill_hung();
        replace_lost();
      } catch (const std::exception& e) {
        peer_reason = std::string("live recovery: ") + e.what();
        group.request_stop(peer_reason);
      }
    };
    group.start();
    std::string started;
    if (o_.nproc_per_node > 0) {
      started = "ranks " + std::to_string(first_rank_) + "-" +
                std::to_string(first_rank_ + o_.nproc_per_node - 1) + " of " +
                std::to_string(world_);
    }
    if (o_.data_workers > 0) {
      started += (started.empty() ? "" : ", ") + std::string("data workers ") +
                 std::to_string(first_member_) + "-" +
                 std::to_string(first_member_ + o_.data_workers - 1) + " of " +
                 std::to_string(members_);
    }
    say("round " + std::to_string(round_) + ": started " + started);
    const auto outcome = group.wait(handlers);
    if (outcome.interrupted_by != 0) {
      mark_failed("node " + std::to_string(node_) + " was interrupted");
      return 128 + outcome.interrupted_by;
    }
    std::string reason = peer_reason;
    if (outcome.success) {
      // Node 0 serves the store: it stays until every node is done.
      reason = wait_for_nodes("finished");
      if (reason.empty()) {
        try {
          // Node 0 serves the store: it stays until every node has seen the end. With etcd, it
          // then removes the job's keys.
          store_->set(key("left/") + std::to_string(node_), "1");
          if (node_ == 0) {
            std::vector<std::string> left;
            for (int node = 0; node < nodes_; ++node)
              left.push_back(key("left/") + std::to_string(node));
            store_->wait(left, o_.rendezvous_timeout);
            if (rendezvous_in_etcd()) store_->remove_prefix("");
          }
        } catch (const std::exception&) {
          // Everyone finished; a node that left without saying so changes nothing.
        }
        say("every worker of every node finished");
        return 0;
      }
    } else if (reason.empty()) {
      reason =
          "node " + std::to_string(node_) + " (" + host_name() + "): " + outcome.failure_reason;
      // A worker killed by a signal is a cause: the other nodes learn it at once. A worker that
      // exited with an error most often failed in a collective because a peer node or its worker
      // died: that is named first.
      const bool killed = outcome.first_failure && outcome.first_failure->signal != 0 &&
                          !outcome.first_failure->stopped_by_driver;
      if (!killed && nodes_ > 1) {  // on one node there is no other node to blame
        if (auto cause = find_root_cause(); !cause.empty())
          reason = cause + " (then " + reason + ")";
      }
      mark_failed(reason);
    }
    if (round_ >= o_.max_restarts) {
      std::cerr << "error: cohort launch: the job failed: " << reason
                << (o_.max_restarts > 0
                        ? " (after " + std::to_string(o_.max_restarts) + " restart(s))"
                        : "")
                << std::endl;
      return 1;
    }
    ++round_;
    try {
      store_->set("launch/round", std::to_string(round_));
    } catch (const std::exception&) {
    }
    say("round failed (" + reason + "); restarting as round " + std::to_string(round_) +
        " of at most " + std::to_string(o_.max_restarts));
  }
}

}  // namespace

std::string launch_live_key(int round) { return "launch/" + std::to_string(round) + "/live"; }

namespace {

// A live key about `rank`'s n-th lost process.
std::string launch_loss_key(int round, const char* what, int rank, int n) {
  return launch_live_key(round) + "/" + what + "/" + std::to_string(rank) + "/" + std::to_string(n);
}

}  // namespace

std::string launch_place_free_key(int round, int rank, int n) {
  return launch_loss_key(round, "free", rank, n);
}

std::string launch_replacement_key(int round, int rank, int n) {
  return launch_loss_key(round, "start", rank, n);
}

std::string launch_kill_key(int round, int rank, int n) {
  return launch_loss_key(round, "kill", rank, n);
}

std::string launch_kills_key(int round) { return launch_live_key(round) + "/kills"; }

std::string launch_host_key(int round) { return "launch/" + std::to_string(round) + "/host"; }

int launch_node(const NodeLaunchOptions& options) {
  if (options.nnodes < 1)
    throw UsageError("--nnodes " + std::to_string(options.nnodes) + " must be >= 1");
  if (options.node_rank < 0 || options.node_rank >= options.nnodes) {
    throw UsageError("--node-rank " + std::to_string(options.node_rank) + " must be in [0, " +
                     std::to_string(options.nnodes) + ")");
  }
  if (options.nproc_per_node < 0 || options.data_workers < 0) {
    throw UsageError("--nproc-per-node and --data-workers must be >= 0");
  }
  if (options.nproc_per_node + options.data_workers < 1) {
    throw UsageError(
        "--nproc-per-node 0 is a CPU-only node: give it --data-workers N (preprocessing "
        "processes)");
  }
  if (options.master_port < 1 || options.master_port > 65535) {
    throw UsageError("--master port " + std::to_string(options.master_port) +
                     " is not a port (1-65535)");
  }
  if (options.master_addr.empty())
    throw UsageError("--master needs HOST:PORT, the address of node 0");
  if (options.max_restarts < 0) throw UsageError("--max-restarts must be >= 0");
  if (!options.etcd.empty()) comm::parse_etcd_endpoint(options.etcd, "--rdzv");
  if (options.min_nodes != 0 && options.etcd.empty()) {
    throw UsageError("--min-nodes " + std::to_string(options.min_nodes) +
                     " needs --rdzv etcd://HOST:PORT: without etcd, node 0 holds the rendezvous "
                     "and the job cannot lose it");
  }
  if (options.min_nodes < 0 || options.min_nodes > options.nnodes) {
    throw UsageError("--min-nodes " + std::to_string(options.min_nodes) + " must be in [1, " +
                     std::to_string(options.nnodes) + "] (--nnodes)");
  }
  if (options.command.empty()) throw UsageError("cohort launch: give the program after '--'");
  return NodeLauncher(options).run();
}

}  // namespace cohort::runtime

/// \file
/// Default deadlines, defined once: every options struct and every reader of a worker's settings
/// takes its default from here.
#pragma once
#include <chrono>

namespace cohort {

/// Every rank joins the rendezvous and its process groups within this.
inline constexpr std::chrono::milliseconds kDefaultSetupTimeout{60'000};
/// One collective (and every wait that stands for one, such as report()'s) ends within this.
inline constexpr std::chrono::milliseconds kDefaultCollectiveTimeout{300'000};
/// A rank (or a node's launcher) silent this long is taken for hung or stopped.
inline constexpr std::chrono::milliseconds kDefaultHeartbeatTimeout{30'000};
/// A node's launcher silent this long is lost (cohort launch; nodes beat often and cheaply).
inline constexpr std::chrono::milliseconds kDefaultNodeHeartbeatTimeout{5'000};
/// A job's keys in etcd (`--rdzv etcd://`) outlive its last process by this: its lease, which
/// each of its processes renews a third of it apart.
inline constexpr std::chrono::seconds kDefaultEtcdLeaseTtl{15};
/// A store call (connect, get, wait) ends within this unless the caller gives its own deadline.
inline constexpr std::chrono::milliseconds kDefaultStoreTimeout{30'000};
/// A message of the data plane (preprocessing workers), and a data worker's start: read or sent
/// whole within this.
inline constexpr std::chrono::milliseconds kDefaultDataMessageTimeout{60'000};
/// One task of a preprocessing worker (its rows through every map stage): a worker still on it
/// past this is taken to hang, killed and replaced (data::ExecutionOptions::task_timeout).
inline constexpr std::chrono::milliseconds kDefaultDataTaskTimeout{600'000};
/// How long a server of many clients (the coordinator, a parameter server) waits for one
/// client to take a reply, or to send the rest of a request it began, before it drops that
/// client: one that stops reading or writing must not stall the others.
inline constexpr std::chrono::milliseconds kServerClientTimeout{2'000};
/// How long a server waits for a new connection to prove that it holds the job secret before it
/// closes it (comm/job_secret.h): a connection that says nothing holds no slot for longer.
inline constexpr std::chrono::milliseconds kHandshakeTimeout{10'000};

}  // namespace cohort

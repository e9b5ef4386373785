#pragma once
#include <chrono>
#include <csignal>
#include <functional>
#include <memory>
#include <string>

#include "cohort/comm/flight_recorder.h"
#include "cohort/comm/job_secret.h"
#include "cohort/runtime/coordinator.h"

namespace cohort::runtime {

// The worker's end of the control plane to its local driver: one line per message, separate
// from stdout/stderr (which stay the user's) and from the collectives' data plane.

/// True when this process was started by a local driver that listens for control messages, or
/// has a sink in-process.
bool has_control_channel();

/// Under an external launcher there is no driver: rank 0 takes its own control messages with
/// this sink (called on the sending thread) and keeps the driver's bookkeeping itself, unless
/// cohort launch's job host keeps it.
void set_control_sink(std::function<void(const std::string&)> sink);

/// Sends one message (must not contain a newline). Thread-safe. Throws RuntimeError when the
/// driver is gone.
void send_control_message(const std::string& line);

/// The signal that asks a worker to stop at its next checkpoint: the local driver sends it at the
/// first Ctrl-C to workers that accept stop requests (train::should_stop()); under a launcher send
/// it to every rank yourself (Slurm: scancel --signal=USR1 --full JOB).
inline constexpr int kStopRequestSignal = SIGUSR1;
/// Installs the handler of kStopRequestSignal in this process (idempotent).
void watch_stop_requests();
/// Whether this process received kStopRequestSignal since watch_stop_requests().
bool stop_requested();

/// The signal the local driver sends the survivors when it lost a worker and recovers live
/// (FailureConfig::Recovery::kLive): their collectives stop waiting for the lost one, which a
/// transport does not always notice (comm::ProcessGroupOptions::aborted).
inline constexpr int kPeerLostSignal = SIGUSR2;
/// Installs the handler of kPeerLostSignal in this process (idempotent).
void watch_peer_losses();
/// How many kPeerLostSignal this process received since watch_peer_losses(), and peer losses
/// noted otherwise (note_peer_lost).
int peer_losses();
/// Counts a lost peer as kPeerLostSignal does: under cohort launch the coordinator says so in a
/// {"type": "peer_lost"} message (each rank's follower thread calls this), and rank 0, which hosts
/// it, calls this itself.
void note_peer_lost();

/// The signal the local driver sends its workers before it stops them after a failure: each
/// writes out its flight recorder (set_flight_recorder). SIGURG is ignored by default, so a
/// process that records nothing is not hurt by it.
inline constexpr int kFlightDumpSignal = SIGURG;
/// This process's flight recorder, and how it is written out (`dump`, given why). The control
/// messages sent and received from now on are recorded in it, heartbeats aside. kFlightDumpSignal
/// makes the heartbeat thread call `dump` (within a heartbeat interval), and a coordinator's abort
/// makes the thread that follows it call `dump` before the process ends. Null and empty: none.
void set_flight_recorder(std::shared_ptr<comm::FlightRecorder> recorder,
                         std::function<void(const std::string& reason)> dump);
/// Calls the `dump` of set_flight_recorder now with `reason` (nothing when none is set; an error
/// of its own is printed, not thrown: it is called on the way out of a failure).
void dump_flight_recorder(const std::string& reason);

/// Starts a background thread that sends {"type":"heartbeat", "status": activity_status()} every
/// `interval`, so the coordinator can tell a hung or stopped worker (no heartbeats) from a busy one
/// and name the ranks a collective waits for. Idempotent; nothing without a control channel.
void start_heartbeat(std::chrono::milliseconds interval);
/// Stops that thread and waits for it (before a process that sent heartbeats returns from its
/// run: nothing may beat once the run's state is gone). Start it again with start_heartbeat.
void stop_heartbeat();
/// Under an external launcher, a rank reaches the coordinator that `coordinator_host` runs (rank 0,
/// or cohort launch's job host: CoordinatorServer at `address`) over TCP: its control messages and
/// heartbeats go there. A thread follows the coordinator: told to stop, or hearing nothing from
/// it for the heartbeat timeout, or losing it, the process prints why (naming the rank and the
/// host) and exits with status 1. The connection first proves that this process holds `secret`,
/// the job's.
void connect_to_coordinator(const std::string& address, int rank, const std::string& token,
                            const comm::JobSecret& secret, const HeartbeatOptions& heartbeat,
                            const std::string& coordinator_host = "rank 0");
/// The rank's work is done: says so to the coordinator, which from now on may go away.
void leave_coordinator();
/// After a collective failed because of a peer: gives the coordinator up to `within` to end this
/// process with the cause's name; returns when it does not.
void wait_for_coordinator(std::chrono::milliseconds within);

}  // namespace cohort::runtime

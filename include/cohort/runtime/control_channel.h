#pragma once
#include <chrono>
#include <functional>
#include <string>

namespace cohort::runtime {

// The worker's end of the control plane to its local driver: one line per message, separate
// from stdout/stderr (which stay the user's) and from the collectives' data plane.

// True when this process was started by a local driver that listens for control messages, or
// has a sink in-process.
bool has_control_channel();

// Under an external launcher there is no driver: rank 0 takes its own control messages with
// this sink (called on the sending thread) and keeps the driver's bookkeeping itself.
void set_control_sink(std::function<void(const std::string&)> sink);

// Sends one message (must not contain a newline). Thread-safe. Throws RuntimeError when the
// driver is gone.
void send_control_message(const std::string& line);

// Starts a background thread that sends {"type":"heartbeat", "status": ...} every `interval`, so
// the driver can tell a hung or stopped worker (no heartbeats) from a busy one. Idempotent.
void start_heartbeat(std::chrono::milliseconds interval);
// What heartbeats carry from now on: a JSON value (as text) describing what this worker is doing.
void set_heartbeat_status(std::function<std::string()> status);

}  // namespace cohort::runtime

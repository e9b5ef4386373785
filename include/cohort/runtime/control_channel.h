#pragma once
#include <string>

namespace cohort::runtime {

// The worker's end of the control plane to its local driver: one line per message, separate
// from stdout/stderr (which stay the user's) and from the collectives' data plane.

// True when this process was started by a local driver that listens for control messages.
bool has_control_channel();

// Sends one message (must not contain a newline). Thread-safe. Throws RuntimeError when the
// driver is gone.
void send_control_message(const std::string& line);

}  // namespace cohort::runtime

#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace cohort {

/// Bad input from the user: a config value, a flag, a file that is not what it should be.
/// The message names the thing, the value and the fix. The CLI exits with code 2.
class UsageError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

/// A failure while running: a worker died, a peer did not answer, a file could not be written.
class RuntimeError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A wait ran past its deadline. The message names who did not arrive.
class TimeoutError : public RuntimeError {
 public:
  using RuntimeError::RuntimeError;
};

/// A collective failed because a peer died or closed its connection: a consequence, not a cause.
class PeerFailureError : public RuntimeError {
 public:
  using RuntimeError::RuntimeError;
};

/// A number as error messages quote it: its shortest usual form (0.1, 1e-08, 1.5, -1).
inline std::string format_number(double value) {
  std::ostringstream out;
  out << value;
  return out.str();
}

}  // namespace cohort

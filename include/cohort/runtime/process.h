#pragma once
#include <map>
#include <string>
#include <vector>

namespace cohort::runtime {

/// The environment of a child process: this process's, with `overrides` applied, COHORT_ROLE set
/// to `role` (removed when empty) and COHORT_DRIVER_PID set to this process, so that the child
/// dies with it (bind_lifetime_to_driver). A role child's control channel is fd 3 when
/// `control_fd` is true; otherwise the variable is removed.
std::vector<std::string> child_environment(const std::map<std::string, std::string>& overrides,
                                           const std::string& role, bool control_fd);

/// Re-executes this program (same executable image, same arguments) in `role`, with stdin, stdout
/// and stderr inherited, in a process group of its own. Returns its pid. Throws RuntimeError.
int spawn_self(const std::string& role, const std::map<std::string, std::string>& env);

/// What identifies this program's build: the linker's GNU build id of the executable (hex), or,
/// for one linked without it, `"exe:<size>-<mtime>"` of /proc/self/exe. Processes that must run the
/// same build compare it.
std::string program_build_id();

}  // namespace cohort::runtime

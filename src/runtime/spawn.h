// Starting a child process the way every cohort child starts: in a process group of its own
// (a Ctrl-C reaches the parent, which then stops its children in order), with default signal
// dispositions and nothing blocked.
#pragma once
#include <spawn.h>

#include <string>
#include <vector>

namespace cohort::runtime {

// posix_spawn of `exe`; returns 0 and sets `pid`, or the error number.
int spawn_in_own_group(const std::string& exe, std::vector<std::string> args,
                       std::vector<std::string> env, const posix_spawn_file_actions_t* actions,
                       int& pid);

}  // namespace cohort::runtime

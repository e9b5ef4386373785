#include "cohort/runtime/process.h"

#include <spawn.h>
#include <unistd.h>

#include <csignal>
#include <cstring>

#include "cohort/error.h"
#include "cohort/runtime/worker_group.h"
#include "cohort/runtime/worker_info.h"
#include "runtime/spawn.h"

extern char** environ;

namespace cohort::runtime {

std::vector<std::string> child_environment(const std::map<std::string, std::string>& overrides,
                                           const std::string& role, bool control_fd) {
  std::map<std::string, std::string> vars;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string entry(*e);
    const auto eq = entry.find('=');
    if (eq != std::string::npos) vars[entry.substr(0, eq)] = entry.substr(eq + 1);
  }
  for (const auto& [k, v] : overrides) vars[k] = v;
  vars.erase(kRoleVar);
  vars.erase(kControlFdVar);
  if (!role.empty()) vars[kRoleVar] = role;
  if (control_fd) vars[kControlFdVar] = "3";
  vars[kDriverPidVar] = std::to_string(::getpid());
  std::vector<std::string> out;
  for (const auto& [k, v] : vars) out.push_back(k + "=" + v);
  return out;
}

int spawn_in_own_group(const std::string& exe, std::vector<std::string> args,
                       std::vector<std::string> env, const posix_spawn_file_actions_t* actions,
                       int& pid) {
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t defaults;
  sigemptyset(&defaults);
  for (int sig : {SIGINT, SIGTERM, SIGCHLD, SIGPIPE}) sigaddset(&defaults, sig);
  sigset_t none;
  sigemptyset(&none);
  posix_spawnattr_setsigdefault(&attr, &defaults);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setpgroup(&attr, 0);
  posix_spawnattr_setflags(&attr,
                           POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETSIGMASK);
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<char*> envp;
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  pid_t child = -1;
  const int rc = posix_spawn(&child, exe.c_str(), actions, &attr, argv.data(), envp.data());
  posix_spawnattr_destroy(&attr);
  pid = child;
  return rc;
}

int spawn_self(const std::string& role, const std::map<std::string, std::string>& env) {
  int pid = -1;
  const int rc = spawn_in_own_group("/proc/self/exe", self_arguments(),
                                    child_environment(env, role, false), nullptr, pid);
  if (rc != 0)
    throw RuntimeError("cannot start a " + role + " process of this program: " + std::strerror(rc));
  return pid;
}

}  // namespace cohort::runtime

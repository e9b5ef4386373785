#include "cohort/runtime/process.h"

#include <elf.h>
#include <link.h>
#include <spawn.h>
#include <sys/stat.h>
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

namespace cohort::runtime {
namespace {

// The NT_GNU_BUILD_ID note of the executable (the first object dl_iterate_phdr reports).
int find_build_id(dl_phdr_info* info, size_t, void* out) {
  auto& id = *static_cast<std::string*>(out);
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const auto& ph = info->dlpi_phdr[i];
    if (ph.p_type != PT_NOTE) continue;
    const char* p = reinterpret_cast<const char*>(info->dlpi_addr + ph.p_vaddr);
    const char* end = p + ph.p_memsz;
    while (p + sizeof(ElfW(Nhdr)) <= end) {
      const auto* note = reinterpret_cast<const ElfW(Nhdr)*>(p);
      const char* name = p + sizeof(ElfW(Nhdr));
      const char* desc = name + ((note->n_namesz + 3) & ~3u);
      if (note->n_type == NT_GNU_BUILD_ID && note->n_namesz == 4 &&
          std::memcmp(name, "GNU", 4) == 0) {
        static const char* hex = "0123456789abcdef";
        for (uint32_t k = 0; k < note->n_descsz; ++k) {
          const auto byte = static_cast<unsigned char>(desc[k]);
          id += hex[byte >> 4];
          id += hex[byte & 15];
        }
        return 1;
      }
      p = desc + ((note->n_descsz + 3) & ~3u);
    }
  }
  return 1;  // only the executable
}

}  // namespace

std::string program_build_id() {
  static const std::string id = [] {
    std::string found;
    dl_iterate_phdr(find_build_id, &found);
    if (!found.empty()) return found;
    struct stat st {};
    if (::stat("/proc/self/exe", &st) != 0) return std::string("unknown");
    return "exe:" + std::to_string(st.st_size) + "-" + std::to_string(st.st_mtime);
  }();
  return id;
}

}  // namespace cohort::runtime

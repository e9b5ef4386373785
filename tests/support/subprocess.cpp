#include "support/subprocess.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>

extern char** environ;

namespace cohort::testing {

std::string cli_path() { return COHORT_CLI_PATH; }
std::string tools_dir() { return COHORT_TOOLS_DIR; }

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof address;
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    if (fd >= 0) ::close(fd);
    throw std::runtime_error("no free port on 127.0.0.1");
  }
  ::close(fd);
  return ntohs(address.sin_port);
}

namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

Process::Process(const std::vector<std::string>& argv,
                 const std::map<std::string, std::string>& env) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error("pipe failed");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], 1);
  posix_spawn_file_actions_adddup2(&actions, fds[1], 2);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  posix_spawnattr_setpgroup(&attr, 0);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
  std::map<std::string, std::string> vars;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string entry(*e);
    auto eq = entry.find('=');
    vars[entry.substr(0, eq)] = entry.substr(eq + 1);
  }
  // The program under test must not believe it is one of our workers.
  for (const char* k :
       {"COHORT_ROLE", "COHORT_DRIVER_PID", "COHORT_CONTROL_FD", "RANK", "WORLD_SIZE"}) {
    vars.erase(k);
  }
  for (const auto& [k, v] : env) vars[k] = v;
  std::vector<std::string> env_strings;
  for (const auto& [k, v] : vars) env_strings.push_back(k + "=" + v);
  std::vector<char*> envp;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> args = argv;
  std::vector<char*> cargv;
  for (auto& a : args) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  int rc = posix_spawnp(&pid_, args[0].c_str(), &actions, &attr, cargv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  ::close(fds[1]);
  fd_ = fds[0];
  if (rc != 0) throw std::runtime_error("cannot start " + args[0] + ": " + std::strerror(rc));
}

Process::~Process() {
  if (!exited_ && pid_ > 0) {
    ::kill(-pid_, SIGKILL);
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
  }
  if (fd_ >= 0) ::close(fd_);
}

bool Process::read_some(std::chrono::milliseconds timeout) {
  if (fd_ < 0) return false;
  pollfd p{fd_, POLLIN, 0};
  if (::poll(&p, 1, static_cast<int>(timeout.count())) <= 0) return true;
  char buffer[8192];
  ssize_t n = ::read(fd_, buffer, sizeof buffer);
  if (n > 0) {
    output_.append(buffer, static_cast<size_t>(n));
    return true;
  }
  ::close(fd_);
  fd_ = -1;
  return false;
}

std::optional<std::string> Process::wait_for_line(const std::string& needle,
                                                  std::chrono::milliseconds deadline) {
  const auto until = Clock::now() + deadline;
  while (true) {
    size_t nl;
    while ((nl = output_.find('\n', scanned_)) != std::string::npos) {
      std::string line = output_.substr(scanned_, nl - scanned_);
      scanned_ = nl + 1;
      if (line.find(needle) != std::string::npos) return line;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now());
    if (left.count() <= 0) return std::nullopt;
    if (!read_some(std::min(left, std::chrono::milliseconds(200))) && fd_ < 0) {
      return std::nullopt;
    }
  }
}

void Process::send_signal(int sig) { ::kill(pid_, sig); }

CommandResult Process::wait(std::chrono::milliseconds deadline) {
  CommandResult result;
  const auto until = Clock::now() + deadline;
  int status = 0;
  while (!exited_) {
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      exited_ = true;
      break;
    }
    if (Clock::now() > until) {
      result.timed_out = true;
      ::kill(-pid_, SIGKILL);
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, &status, 0);
      exited_ = true;
      break;
    }
    read_some(std::chrono::milliseconds(50));
  }
  // Whatever is still in the pipe, with a bound in case a grandchild holds it open.
  const auto drain_until = Clock::now() + std::chrono::seconds(2);
  while (fd_ >= 0 && Clock::now() < drain_until) read_some(std::chrono::milliseconds(50));
  if (WIFEXITED(status)) result.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) result.signal = WTERMSIG(status);
  result.output = output_;
  return result;
}

CommandResult run_command(const std::vector<std::string>& argv, std::chrono::milliseconds deadline,
                          const std::map<std::string, std::string>& env) {
  Process process(argv, env);
  return process.wait(deadline);
}

bool process_alive(int pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  if (!stat) return false;
  std::string text((std::istreambuf_iterator<char>(stat)), {});
  auto close_paren = text.rfind(')');
  return close_paren != std::string::npos && close_paren + 2 < text.size() &&
         text[close_paren + 2] != 'Z';
}

bool wait_for_exit(int pid, std::chrono::milliseconds deadline) {
  const int fd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  if (fd < 0) return !process_alive(pid);  // already gone
  pollfd p{fd, POLLIN, 0};
  ::poll(&p, 1, static_cast<int>(deadline.count()));
  ::close(fd);
  // A zombie (exited, not yet reaped by its parent) counts as exited.
  return !process_alive(pid);
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace cohort::testing

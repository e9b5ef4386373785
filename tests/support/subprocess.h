// Running programs from tests, always under a deadline, never leaving them behind.
#pragma once
#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace cohort::testing {

// The cohort command-line program built with these tests (its path is compiled into one support
// file only, so that the other test objects stay cacheable across build folders).
std::string cli_path();
// The folder of the tools scripts/setup.sh unpacks from Debian packages without installing them
// (<source>/.tools: promtool, etcd).
std::string tools_dir();
// A port no one listens on now on 127.0.0.1 (the kernel's pick for a socket bound to port 0).
int free_port();

struct CommandResult {
  int exit_code = -1;  // -1 when a signal ended it
  int signal = 0;
  bool timed_out = false;
  std::string output;  // stdout and stderr together
};

// Runs argv to completion, or kills it (and its process group) at the deadline.
CommandResult run_command(const std::vector<std::string>& argv,
                          std::chrono::milliseconds deadline = std::chrono::seconds(120),
                          const std::map<std::string, std::string>& env = {});

// A running program whose output can be waited on line by line.
class Process {
 public:
  explicit Process(const std::vector<std::string>& argv,
                   const std::map<std::string, std::string>& env = {});
  ~Process();  // kills it if still running
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  int pid() const { return pid_; }
  // Reads output until a line contains `needle`; returns that line, or nullopt at the deadline
  // or at end of output.
  std::optional<std::string> wait_for_line(const std::string& needle,
                                           std::chrono::milliseconds deadline);
  void send_signal(int sig);
  // Waits for exit; kills at the deadline (timed_out set). Collects the rest of the output.
  CommandResult wait(std::chrono::milliseconds deadline);
  const std::string& output() const { return output_; }

 private:
  bool read_some(std::chrono::milliseconds timeout);
  int pid_ = -1;
  int fd_ = -1;
  bool exited_ = false;
  std::string output_;
  size_t scanned_ = 0;
};

// True while a process with this pid exists (and is not a zombie).
bool process_alive(int pid);

// Waits for any process (not only a child) to exit; false if it is still alive at the deadline.
bool wait_for_exit(int pid, std::chrono::milliseconds deadline);

std::string read_text(const std::string& path);

}  // namespace cohort::testing

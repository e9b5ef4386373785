// The driver's terminal: worker lines, one line per report, and a progress bar that is redrawn
// in place on a terminal (plain periodic lines otherwise). A line that several ranks print alike
// within 5 s shows once, then "[repeated Nx across ranks]" (as Ray dedups logs);
// the per-rank log files keep every line.
#pragma once
#include <chrono>
#include <map>
#include <set>
#include <string>

#include "cohort/json.h"

namespace cohort::train {

class Console {
 public:
  explicit Console(int verbose);
  ~Console();
  void worker_line(int rank, int pid, bool is_stderr, const std::string& line);
  void report(int64_t index, const Json& metrics);
  void progress(const Json& progress);
  void message(const std::string& line);
  // A line of what the run does, printed unless it is quiet (verbose 0).
  void info(const std::string& line);
  // Prints the repeat counts whose window has passed (all of them when flush_all).
  void tick(bool flush_all = false);

 private:
  struct Repeat {
    std::chrono::steady_clock::time_point first_seen;
    int rank = 0;
    int pid = 0;
    bool is_stderr = false;
    std::set<int> ranks;
  };
  void print_worker_line(int rank, int pid, bool is_stderr, const std::string& line);
  // Prints the entry's repeat count if it repeated, and forgets it.
  std::map<std::string, Repeat>::iterator finish_repeat(std::map<std::string, Repeat>::iterator it);
  void clear_bar();
  void draw_bar();

  int verbose_;
  bool tty_;
  std::string bar_;
  bool bar_shown_ = false;
  std::chrono::steady_clock::time_point last_plain_{};
  std::map<std::string, Repeat> recent_;
};

// "name value | name value ..." with numbers rounded for reading.
std::string format_metrics(const Json& metrics);

}  // namespace cohort::train

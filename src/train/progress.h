// The driver's terminal: worker lines, one line per report, and a progress bar that is redrawn
// in place on a terminal (plain periodic lines otherwise).
#pragma once
#include <chrono>
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

 private:
  void clear_bar();
  void draw_bar();

  int verbose_;
  bool tty_;
  std::string bar_;
  bool bar_shown_ = false;
  std::chrono::steady_clock::time_point last_plain_{};
};

// "name value | name value ..." with numbers rounded for reading.
std::string format_metrics(const Json& metrics);

}  // namespace cohort::train

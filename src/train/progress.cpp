#include "train/progress.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <iostream>

namespace cohort::train {
namespace {

std::string format_value(const Json& value) {
  if (value.is_number_float()) {
    const double v = value.get<double>();
    char buffer[64];
    std::snprintf(buffer, sizeof buffer, std::fabs(v) >= 100 ? "%.1f" : "%.4f", v);
    return buffer;
  }
  if (value.is_string()) return value.get<std::string>();
  return value.dump();
}

}  // namespace

std::string format_metrics(const Json& metrics) {
  std::string out;
  for (const auto& [key, value] : metrics.items()) {
    if (!out.empty()) out += " | ";
    out += key + " " + format_value(value);
  }
  return out;
}

Console::Console(int verbose) : verbose_(verbose), tty_(::isatty(STDOUT_FILENO) == 1) {}

Console::~Console() {
  if (bar_shown_) {
    std::cout << '\n';
    std::cout.flush();
  }
}

void Console::clear_bar() {
  if (tty_ && bar_shown_) std::cout << "\r\033[K";
  bar_shown_ = false;
}

void Console::draw_bar() {
  if (!tty_ || bar_.empty() || verbose_ < 1) return;
  std::cout << "\r\033[K" << bar_;
  std::cout.flush();
  bar_shown_ = true;
}

namespace {
constexpr auto kDedupWindow = std::chrono::seconds(5);  // as Ray's log dedup window
}  // namespace

void Console::print_worker_line(int rank, int pid, bool is_stderr, const std::string& line) {
  clear_bar();
  auto& os = is_stderr ? std::cerr : std::cout;
  std::cout.flush();
  os << "(rank=" << rank << ", pid=" << pid << ") " << line << '\n';
  os.flush();
  draw_bar();
}

void Console::worker_line(int rank, int pid, bool is_stderr, const std::string& line) {
  const auto now = std::chrono::steady_clock::now();
  auto it = recent_.find(line);
  if (it != recent_.end()) {
    if (now - it->second.first_seen < kDedupWindow && !it->second.ranks.count(rank)) {
      it->second.ranks.insert(rank);
      return;
    }
    finish_repeat(it);
  }
  print_worker_line(rank, pid, is_stderr, line);
  recent_[line] = Repeat{now, rank, pid, is_stderr, {rank}};
}

std::map<std::string, Console::Repeat>::iterator Console::finish_repeat(
    std::map<std::string, Repeat>::iterator it) {
  const auto& r = it->second;
  if (r.ranks.size() > 1) {
    print_worker_line(
        r.rank, r.pid, r.is_stderr,
        it->first + " [repeated " + std::to_string(r.ranks.size() - 1) + "x across ranks]");
  }
  return recent_.erase(it);
}

void Console::tick(bool flush_all) {
  const auto now = std::chrono::steady_clock::now();
  for (auto it = recent_.begin(); it != recent_.end();) {
    it = flush_all || now - it->second.first_seen >= kDedupWindow ? finish_repeat(it)
                                                                  : std::next(it);
  }
}

void Console::message(const std::string& line) {
  clear_bar();
  std::cout << line << '\n';
  std::cout.flush();
  draw_bar();
}

void Console::info(const std::string& line) {
  if (verbose_ >= 1) message(line);
}

void Console::report(int64_t index, const Json& metrics) {
  if (verbose_ < 1) return;
  bar_.clear();
  message("[report " + std::to_string(index) + "] " + format_metrics(metrics));
}

void Console::progress(const Json& progress) {
  if (verbose_ < 1) return;
  const int64_t step = progress.value("step", int64_t{0});
  const int64_t total = progress.value("total", int64_t{0});
  std::string line = progress.value("label", std::string{});
  if (total > 0) {
    constexpr int kWidth = 24;
    const int filled = static_cast<int>(kWidth * std::min<int64_t>(step, total) / total);
    line += (line.empty() ? "[" : " [") + std::string(filled, '#') +
            std::string(kWidth - filled, '.') + "] " + std::to_string(step) + "/" +
            std::to_string(total);
  } else {
    line += " step " + std::to_string(step);
  }
  Json rest = Json::object();
  for (const auto& [key, value] : progress.items()) {
    if (key != "label" && key != "step" && key != "total") rest[key] = value;
  }
  if (!rest.empty()) line += "  " + format_metrics(rest);
  if (tty_) {
    bar_ = line;
    draw_bar();
    return;
  }
  // Not a terminal: a plain line now and then, so logs stay readable.
  const auto now = std::chrono::steady_clock::now();
  if (now - last_plain_ >= std::chrono::seconds(10) || (total > 0 && step == total)) {
    last_plain_ = now;
    message(line);
  }
}

}  // namespace cohort::train

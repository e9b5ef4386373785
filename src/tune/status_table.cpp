#include "tune/status_table.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <ctime>
#include <iomanip>
#include <iostream>
#include <map>
#include <sstream>

namespace cohort::tune {
namespace {

std::string duration(double seconds) {
  const auto total = static_cast<int64_t>(seconds);
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%02lld:%02lld:%02lld", static_cast<long long>(total / 3600),
                static_cast<long long>(total / 60 % 60), static_cast<long long>(total % 60));
  return buffer;
}

std::vector<std::string> columns_of(const StatusView& view) {
  if (!view.metric_columns.empty()) return view.metric_columns;
  std::vector<std::string> columns;
  if (!view.metric.empty()) columns.push_back(view.metric);
  for (const auto& trial : *view.trials) {
    for (const auto& [key, value] : trial.last_result.items()) {
      if (columns.size() >= 4) return columns;
      if (is_bookkeeping(key) || !value.is_number()) continue;
      if (std::find(columns.begin(), columns.end(), key) == columns.end()) columns.push_back(key);
    }
  }
  return columns;
}

std::string table(const std::vector<std::string>& header,
                  const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> widths(header.size());
  for (size_t c = 0; c < header.size(); ++c) widths[c] = header[c].size();
  for (const auto& row : rows) {
    for (size_t c = 0; c < row.size(); ++c) widths[c] = std::max(widths[c], row[c].size());
  }
  std::ostringstream out;
  auto rule = [&](char corner) {
    out << corner;
    for (size_t c = 0; c < widths.size(); ++c) out << std::string(widths[c] + 2, '-') << corner;
    out << '\n';
  };
  auto line = [&](const std::vector<std::string>& cells) {
    out << '|';
    for (size_t c = 0; c < widths.size(); ++c)
      out << ' ' << std::left << std::setw(static_cast<int>(widths[c])) << cells[c] << " |";
    out << '\n';
  };
  rule('+');
  line(header);
  rule('|');
  for (const auto& row : rows) line(row);
  rule('+');
  return out.str();
}

}  // namespace

bool is_bookkeeping(const std::string& key) {
  return key == "training_iteration" || key == "timestamp" || key == "time_total_s" ||
         key == "checkpoint" || key == "trial_id";
}

Json parameter_value(const Json& config, const std::string& path) {
  try {
    const Json::json_pointer pointer("/" + path);
    return config.contains(pointer) ? config.at(pointer) : Json(nullptr);
  } catch (const std::exception&) {
    return nullptr;
  }
}

std::string format_value(const Json& value) {
  if (value.is_null()) return "";
  if (value.is_string()) return value.get<std::string>();
  if (value.is_number_float()) {
    std::ostringstream out;
    out << std::setprecision(4) << value.get<double>();
    return out.str();
  }
  return value.dump();
}

std::string describe_parameters(const Json& config, const std::vector<std::string>& parameters) {
  std::string out;
  for (const auto& p : parameters)
    out += (out.empty() ? "" : ", ") + p + "=" + format_value(parameter_value(config, p));
  return out;
}

int best_trial(const std::vector<TrialInfo>& trials, const std::string& metric,
               const std::string& mode) {
  int best = -1;
  double best_value = 0;
  const double sign = mode == "min" ? -1 : 1;
  for (size_t i = 0; i < trials.size(); ++i) {
    const auto& result = trials[i].last_result;
    if (metric.empty() || !result.contains(metric) || !result[metric].is_number()) continue;
    const double value = sign * result[metric].get<double>();
    if (!std::isfinite(value)) continue;
    if (best < 0 || value > best_value) {
      best = static_cast<int>(i);
      best_value = value;
    }
  }
  return best;
}

std::string render_status(const StatusView& view) {
  const auto& trials = *view.trials;
  std::map<std::string, int> counts;
  for (const auto& t : trials) ++counts[t.status];
  std::ostringstream out;
  const std::time_t now = std::time(nullptr);
  char clock[32];
  std::strftime(clock, sizeof clock, "%Y-%m-%d %H:%M:%S", std::localtime(&now));
  out << "== Status ==\n"
      << "Current time: " << clock << " (running for " << duration(view.running_for_s) << ")\n"
      << "Using " << view.scheduler << "\n"
      << "Logical resource usage: " << view.threads_used << "/" << view.threads_limit
      << " CPU threads\n";
  const int best = best_trial(trials, view.metric, view.mode);
  if (best >= 0) {
    const auto& t = trials[static_cast<size_t>(best)];
    out << "Current best trial: " << t.name << " with " << view.metric << "="
        << format_value(t.last_result[view.metric]) << " and parameters={"
        << describe_parameters(t.config, view.parameters) << "}\n";
  }
  out << "Result logdir: " << view.experiment_path.string() << "\n";
  out << "Number of trials: " << trials.size();
  if (view.total_trials) out << "/" << *view.total_trials;
  std::string breakdown;
  for (const auto& [status, count] : counts) {
    breakdown += (breakdown.empty() ? "" : ", ") + std::to_string(count) + " " + status;
  }
  out << " (" << breakdown << ")\n";
  if (trials.empty()) return out.str();

  const auto metrics = columns_of(view);
  std::vector<std::string> header{"Trial name", "status"};
  for (const auto& p : view.parameters) header.push_back(p);
  header.insert(header.end(), {"iter", "total time (s)"});
  header.insert(header.end(), metrics.begin(), metrics.end());
  std::vector<std::vector<std::string>> rows;
  for (const auto& t : trials) {
    std::vector<std::string> row{t.name, t.status + (t.stopped_early ? " (stopped)" : "")};
    for (const auto& p : view.parameters) row.push_back(format_value(parameter_value(t.config, p)));
    row.push_back(t.iterations > 0 ? std::to_string(t.iterations) : "");
    row.push_back(t.iterations > 0 || t.time_total_s > 0 ? format_value(Json(t.time_total_s)) : "");
    for (const auto& m : metrics)
      row.push_back(t.last_result.contains(m) ? format_value(t.last_result[m]) : "");
    rows.push_back(std::move(row));
  }
  out << table(header, rows);
  std::vector<std::vector<std::string>> errors;
  for (const auto& t : trials) {
    if (t.error)
      errors.push_back({t.name, t.error->substr(0, 160), (view.experiment_path / t.name).string()});
  }
  if (!errors.empty()) {
    out << "Number of errored trials: " << errors.size() << "\n"
        << table({"Trial name", "error", "folder"}, errors);
  }
  return out.str();
}

StatusReporter::StatusReporter(int verbose)
    : verbose_(verbose), terminal_(::isatty(STDOUT_FILENO) == 1) {}

void StatusReporter::erase() {
  if (!terminal_ || drawn_lines_ == 0) return;
  std::cout << "\x1b[" << drawn_lines_ << "F\x1b[J";
  drawn_lines_ = 0;
}

void StatusReporter::event(const std::string& line) {
  if (verbose_ < 1) return;
  if (terminal_) {
    erase();
    std::cout << line << '\n';
    std::cout << last_table_ << std::flush;
    drawn_lines_ = static_cast<int>(std::count(last_table_.begin(), last_table_.end(), '\n'));
    return;
  }
  std::cout << line << std::endl;
}

void StatusReporter::progress(const std::string& line) {
  if (verbose_ >= 1 && !terminal_) std::cout << line << std::endl;
}

void StatusReporter::refresh(const StatusView& view, bool force) {
  if (verbose_ < 1) return;
  const auto now = std::chrono::steady_clock::now();
  const auto period = terminal_ ? std::chrono::seconds(1) : std::chrono::seconds(30);
  if (!force && now - last_draw_ < period) return;
  last_draw_ = now;
  last_table_ = render_status(view);
  if (terminal_) {
    // Lines wider than the terminal would wrap, and the redraw would then miscount its lines.
    winsize size{};
    if (::ioctl(STDOUT_FILENO, TIOCGWINSZ, &size) == 0 && size.ws_col > 1) {
      std::istringstream lines(last_table_);
      std::string clipped;
      for (std::string line; std::getline(lines, line);)
        clipped += line.substr(0, size.ws_col - 1u) + '\n';
      last_table_ = clipped;
    }
  }
  erase();
  std::cout << last_table_ << std::flush;
  drawn_lines_ =
      terminal_ ? static_cast<int>(std::count(last_table_.begin(), last_table_.end(), '\n')) : 0;
}

}  // namespace cohort::tune

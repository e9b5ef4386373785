#include "cohort/train/dashboard.h"

#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <fstream>
#include <sstream>
#include <thread>

#include "cohort/comm/job_secret.h"
#include "cohort/error.h"
#include "comm/handshake.h"
#include "train/run_files.h"

namespace cohort::train {

// The page and uPlot, compiled in (cmake/embed_files.cmake).
namespace assets {
std::string_view index_html();
std::string_view uplot_js();
std::string_view uplot_css();
}  // namespace assets

namespace {

// The cookie that carries the dashboard's token after the URL gave it once.
constexpr const char* kTokenCookie = "cohort_dashboard";

// The value of cookie `name` in the request's Cookie header, "" when it has none.
std::string cookie_of(const httplib::Request& req, const std::string& name) {
  const std::string cookies = req.get_header_value("Cookie");
  size_t at = 0;
  while (at < cookies.size()) {
    while (at < cookies.size() && (cookies[at] == ' ' || cookies[at] == ';')) ++at;
    const size_t end = std::min(cookies.find(';', at), cookies.size());
    const std::string pair = cookies.substr(at, end - at);
    if (pair.compare(0, name.size() + 1, name + "=") == 0) return pair.substr(name.size() + 1);
    at = end;
  }
  return "";
}

namespace fs = std::filesystem;

constexpr const char* kExperimentStateFile = "experiment_state.json";
constexpr size_t kMaxMetricRecords = 5000;  // the newest, for long runs
constexpr size_t kMaxStepRecords = 2000;    // spread over the run

// A JSON file of the run, or null when it is missing or being replaced (the next poll gets it).
Json read_or_null(const fs::path& file) {
  std::error_code ec;
  if (!fs::exists(file, ec)) return nullptr;
  try {
    return read_json(file);
  } catch (const std::exception&) {
    return nullptr;
  }
}

bool is_run(const fs::path& dir) {
  for (const char* file : {kStatusFile, kMetricsFile, kResultFile})
    if (fs::exists(dir / file)) return true;
  return false;
}

bool is_experiment(const fs::path& dir) { return fs::exists(dir / kExperimentStateFile); }

// What a run's files say, each read once per request.
struct RunFiles {
  Json status;  // status.json, or null
  Json result;  // result.json, or null
  // Running while its driver keeps status.json fresh, else what result.json says.
  std::string state;
  // The driver's failures while it runs, result.json's after.
  Json failures() const {
    if (status.is_object() && status.contains("failures")) return status["failures"];
    if (result.is_object()) return result.value("failures", Json::array());
    return Json::array();
  }
};

RunFiles read_run(const fs::path& dir) {
  RunFiles run{read_or_null(dir / kStatusFile), read_or_null(dir / kResultFile), ""};
  const auto& status = run.status;
  const auto& result = run.result;
  const double age = static_cast<double>(std::time(nullptr)) -
                     (status.is_object() ? status.value("updated", 0.0) : 0.0);
  if (status.is_object() && status.value("state", std::string{}) == "running" && age < 30) {
    run.state = "running";
  } else if (result.is_object()) {
    run.state = !result["error"].is_null()           ? "failed"
                : result.value("interrupted", false) ? "interrupted"
                                                     : "finished";
  } else {
    run.state = status.is_object() ? "stale" : "unknown";
  }
  return run;
}

Json list_runs(const fs::path& storage) {
  Json runs = Json::array();
  std::error_code ec;
  std::vector<fs::path> dirs;
  for (const auto& entry : fs::directory_iterator(storage, ec))
    if (entry.is_directory()) dirs.push_back(entry.path());
  std::sort(dirs.begin(), dirs.end(), [](const fs::path& a, const fs::path& b) {
    std::error_code e;
    return fs::last_write_time(a, e) > fs::last_write_time(b, e);
  });
  for (const auto& dir : dirs) {
    if (is_experiment(dir)) {
      runs.push_back({{"name", dir.filename().string()}, {"kind", "experiment"}});
    } else if (is_run(dir)) {
      runs.push_back(
          {{"name", dir.filename().string()}, {"kind", "run"}, {"state", read_run(dir).state}});
    }
  }
  return runs;
}

Json run_details(const fs::path& dir) {
  std::vector<Json> records = read_jsonl(dir / kMetricsFile);
  if (records.size() > kMaxMetricRecords)
    records.erase(records.begin(), records.end() - static_cast<long>(kMaxMetricRecords));
  const Json manager = read_or_null(dir / kCheckpointManagerFile);
  const RunFiles run = read_run(dir);
  return Json{{"name", dir.filename().string()},
              {"kind", "run"},
              {"state", run.state},
              {"status", run.status},
              {"metrics", records},
              {"steps", read_steps(dir, kMaxStepRecords)},
              {"checkpoints", manager.is_object() ? manager["checkpoints"] : Json::array()},
              {"failures", run.failures()},
              {"error", run.result.is_object() ? run.result["error"] : Json(nullptr)}};
}

Json experiment_details(const fs::path& dir) {
  const Json state = read_or_null(dir / kExperimentStateFile);
  Json trials = Json::array();
  if (state.is_object()) {
    for (const auto& t : state.value("trials", Json::array())) {
      Json row = t;
      const auto trial_dir = dir / t.value("name", std::string{});
      row["state"] = is_run(trial_dir) ? read_run(trial_dir).state : "pending";
      trials.push_back(row);
    }
  }
  return Json{{"name", dir.filename().string()},
              {"kind", "experiment"},
              {"metric", state.is_object() ? state.value("metric", Json(nullptr)) : Json(nullptr)},
              {"trials", trials}};
}

// A name from the query: one folder of the storage path, nothing else.
std::optional<fs::path> run_dir_of(const fs::path& storage, const std::string& name) {
  if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..")
    return std::nullopt;
  const auto dir = storage / name;
  if (!fs::is_directory(dir)) return std::nullopt;
  return dir;
}

std::string label_value(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

void gauge(std::ostringstream& out, const std::string& name, const std::string& help) {
  out << "# HELP " << name << " " << help << "\n# TYPE " << name << " gauge\n";
}

}  // namespace

std::string prometheus_metrics(const fs::path& storage) {
  struct Sample {
    std::string labels;
    double value;
  };
  std::map<std::string, std::vector<Sample>> samples;
  // Prometheus' base units (promtool check metrics): the run's milliseconds, MiB and percents
  // scaled to seconds, bytes and ratios.
  // Divisors (a division keeps 70 / 100 at 0.7; MiB's is a power of two, so exact).
  constexpr double kMs = 1e3, kMiB = 1.0 / (1024.0 * 1024.0), kPercent = 1e2;
  const auto add = [&](const std::string& metric, const std::string& labels, const Json& v,
                       double divisor = 1) {
    if (v.is_number() && std::isfinite(v.get<double>()))
      samples[metric].push_back({labels, v.get<double>() / divisor});
  };
  const auto collect = [&](const fs::path& dir, const std::string& run) {
    const std::string labels = "run=\"" + label_value(run) + "\"";
    const auto records = read_jsonl(dir / kMetricsFile);
    const Json last = records.empty() ? Json::object() : records.back();
    add("cohort_training_iteration", labels, last.value("training_iteration", Json()));
    add("cohort_loss", labels,
        last.contains("loss") ? last["loss"] : last.value("train_loss", Json()));
    add("cohort_samples_per_second", labels,
        last.contains("samples_per_second") ? last["samples_per_second"]
                                            : last.value("samples_per_s", Json()));
    add("cohort_ingest_wait_seconds", labels, last.value("ingest_wait_ms", Json()), kMs);
    add("cohort_comm_wait_seconds", labels, last.value("comm_wait_ms", Json()), kMs);
    const RunFiles files = read_run(dir);
    int64_t restarts = 0;
    for (const auto& f : files.failures()) restarts += f.value("restarted", false) ? 1 : 0;
    add("cohort_restarts", labels, restarts);
    add("cohort_running", labels, files.state == "running" ? 1 : 0);
    if (files.status.is_object()) {
      for (const auto& w : files.status.value("workers", Json::array())) {
        const std::string rank_labels =
            labels + ",rank=\"" + std::to_string(w.value("rank", -1)) + "\"";
        add("cohort_rank_step_time_seconds", rank_labels, w.value("step_time_ms", Json()), kMs);
        add("cohort_rank_memory_bytes", rank_labels, w.value("memory_mb", Json()), kMiB);
        add("cohort_rank_gpu_memory_bytes", rank_labels, w.value("gpu_memory_mb", Json()), kMiB);
        add("cohort_rank_gpu_utilization_ratio", rank_labels, w.value("gpu_utilization", Json()),
            kPercent);
      }
    }
  };
  for (const auto& run : list_runs(storage)) {
    const auto dir = storage / run["name"].get<std::string>();
    if (run["kind"] == "run") {
      collect(dir, run["name"].get<std::string>());
    } else {
      std::error_code ec;
      for (const auto& entry : fs::directory_iterator(dir, ec))
        if (entry.is_directory() && is_run(entry.path()))
          collect(entry.path(),
                  run["name"].get<std::string>() + "/" + entry.path().filename().string());
    }
  }
  static const std::map<std::string, std::string> help = {
      {"cohort_training_iteration", "Reports committed so far."},
      {"cohort_loss", "The loss of the last report (loss or train_loss)."},
      {"cohort_samples_per_second", "Training samples per second of the last report."},
      {"cohort_ingest_wait_seconds", "The most any rank waited for data per batch, last report."},
      {"cohort_comm_wait_seconds",
       "Mean time per step the ranks waited in collectives, last report."},
      {"cohort_restarts", "Restarts of the worker group after failures."},
      {"cohort_running", "1 while the run's driver runs."},
      {"cohort_rank_step_time_seconds", "A rank's step time without its waits for peers."},
      {"cohort_rank_memory_bytes", "A rank's resident memory."},
      {"cohort_rank_gpu_memory_bytes", "GPU memory a rank holds, over its GPUs (NVML)."},
      {"cohort_rank_gpu_utilization_ratio",
       "Share of time a kernel ran on the busiest of a rank's GPUs (NVML)."}};
  std::ostringstream out;
  for (const auto& [metric, values] : samples) {
    gauge(out, metric, help.count(metric) ? help.at(metric) : metric);
    // Shortest round-trip text: 2 GiB as 2147483648.0, not 2.14748e+09.
    for (const auto& s : values)
      out << metric << "{" << s.labels << "} " << Json(s.value).dump() << "\n";
  }
  return out.str();
}

struct Dashboard::Impl {
  fs::path storage;
  std::string host;
  int port = 0;
  std::string token;  // asked of every request off loopback; empty on loopback
  httplib::Server server;
  std::thread thread;
  std::atomic<bool> serving_ended{false};
};

Dashboard::Dashboard(fs::path storage_path, const DashboardOptions& options)
    : impl_(std::make_unique<Impl>()) {
  impl_->storage = std::filesystem::absolute(storage_path);
  impl_->host = options.host;
  auto& server = impl_->server;
  const auto storage = impl_->storage;
  server.Get("/", [](const httplib::Request&, httplib::Response& res) {
    res.set_content(std::string(assets::index_html()), "text/html; charset=utf-8");
  });
  server.Get("/uplot.min.js", [](const httplib::Request&, httplib::Response& res) {
    res.set_content(std::string(assets::uplot_js()), "text/javascript");
  });
  server.Get("/uplot.min.css", [](const httplib::Request&, httplib::Response& res) {
    res.set_content(std::string(assets::uplot_css()), "text/css");
  });
  server.Get("/api/runs", [storage](const httplib::Request&, httplib::Response& res) {
    res.set_content(Json{{"storage_path", storage.string()}, {"runs", list_runs(storage)}}.dump(),
                    "application/json");
  });
  server.Get("/api/run", [storage](const httplib::Request& req, httplib::Response& res) {
    auto dir = run_dir_of(storage, req.get_param_value("name"));
    // A Tune trial: ?name=<experiment>&trial=<trial_NNNNN>.
    if (dir && req.has_param("trial")) dir = run_dir_of(*dir, req.get_param_value("trial"));
    if (!dir) {
      res.status = 404;
      res.set_content(
          Json{{"error", "no run '" + req.get_param_value("name") + "' under " + storage.string()}}
              .dump(),
          "application/json");
      return;
    }
    const Json details = is_experiment(*dir) ? experiment_details(*dir) : run_details(*dir);
    res.set_content(details.dump(), "application/json");
  });
  server.Get("/metrics", [storage](const httplib::Request&, httplib::Response& res) {
    res.set_content(prometheus_metrics(storage), "text/plain; version=0.0.4");
  });
  // On loopback only, a request must name a loopback host: a web page of another site that
  // points its own name at 127.0.0.1 (DNS rebinding) cannot read the runs through the browser.
  // Off loopback, it must carry the dashboard's token.
  const bool loopback =
      options.host == "127.0.0.1" || options.host == "localhost" || options.host == "::1";
  if (!loopback) {
    impl_->token = options.token.empty() ? comm::JobSecret::generate().text() : options.token;
    server.set_pre_routing_handler(
        [token = impl_->token](const httplib::Request& req, httplib::Response& res) {
          if (comm::constant_time_equal(cookie_of(req, kTokenCookie), token))
            return httplib::Server::HandlerResponse::Unhandled;
          if (comm::constant_time_equal(req.get_param_value("token"), token)) {
            // Once from the URL; the page's own requests then carry the cookie.
            res.set_header("Set-Cookie", std::string(kTokenCookie) + "=" + token +
                                             "; Path=/; HttpOnly; SameSite=Strict");
            return httplib::Server::HandlerResponse::Unhandled;
          }
          res.status = 401;
          res.set_content(
              "this dashboard asks for its token: open the address it printed when it started "
              "(it ends in ?token=...)\n",
              "text/plain");
          return httplib::Server::HandlerResponse::Handled;
        });
  } else {
    server.set_pre_routing_handler([](const httplib::Request& req, httplib::Response& res) {
      const std::string host = req.get_header_value("Host");
      const auto end = host.rfind(':');
      const std::string name =
          host.empty() || host.front() == '['
              ? host.substr(0, host.find(']') == std::string::npos ? 0 : host.find(']') + 1)
              : host.substr(0, end);
      if (name == "127.0.0.1" || name == "localhost" || name == "[::1]")
        return httplib::Server::HandlerResponse::Unhandled;
      res.status = 403;
      res.set_content(
          "this dashboard listens on loopback and answers only requests for "
          "localhost or 127.0.0.1, not for host '" +
              host.substr(0, 100) + "'\n",
          "text/plain");
      return httplib::Server::HandlerResponse::Handled;
    });
  }
  // httplib's default also sets SO_REUSEPORT, with which a second server binds a port in use
  // without an error; SO_REUSEADDR alone lets a restarted dashboard take its port back.
  server.set_socket_options([](int sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  });
  const std::string where = options.host + ":" + std::to_string(options.port);
  if (options.port < 0 || options.port > 65535) {
    throw UsageError("dashboard port " + std::to_string(options.port) +
                     " is out of range: give 1 to 65535, or 0 for a free one");
  }
  if (options.port == 0) {
    impl_->port = server.bind_to_any_port(options.host);
  } else {
    impl_->port = server.bind_to_port(options.host, options.port) ? options.port : -1;
  }
  if (impl_->port <= 0) {
    throw UsageError("the dashboard cannot listen on " + where +
                     ": the port is in use (another dashboard or program) or the address is not "
                     "this host's; give another port (e.g. --dashboard 8266, or 0 for a free one)");
  }
  impl_->thread = std::thread([this] {
    impl_->server.listen_after_bind();
    impl_->serving_ended = true;
  });
}

Dashboard::~Dashboard() {
  // httplib's stop() does nothing until the serving thread runs, which would then serve forever
  // and the join never return (a dashboard made and destroyed at once hung a test): stop it once
  // it runs. Serving starts at once; the deadline is for a thread the system never ran.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!impl_->serving_ended && std::chrono::steady_clock::now() < deadline) {
    if (impl_->server.is_running()) {
      impl_->server.stop();
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (impl_->thread.joinable()) impl_->thread.join();
}

int Dashboard::port() const { return impl_->port; }

std::string Dashboard::url() const {
  return "http://" + impl_->host + ":" + std::to_string(impl_->port) + "/" +
         (impl_->token.empty() ? "" : "?token=" + impl_->token);
}

}  // namespace cohort::train

#include "cohort/train/dashboard.h"

#include <gtest/gtest.h>
#include <httplib.h>

#include <fstream>

#include "cohort/error.h"
#include "support/expect.h"
#include "support/tiny_mnist.h"

namespace cohort::train {
namespace {

namespace fs = std::filesystem;

void write(const fs::path& file, const std::string& text) {
  fs::create_directories(file.parent_path());
  std::ofstream(file) << text;
}

TEST(Dashboard, PrometheusTextHasEveryRunsFiguresAndEachRanksStepTime) {
  const auto storage = testing::temp_dir("dashboard_metrics");
  write(storage / "a" / "metrics.jsonl",
        "{\"train_loss\": 0.5, \"samples_per_second\": 100, \"training_iteration\": 1}\n"
        "{\"train_loss\": 0.25, \"samples_per_second\": 120, \"comm_wait_ms\": 3.5, "
        "\"ingest_wait_ms\": 0.5, \"training_iteration\": 2}\n");
  write(storage / "a" / kStatusFile,
        "{\"state\": \"running\", \"updated\": " + std::to_string(std::time(nullptr)) +
            ", \"workers\": [{\"rank\": 0, \"step_time_ms\": 70}, {\"rank\": 1, "
            "\"step_time_ms\": 90, \"memory_mb\": 250}], \"failures\": [{\"restarted\": true}]}\n");
  write(storage / "b\"q" / "result.json", "{\"error\": \"boom\", \"failures\": []}\n");
  const std::string text = prometheus_metrics(storage);
  for (const char* line : {"# TYPE cohort_loss gauge\n", "cohort_loss{run=\"a\"} 0.25\n",
                           "cohort_samples_per_second{run=\"a\"} 120.0\n",
                           // Prometheus' base units: seconds, bytes.
                           "cohort_comm_wait_seconds{run=\"a\"} 0.0035\n",
                           "cohort_ingest_wait_seconds{run=\"a\"} 0.0005\n",
                           "cohort_training_iteration{run=\"a\"} 2.0\n",
                           "cohort_restarts{run=\"a\"} 1.0\n", "cohort_running{run=\"a\"} 1.0\n",
                           "cohort_rank_step_time_seconds{run=\"a\",rank=\"0\"} 0.07\n",
                           "cohort_rank_step_time_seconds{run=\"a\",rank=\"1\"} 0.09\n",
                           "cohort_rank_memory_bytes{run=\"a\",rank=\"1\"} 262144000.0\n",
                           // A label value is escaped; a failed run is not running.
                           "cohort_running{run=\"b\\\"q\"} 0.0\n"}) {
    EXPECT_NE(text.find(line), std::string::npos) << line << " missing from\n" << text;
  }
  fs::remove_all(storage);
}

// On loopback the dashboard answers only requests for a loopback host: a page of another site
// whose name resolves to 127.0.0.1 (DNS rebinding) gets 403, never the runs.
TEST(Dashboard, OnLoopbackOnlyALoopbackHostIsAnswered) {
  const auto storage = cohort::testing::temp_dir("dashboard_host");
  Dashboard dashboard(storage, {.host = "127.0.0.1", .port = 0});
  httplib::Client client("127.0.0.1", dashboard.port());
  client.set_connection_timeout(10);
  client.set_read_timeout(10);
  const std::string port = std::to_string(dashboard.port());
  for (const std::string& host :
       std::vector<std::string>{"127.0.0.1:" + port, "localhost:" + port, "localhost"}) {
    const auto res = client.Get("/api/runs", {{"Host", host}});
    ASSERT_TRUE(res) << host;
    EXPECT_EQ(res->status, 200) << host;
  }
  for (const std::string& host :
       std::vector<std::string>{"rebinding.example:" + port, "127.0.0.1.evil.example", ""}) {
    const auto res = client.Get("/api/runs", {{"Host", host}});
    ASSERT_TRUE(res) << host;
    EXPECT_EQ(res->status, 403) << "Host '" << host << "'";
    EXPECT_EQ(res->body.find("storage_path"), std::string::npos) << res->body;
  }
  fs::remove_all(storage);
}

// Off loopback, a request without the dashboard's token gets 401 and no run; the URL's token
// lets the browser in once and sets the cookie its next requests carry.
TEST(Dashboard, OffLoopbackEveryRequestCarriesTheToken) {
  const auto storage = cohort::testing::temp_dir("dashboard_token");
  Dashboard dashboard(storage, {.host = "0.0.0.0", .port = 0});
  const std::string url = dashboard.url();
  const auto at = url.find("?token=");
  ASSERT_NE(at, std::string::npos) << url;
  const std::string token = url.substr(at + 7);
  EXPECT_EQ(token.size(), 64u);
  httplib::Client client("127.0.0.1", dashboard.port());
  client.set_connection_timeout(10);
  client.set_read_timeout(10);
  for (const char* path : {"/api/runs", "/api/runs?token=wrong", "/metrics", "/"}) {
    const auto res = client.Get(path);
    ASSERT_TRUE(res) << path;
    EXPECT_EQ(res->status, 401) << path;
    EXPECT_EQ(res->body.find("storage_path"), std::string::npos) << res->body;
  }
  const auto first = client.Get("/api/runs?token=" + token);
  ASSERT_TRUE(first);
  EXPECT_EQ(first->status, 200);
  const std::string cookie = first->get_header_value("Set-Cookie");
  EXPECT_EQ(cookie.rfind("cohort_dashboard=" + token + ";", 0), 0u) << cookie;
  EXPECT_NE(cookie.find("HttpOnly"), std::string::npos) << cookie;
  const auto next = client.Get("/api/runs", {{"Cookie", "theme=dark; cohort_dashboard=" + token}});
  ASSERT_TRUE(next);
  EXPECT_EQ(next->status, 200);
  EXPECT_NE(next->body.find("storage_path"), std::string::npos);
  fs::remove_all(storage);
}

TEST(Dashboard, APortInUseIsRefusedNamingItAndTheFix) {
  const auto storage = testing::temp_dir("dashboard_port");
  Dashboard first(storage, {.port = 0});
  ASSERT_GT(first.port(), 0);
  EXPECT_EQ(first.url(), "http://127.0.0.1:" + std::to_string(first.port()) + "/");
  testing::expect_error<UsageError>(
      [&] { Dashboard second(storage, {.port = first.port()}); },
      "cannot listen on 127.0.0.1:" + std::to_string(first.port()) +
          ": the port is in use (another dashboard or program) or the address is not this "
          "host's; give another port");
  testing::expect_error<UsageError>([&] { Dashboard bad(storage, {.port = 70000}); },
                                    "dashboard port 70000 is out of range");
  fs::remove_all(storage);
}

// A dashboard destroyed right after it was made stops: httplib's stop() did nothing before its
// thread served, which then served forever (the destructor's join hung the sid lane once).
TEST(Dashboard, ADashboardDestroyedAtOnceStops) {
  const auto storage = testing::temp_dir("dashboard_at_once");
  for (int i = 0; i < 200; ++i) Dashboard dashboard(storage, {.port = 0});
  fs::remove_all(storage);
}

}  // namespace
}  // namespace cohort::train

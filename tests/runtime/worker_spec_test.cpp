#include "runtime/worker_spec.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include "cohort/error.h"
#include "cohort/runtime/process.h"
#include "support/expect.h"

namespace cohort::runtime {
namespace {

// A spec as this process's parent (the driver) would write it.
WorkerSpec spec_of_parent() {
  WorkerSpec spec;
  spec.build = program_build_id();
  spec.driver_pid = ::getppid();
  spec.run_token = "0123abcd";
  spec.slot = 1;
  spec.cpu_threads = 2;
  spec.heartbeat = {.interval = std::chrono::milliseconds(600), .timeout = std::chrono::seconds(3)};
  spec.gpus_per_worker = 1;
  spec.backend = "gloo";
  spec.umask = 027;
  spec.session = Json{{"config", {{"lr", 0.1}}}};
  return spec;
}

TEST(WorkerSpec, RoundTripsEverySettingAndHandsTheSessionOnAsItIs) {
  const WorkerSpec spec = spec_of_parent();
  const WorkerSpec read = worker_spec_from_text(to_text(spec));
  EXPECT_EQ(to_text(read), to_text(spec));
  EXPECT_EQ(read.run_token, "0123abcd");
  EXPECT_EQ(read.slot, 1);
  EXPECT_EQ(read.cpu_threads, 2);
  EXPECT_EQ(read.heartbeat.timeout, std::chrono::seconds(3));
  EXPECT_EQ(read.setup_timeout, kDefaultSetupTimeout);
  EXPECT_EQ(read.backend, "gloo");
  EXPECT_EQ(read.umask, 027);
  EXPECT_EQ(read.session["config"]["lr"], 0.1);
}

TEST(WorkerSpec, ASpecOfAnotherBuildOrRunIsRefusedNamingTheValue) {
  WorkerSpec spec = spec_of_parent();
  spec.build = "feedface";
  cohort::testing::expect_error<UsageError>([&] { worker_spec_from_text(to_text(spec)); },
                                            "worker spec: build feedface is not this program's");
  spec = spec_of_parent();
  spec.driver_pid = ::getppid() + 100000;
  cohort::testing::expect_error<UsageError>(
      [&] { worker_spec_from_text(to_text(spec)); },
      "driver_pid " + std::to_string(::getppid() + 100000) + " is not this process's parent");
}

TEST(WorkerSpec, MalformedFieldsAreNamed) {
  const Json good = Json::parse(to_text(spec_of_parent()));
  const auto refused = [&](const char* key, const Json& value, const std::string& message) {
    Json spec = good;
    spec[key] = value;
    cohort::testing::expect_error<UsageError>([&] { worker_spec_from_text(spec.dump()); }, message);
  };
  refused("heartbeat_timeout_ms", 0, "heartbeat timeout 0 ms");
  refused("cpu_threads", "two", "field 'cpu_threads' is string \"two\", not an integer");
  // Found by the fuzz target: a number past the integer's range was narrowed (undefined for a
  // float), not refused.
  refused("setup_timeout_ms", 1.7e26,
          "worker spec: field 'setup_timeout_ms' is number 1.7e+26, not an integer");
  refused("setup_timeout_ms", 9223372036854775808ull,
          "worker spec: field 'setup_timeout_ms' is number 9223372036854775808, not an integer "
          "in range");
  refused("slot", -1, "worker spec: slot = -1: it must be >= 0");
  refused("umask", 01000, "worker spec: umask = 512: it must be between 0 and 0777");
  refused("format", 7, "worker spec: format 7");
  refused("session", Json::array(), "worker spec: field 'session' is not a JSON object");
  Json spec = good;
  spec.erase("cpu_threads");
  cohort::testing::expect_error<UsageError>([&] { worker_spec_from_text(spec.dump()); },
                                            "worker spec: field 'cpu_threads' is missing");
  cohort::testing::expect_error<UsageError>([] { worker_spec_from_text("{not json"); },
                                            "is not JSON");
  cohort::testing::expect_error<UsageError>([] { worker_spec_from_text("[1]"); },
                                            "COHORT_WORKER_SPEC is not a JSON object");
}

}  // namespace
}  // namespace cohort::runtime

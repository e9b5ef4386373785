#include "train/worker_spec.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include "cohort/error.h"
#include "cohort/runtime/process.h"
#include "support/expect.h"

namespace cohort::train {
namespace {

// A spec as this process's parent (the driver) would write it.
WorkerSpec spec_from_parent() {
  WorkerSpec spec;
  spec.build = runtime::program_build_id();
  spec.driver_pid = ::getppid();
  spec.run_token = "0123abcd";
  spec.config = Json{{"lr", 0.1}};
  spec.name = "run";
  spec.run_dir = "/tmp/run";
  spec.run_start_ns = 42;
  spec.cpu_threads = 2;
  spec.heartbeat = {.interval = std::chrono::milliseconds(600), .timeout = std::chrono::seconds(3)};
  spec.resume_from = "/tmp/run/checkpoint_000001";
  spec.next_checkpoint_index = 2;
  spec.slot = 1;
  spec.scaling = {.mesh = {.pp = 2, .tp = 1},
                  .precision = "bf16",
                  .loss_scaler = {.initial_scale = 128},
                  .num_parameter_servers = 1,
                  .remote_preprocessing_dataset = "images"};
  return spec;
}

TEST(WorkerSpec, RoundTripsEverySetting) {
  const WorkerSpec spec = spec_from_parent();
  const WorkerSpec read = worker_spec_from_text(to_text(spec));
  EXPECT_EQ(to_text(read), to_text(spec));
  EXPECT_EQ(read.config["lr"], 0.1);
  EXPECT_EQ(read.heartbeat.timeout, std::chrono::seconds(3));
  EXPECT_EQ(read.setup_timeout, kDefaultSetupTimeout);
  EXPECT_EQ(read.slot, 1);
  // The driver's ScalingConfig, which the worker's session takes instead of its program's own.
  EXPECT_EQ(read.scaling.mesh.pp, 2);
  EXPECT_EQ(read.scaling.precision, "bf16");
  EXPECT_EQ(read.scaling.loss_scaler, spec.scaling.loss_scaler);
  EXPECT_EQ(read.scaling.num_parameter_servers, 1);
  EXPECT_EQ(read.scaling.remote_preprocessing_dataset, "images");
}

TEST(WorkerSpec, ASpecOfAnotherBuildOrRunIsRefusedNamingTheValue) {
  WorkerSpec spec = spec_from_parent();
  spec.build = "feedface";
  cohort::testing::expect_error<UsageError>([&] { worker_spec_from_text(to_text(spec)); },
                                            "worker spec: build feedface is not this program's");
  spec = spec_from_parent();
  spec.driver_pid = ::getppid() + 100000;
  cohort::testing::expect_error<UsageError>(
      [&] { worker_spec_from_text(to_text(spec)); },
      "driver_pid " + std::to_string(::getppid() + 100000) + " is not this process's parent");
}

TEST(WorkerSpec, MalformedFieldsAreNamed) {
  Json spec = Json::parse(to_text(spec_from_parent()));
  spec["heartbeat_timeout_ms"] = 0;
  cohort::testing::expect_error<UsageError>([&] { worker_spec_from_text(spec.dump()); },
                                            "heartbeat timeout 0 ms");
  spec = Json::parse(to_text(spec_from_parent()));
  spec["cpu_threads"] = "two";
  cohort::testing::expect_error<UsageError>(
      [&] { worker_spec_from_text(spec.dump()); },
      "field 'cpu_threads' is string \"two\", not an integer");
  // Found by the fuzz target: a number past the integer's range was narrowed (undefined for a
  // float), not refused.
  spec["cpu_threads"] = 2;
  spec["run_start_ns"] = 1.7e26;
  cohort::testing::expect_error<UsageError>(
      [&] { worker_spec_from_text(spec.dump()); },
      "worker spec: field 'run_start_ns' is number 1.7e+26, not an integer");
  spec["run_start_ns"] = 9223372036854775808ull;
  cohort::testing::expect_error<UsageError>(
      [&] { worker_spec_from_text(spec.dump()); },
      "worker spec: field 'run_start_ns' is number 9223372036854775808, not an integer in range");
  spec["run_start_ns"] = 1;
  spec.erase("cpu_threads");
  cohort::testing::expect_error<UsageError>([&] { worker_spec_from_text(spec.dump()); },
                                            "field 'cpu_threads' is missing");
  cohort::testing::expect_error<UsageError>([] { worker_spec_from_text("{not json"); },
                                            "is not JSON");
  spec = Json::parse(to_text(spec_from_parent()));
  spec["mesh_tp"] = 0;
  cohort::testing::expect_error<UsageError>([&] { worker_spec_from_text(spec.dump()); },
                                            "worker spec: mesh_pp = 2, mesh_tp = 0");
  spec = Json::parse(to_text(spec_from_parent()));
  spec["loss_scaler"]["hysteresis"] = "two";
  cohort::testing::expect_error<UsageError>([&] { worker_spec_from_text(spec.dump()); },
                                            "'hysteresis'");
  // Found by the fuzz target tests/fuzz/worker_spec: values the session would refuse, or take
  // as they are, are refused here with the rest.
  spec = Json::parse(to_text(spec_from_parent()));
  spec["loss_scaler"]["growth_factor"] = 1;
  cohort::testing::expect_error<UsageError>([&] { worker_spec_from_text(spec.dump()); },
                                            "worker spec: loss scaler growth_factor 1 must be > 1");
  spec = Json::parse(to_text(spec_from_parent()));
  spec["precision"] = "fp8";
  cohort::testing::expect_error<UsageError>([&] { worker_spec_from_text(spec.dump()); },
                                            "worker spec: unknown precision 'fp8'");
  spec = Json::parse(to_text(spec_from_parent()));
  spec["profile_last"] = spec["profile_first"].get<int64_t>() - 1;
  cohort::testing::expect_error<UsageError>([&] { worker_spec_from_text(spec.dump()); },
                                            "worker spec: profile_last = ");
  spec = Json::parse(to_text(spec_from_parent()));
  spec["slot"] = -1;
  cohort::testing::expect_error<UsageError>([&] { worker_spec_from_text(spec.dump()); },
                                            "worker spec: slot = -1: it must be >= 0");
  spec = Json::parse(to_text(spec_from_parent()));
  spec["format"] = 7;
  cohort::testing::expect_error<UsageError>([&] { worker_spec_from_text(spec.dump()); },
                                            "worker spec: format 7");
}

}  // namespace
}  // namespace cohort::train

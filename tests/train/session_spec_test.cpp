#include "train/session_spec.h"

#include <gtest/gtest.h>

#include "cohort/error.h"
#include "support/expect.h"

namespace cohort::train {
namespace {

SessionSpec session_of_driver() {
  SessionSpec spec;
  spec.config = Json{{"lr", 0.1}};
  spec.name = "run";
  spec.run_dir = "/tmp/run";
  spec.run_start_ns = 42;
  spec.resume_from = "/tmp/run/checkpoint_000001";
  spec.live_recovery = true;
  spec.live_round = 2;
  spec.live_source = 1;
  spec.next_checkpoint_index = 2;
  spec.profile_first = 3;
  spec.profile_last = 5;
  spec.scaling = {.mesh = {.pp = 2, .tp = 1},
                  .precision = "bf16",
                  .loss_scaler = {.initial_scale = 128},
                  .num_parameter_servers = 1,
                  .remote_preprocessing_dataset = "images"};
  return spec;
}

TEST(SessionSpec, RoundTripsEverySetting) {
  const SessionSpec spec = session_of_driver();
  const SessionSpec read = session_spec_from_json(to_json(spec));
  EXPECT_EQ(to_json(read), to_json(spec));
  EXPECT_EQ(read.config["lr"], 0.1);
  EXPECT_EQ(read.live_round, 2);
  EXPECT_EQ(read.profile_last, 5);
  // The driver's ScalingConfig, which the worker's session takes instead of its program's own.
  EXPECT_EQ(read.scaling.mesh.pp, 2);
  EXPECT_EQ(read.scaling.precision, "bf16");
  EXPECT_EQ(read.scaling.loss_scaler, spec.scaling.loss_scaler);
  EXPECT_EQ(read.scaling.num_parameter_servers, 1);
  EXPECT_EQ(read.scaling.remote_preprocessing_dataset, "images");
}

TEST(SessionSpec, MalformedFieldsAreNamed) {
  const Json good = to_json(session_of_driver());
  const auto refused = [&](const Json& spec, const std::string& message) {
    cohort::testing::expect_error<UsageError>([&] { session_spec_from_json(spec); }, message);
  };
  Json spec = good;
  spec["run_start_ns"] = 1.7e26;
  refused(spec, "worker spec: session: field 'run_start_ns' is number 1.7e+26, not an integer");
  spec = good;
  spec["mesh_tp"] = 0;
  refused(spec, "worker spec: session: mesh_pp = 2, mesh_tp = 0");
  spec = good;
  spec["loss_scaler"]["hysteresis"] = "two";
  refused(spec, "'hysteresis'");
  // Found by the fuzz target tests/fuzz/worker_spec: values the session would refuse, or take
  // as they are, are refused here with the rest.
  spec = good;
  spec["loss_scaler"]["growth_factor"] = 1;
  refused(spec, "worker spec: session: loss scaler growth_factor 1 must be > 1");
  spec = good;
  spec["precision"] = "fp8";
  refused(spec, "worker spec: session: unknown precision 'fp8'");
  spec = good;
  spec["profile_last"] = 2;
  refused(spec, "worker spec: session: profile_last = 2: it must be >= 3");
  spec = good;
  spec.erase("resume");
  refused(spec, "worker spec: session: field 'resume' is missing");
  spec = good;
  spec["live_round"] = -1;
  refused(spec, "worker spec: session: live_round = -1: it must be >= 0");
}

}  // namespace
}  // namespace cohort::train

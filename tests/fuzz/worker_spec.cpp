// Fuzz target: the worker spec (COHORT_WORKER_SPEC), which the local driver hands every worker it
// starts and which the worker reads and checks in one place (train::worker_spec_from_text). A
// JSON object of the input gets this program's build and parent pid, so that the fields past
// those checks are reached; other input is read as it is. A spec may be refused with a
// UsageError; nothing else may escape. A spec that is taken holds values its session can use (a
// precision and loss scaling that their own checks accept) and reads back from its text as the
// same spec.
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <string>

#include "cohort/error.h"
#include "cohort/json.h"
#include "cohort/optim/precision.h"
#include "cohort/runtime/process.h"
#include "train/worker_spec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string text(reinterpret_cast<const char*>(data), size);
  cohort::Json object = cohort::Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (object.is_object()) {
    object["build"] = cohort::runtime::program_build_id();
    object["driver_pid"] = ::getppid();
    text = object.dump();
  }
  cohort::train::WorkerSpec spec;
  try {
    spec = cohort::train::worker_spec_from_text(text);
  } catch (const cohort::UsageError&) {
    return 0;
  }
  try {
    (void)cohort::optim::precision_from_string(spec.scaling.precision);
    spec.scaling.loss_scaler.validate();
  } catch (const cohort::UsageError& e) {
    std::cerr << "taken, then refused by the session: " << e.what() << "\n";
    std::abort();
  }
  const std::string sent = cohort::train::to_text(spec);
  cohort::train::WorkerSpec again;
  try {
    again = cohort::train::worker_spec_from_text(sent);
  } catch (const cohort::UsageError& e) {
    std::cerr << "its own text refused: " << e.what() << "\n";
    std::abort();
  }
  if (cohort::train::to_text(again) != sent) std::abort();
  return 0;
}

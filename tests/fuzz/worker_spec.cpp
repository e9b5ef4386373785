// Fuzz target: the worker spec (COHORT_WORKER_SPEC), which the local driver hands every worker it
// starts and which the worker reads and checks in two places: the process's settings in
// runtime::worker_spec_from_text, then its session's in train::session_spec_from_json. A JSON
// object of the input gets this program's build and parent pid, so that the fields past those
// checks are reached; other input is read as it is. A spec may be refused with a UsageError;
// nothing else may escape. A spec that is taken holds values its session can use (a precision and
// loss scaling that their own checks accept) and reads back from its text as the same spec.
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <string>

#include "cohort/error.h"
#include "cohort/json.h"
#include "cohort/optim/precision.h"
#include "cohort/runtime/process.h"
#include "runtime/worker_spec.h"
#include "train/session_spec.h"

namespace {

// The spec read and written again as this program writes it; `taken` false (and no text) when it
// is refused.
std::string read_back(const std::string& text, bool* taken) {
  *taken = false;
  cohort::runtime::WorkerSpec spec;
  cohort::train::SessionSpec session;
  try {
    spec = cohort::runtime::worker_spec_from_text(text);
    session = cohort::train::session_spec_from_json(spec.session);
  } catch (const cohort::UsageError&) {
    return "";
  }
  *taken = true;
  try {
    (void)cohort::optim::precision_from_string(session.scaling.precision);
    session.scaling.loss_scaler.validate();
  } catch (const cohort::UsageError& e) {
    std::cerr << "taken, then refused by the session: " << e.what() << "\n";
    std::abort();
  }
  spec.session = cohort::train::to_json(session);
  return cohort::runtime::to_text(spec);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string text(reinterpret_cast<const char*>(data), size);
  cohort::Json object = cohort::Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (object.is_object()) {
    object["build"] = cohort::runtime::program_build_id();
    object["driver_pid"] = ::getppid();
    text = object.dump();
  }
  bool taken = false;
  const std::string sent = read_back(text, &taken);
  if (!taken) return 0;
  bool again = false;
  if (read_back(sent, &again) != sent || !again) {
    std::cerr << "its own text refused or read otherwise: " << sent << "\n";
    std::abort();
  }
  return 0;
}

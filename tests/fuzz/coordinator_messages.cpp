// Fuzz target: the coordinator's messages (runtime::Coordinator), one JSON line per message from
// ranks of a group of 4, in turn, with the heartbeat statuses its stall report reads. A line may
// be refused (not JSON, a field of the wrong type), never crash the coordinator or change its
// judgement without naming a rank of the group.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "cohort/error.h"
#include "cohort/runtime/coordinator.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace cohort::runtime;
  const std::string input(reinterpret_cast<const char*>(data), size);
  SteadyTime now{};
  Coordinator coordinator(4,
                          {.interval = std::chrono::seconds(1), .timeout = std::chrono::seconds(3)},
                          [&now] { return now; });
  size_t start = 0;
  for (int line = 0; start <= input.size(); ++line) {
    size_t end = input.find('\n', start);
    if (end == std::string::npos) end = input.size();
    try {
      coordinator.on_message(line % 4, cohort::Json::parse(input.substr(start, end - start)));
    } catch (const cohort::Json::exception&) {
    } catch (const cohort::UsageError&) {
    }
    now += std::chrono::milliseconds(700);
    start = end + 1;
  }
  (void)coordinator.stall_report();
  if (const auto verdict = coordinator.verdict()) {
    if (verdict->rank < 0 || verdict->rank >= 4 || verdict->reason.empty()) std::abort();
  }
  return 0;
}

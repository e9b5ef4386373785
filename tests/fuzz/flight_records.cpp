// Fuzz target: the ranks' flight recorder files as the driver reads them back
// (comm::flight_divergence), one JSON document per line, one line per rank. A rank that failed
// may have written anything: a malformed record is read as none, never ends the reader, and the
// report names only ranks and groups the records gave.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "cohort/comm/flight_recorder.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  std::vector<cohort::Json> records;
  size_t start = 0;
  while (start <= input.size() && records.size() < 64) {
    size_t end = input.find('\n', start);
    if (end == std::string::npos) end = input.size();
    records.push_back(cohort::Json::parse(input.substr(start, end - start), nullptr,
                                          /*allow_exceptions=*/false));
    if (records.back().is_discarded()) records.back() = nullptr;
    start = end + 1;
  }
  const std::string report = cohort::comm::flight_divergence(records);
  if (!report.empty() && report.rfind("group ", 0) != 0) std::abort();
  return 0;
}

// Each rank's flight recorder (comm/flight_recorder.h) written into the run directory when a
// failure stops the group, and what the ranks' records say together.
#pragma once
#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include "cohort/comm/process_group.h"
#include "cohort/runtime/coordinator.h"

namespace cohort::train {

// Where each rank's records go: <run>/flight/rank-R.json.
inline constexpr const char* kFlightDir = "flight";
std::filesystem::path flight_records_path(const std::filesystem::path& run_dir, int rank);

// From now on `group`'s flight recorder (with this process's control messages) is written to
// flight_records_path(run_dir, rank) when the driver or the coordinator asks for it before it
// stops the group, or when runtime::dump_flight_recorder() is called.
void record_flights(const comm::ProcessGroup& group, const std::filesystem::path& run_dir,
                    int rank);

// How long the ranks are given to write their records once asked: their heartbeat threads write
// them, within an interval.
inline std::chrono::milliseconds flight_dump_grace(const runtime::HeartbeatOptions& heartbeat) {
  return 2 * heartbeat.interval + std::chrono::seconds(1);
}

// Whether each of `ranks` wrote its records since `since`.
bool flight_records_written(const std::filesystem::path& run_dir, const std::vector<int>& ranks,
                            std::filesystem::file_time_type since);

// What the records of ranks [0, world_size) written since `since` say: "flight recorder
// (<run>/flight): " and the first operations where the ranks diverge (comm::flight_divergence),
// naming the ranks that wrote none. "" when no rank wrote records since then.
std::string flight_report(const std::filesystem::path& run_dir, int world_size,
                          std::filesystem::file_time_type since);
// flight_report() once every rank wrote its records since `since`, or `within` passed.
std::string flight_report_once_written(const std::filesystem::path& run_dir, int world_size,
                                       std::filesystem::file_time_type since,
                                       std::chrono::milliseconds within);

}  // namespace cohort::train

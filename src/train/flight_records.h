// Each rank's flight recorder (comm/flight_recorder.h) written into the run directory when a
// failure stops the group, and what the ranks' records say together.
#pragma once
#include <filesystem>
#include <string>
#include <vector>

#include "cohort/comm/process_group.h"

namespace cohort::train {

// Where each rank's records go: <run>/flight/rank-R.json.
inline constexpr const char* kFlightDir = "flight";
std::filesystem::path flight_records_path(const std::filesystem::path& run_dir, int rank);

// From now on `group`'s flight recorder (with this process's control messages) is written to
// flight_records_path(run_dir, rank) when the driver or the coordinator asks for it before it
// stops the group, or when dump_flight_records() is called.
void record_flights(const comm::ProcessGroup& group, const std::filesystem::path& run_dir,
                    int rank);
// Writes this rank's records now, saying why (after a collective of its own failed).
void dump_flight_records(const std::string& reason);

// Whether each of `ranks` wrote its records since `since`.
bool flight_records_written(const std::filesystem::path& run_dir, const std::vector<int>& ranks,
                            std::filesystem::file_time_type since);

// What the records of ranks [0, world_size) written since `since` say: "flight recorder
// (<run>/flight): " and the first operations where the ranks diverge (comm::flight_divergence),
// naming the ranks that wrote none. "" when no rank wrote records since then.
std::string flight_report(const std::filesystem::path& run_dir, int world_size,
                          std::filesystem::file_time_type since);

}  // namespace cohort::train

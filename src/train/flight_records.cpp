#include "train/flight_records.h"

#include <poll.h>

#include <fstream>
#include <numeric>
#include <vector>

#include "cohort/json.h"
#include "cohort/runtime/control_channel.h"
#include "train/run_files.h"

namespace cohort::train {

std::filesystem::path flight_records_path(const std::filesystem::path& run_dir, int rank) {
  return run_dir / kFlightDir / ("rank-" + std::to_string(rank) + ".json");
}

void record_flights(const comm::ProcessGroup& group, const std::filesystem::path& run_dir,
                    int rank) {
  const auto recorder = group.flight_recorder();
  if (!recorder) return;
  const auto file = flight_records_path(run_dir, rank);
  runtime::set_flight_recorder(recorder, [recorder, file, rank](const std::string& reason) {
    std::filesystem::create_directories(file.parent_path());
    write_atomically(file, recorder->to_json(rank, reason).dump(1));
  });
}

namespace {

bool written_since(const std::filesystem::path& file, std::filesystem::file_time_type since) {
  std::error_code error;
  const auto written = std::filesystem::last_write_time(file, error);
  return !error && written >= since;
}

}  // namespace

bool flight_records_written(const std::filesystem::path& run_dir, const std::vector<int>& ranks,
                            std::filesystem::file_time_type since) {
  for (int rank : ranks) {
    if (!written_since(flight_records_path(run_dir, rank), since)) return false;
  }
  return true;
}

std::string flight_report(const std::filesystem::path& run_dir, int world_size,
                          std::filesystem::file_time_type since) {
  std::vector<Json> records(static_cast<size_t>(world_size));
  std::string missing;
  int found = 0;
  for (int rank = 0; rank < world_size; ++rank) {
    const auto file = flight_records_path(run_dir, rank);
    if (written_since(file, since)) {
      std::ifstream in(file);
      records[static_cast<size_t>(rank)] = Json::parse(in, nullptr, /*allow_exceptions=*/false);
      if (!records[static_cast<size_t>(rank)].is_discarded()) {
        ++found;
        continue;
      }
      records[static_cast<size_t>(rank)] = nullptr;
    }
    missing += (missing.empty() ? "" : ", ") + std::to_string(rank);
  }
  if (found == 0) return "";
  const std::string divergence = comm::flight_divergence(records);
  std::string says = divergence;
  if (says.empty()) {
    says = missing.empty() ? "the ranks' records agree"
                           : "ranks [" + missing + "] wrote none (stopped, or gone before asked)";
  }
  return "flight recorder (" + (run_dir / kFlightDir).string() + "): " + says;
}

std::string flight_report_once_written(const std::filesystem::path& run_dir, int world_size,
                                       std::filesystem::file_time_type since,
                                       std::chrono::milliseconds within) {
  std::vector<int> ranks(static_cast<size_t>(world_size));
  std::iota(ranks.begin(), ranks.end(), 0);
  const auto deadline = std::chrono::steady_clock::now() + within;
  while (std::chrono::steady_clock::now() < deadline &&
         !flight_records_written(run_dir, ranks, since)) {
    ::poll(nullptr, 0, 50);
  }
  return flight_report(run_dir, world_size, since);
}

}  // namespace cohort::train

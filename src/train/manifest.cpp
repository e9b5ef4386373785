#include "train/manifest.h"

#include <algorithm>
#include <filesystem>
#include <limits>
#include <numeric>

#include "cohort/error.h"

namespace cohort::train::detail {
namespace {

// What the first release wrote for ZeRO's shards (name "zero"): the same files, the values at
// the top of the manifest.
constexpr const char* kZeroFormat = "cohort.zero.v1";

// A name as an error shows it: cut, so that a manifest cannot fill the log.
std::string shown(const std::string& text) {
  return text.size() <= 80 ? text : text.substr(0, 80) + "...";
}

}  // namespace

bool names_file_inside(const std::string& relative) {
  if (relative.empty() || relative.find('\0') != std::string::npos) return false;
  const std::filesystem::path name(relative);
  if (!name.is_relative()) return false;
  for (const auto& part : name) {
    if (part == "..") return false;
  }
  return true;
}

std::vector<ManifestEntry> read_manifest_entries(const Json& manifest, const std::string& where) {
  const auto damaged = [&](const std::string& why) {
    return UsageError(where + " " + why +
                      ": it was altered or damaged; resume from another checkpoint");
  };
  if (!manifest.is_object() || !manifest.contains("files") || !manifest["files"].is_object())
    throw damaged("lists no files (no object \"files\")");
  std::vector<ManifestEntry> entries;
  for (const auto& [name, info] : manifest["files"].items()) {
    // A name inside the folder: the manifest names what was written there.
    if (!names_file_inside(name))
      throw damaged("names '" + shown(name) + "', which is no file inside the checkpoint");
    if (!info.is_object() || !info.contains("size") || !info["size"].is_number_integer() ||
        (!info["size"].is_number_unsigned() && info["size"].get<int64_t>() < 0) ||
        !info.contains("crc32") || !info["crc32"].is_string()) {
      throw damaged("describes " + shown(name) + " without a size (an integer >= 0) and a crc32");
    }
    entries.push_back({name, info["size"].get<uint64_t>(), info["crc32"].get<std::string>()});
  }
  return entries;
}

StateManifest read_state_manifest(const Json& manifest, const std::string& name,
                                  const std::string& where) {
  const auto altered = [&](const std::string& why) {
    return UsageError(where + " " + why + ": it was altered or written by another program");
  };
  const auto format =
      manifest.is_object() && manifest.contains("format") && manifest["format"].is_string()
          ? manifest["format"].get<std::string>()
          : std::string();
  if (format != kStateFormat && !(name == "zero" && format == kZeroFormat))
    throw altered(std::string("is not a manifest of format ") + kStateFormat);
  StateManifest out;
  if (format == kStateFormat) {
    if (manifest.contains("values")) out.values = manifest["values"];
  } else {
    out.values = manifest;
  }
  if (!out.values.is_object()) throw altered("holds values that are no object");
  if (!manifest.contains("files") || !manifest["files"].is_array()) throw altered("lists no files");
  for (const auto& file : manifest["files"]) {
    if (!file.is_string() || !names_file_inside(file.get<std::string>()))
      throw altered("names " + shown(file.dump()) + ", which is no file inside the checkpoint");
    out.files.push_back(file.get<std::string>());
  }
  return out;
}

std::string piece_name(const std::string& tensor, int64_t offset) {
  return tensor + "/" + std::to_string(offset);
}

std::optional<PieceName> parse_piece_name(const std::string& name) {
  const auto slash = name.rfind('/');
  if (slash == std::string::npos) return std::nullopt;
  const auto digits = name.substr(slash + 1);
  // As piece_name writes it: decimal digits, without leading zeros.
  if (digits.empty() || digits.size() > 19 || (digits.size() > 1 && digits[0] == '0') ||
      !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return std::nullopt;
  }
  // 19 digits may pass int64_t's maximum (9223372036854775807).
  const auto value = std::stoull(digits);
  if (value > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
  return PieceName{name.substr(0, slash), static_cast<int64_t>(value)};
}

std::vector<PieceRead> plan_piece_reads(const std::vector<PieceRange>& pieces, int64_t begin,
                                        int64_t length) {
  constexpr auto kMax = std::numeric_limits<int64_t>::max();
  const auto in_a_tensor = [](int64_t first, int64_t count) {
    return first >= 0 && count >= 0 && first <= kMax - count;
  };
  if (!in_a_tensor(begin, length)) {
    throw UsageError("the elements [" + std::to_string(begin) + ", +" + std::to_string(length) +
                     ") are no range of a tensor");
  }
  std::vector<size_t> order(pieces.size());
  std::iota(order.begin(), order.end(), size_t{0});
  for (const auto& p : pieces) {
    if (!in_a_tensor(p.begin, p.length)) {
      throw UsageError("a piece of " + std::to_string(p.length) + " elements at " +
                       std::to_string(p.begin) + " is no range of a tensor");
    }
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return pieces[a].begin < pieces[b].begin; });
  // Each element from the first piece (in order of their starts) that holds it.
  std::vector<PieceRead> reads;
  int64_t next = begin;
  const int64_t end = begin + length;
  for (const size_t i : order) {
    const auto& p = pieces[i];
    const int64_t start = std::max(next, p.begin);
    const int64_t stop = std::min(end, p.begin + p.length);
    if (start >= stop) continue;
    reads.push_back({i, start, stop});
    next = stop;
  }
  return reads;
}

}  // namespace cohort::train::detail

// Fuzz target: a checkpoint's manifests (src/train/manifest.h) as a resumed run reads them from a
// folder that may have been altered: line 1 is a manifest.json, line 2 a part's manifest, line 3
// the range of a tensor to load ("BEGIN LENGTH"), and every further line a piece in a shard file
// ("<tensor>/<first element> LENGTH"). A manifest may be refused, never crash the reader; one it
// accepts names only files inside the folder; the reads planned for the range from the pieces of
// tensor "w" are disjoint, in order, inside their pieces and the range, and cover exactly the
// range's elements that some piece holds (counted element by element on short ranges).
#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "cohort/error.h"
#include "train/manifest.h"

namespace {

using namespace cohort::train::detail;

void check_inside(const std::string& name) {
  if (name.empty() || name[0] == '/' || name == ".." || name.rfind("../", 0) == 0 ||
      name.find("/../") != std::string::npos ||
      (name.size() >= 3 && name.compare(name.size() - 3, 3, "/..") == 0)) {
    std::abort();
  }
}

void check_reads(const std::vector<PieceRange>& pieces, int64_t begin, int64_t length) {
  std::vector<PieceRead> reads;
  try {
    reads = plan_piece_reads(pieces, begin, length);
  } catch (const cohort::UsageError&) {
    return;  // a piece or the range outside a tensor's elements
  }
  int64_t previous = begin, covered = 0;
  for (const auto& r : reads) {
    if (r.piece >= pieces.size() || r.begin < previous || r.end <= r.begin) std::abort();
    const auto& p = pieces[r.piece];
    if (r.begin < p.begin || r.end - p.begin > p.length || r.end - begin > length) std::abort();
    previous = r.end;
    covered += r.end - r.begin;
  }
  if (length > 4096) return;
  int64_t held = 0;
  for (int64_t e = begin; e < begin + length; ++e) {
    for (const auto& p : pieces) {
      if (e >= p.begin && e - p.begin < p.length) {
        ++held;
        break;
      }
    }
  }
  if (held != covered) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::istringstream input(std::string(reinterpret_cast<const char*>(data), size));
  std::string line;
  std::vector<std::string> lines;
  while (std::getline(input, line)) lines.push_back(line);
  lines.resize(std::max<size_t>(lines.size(), 3));
  const auto parse = [](const std::string& text) {
    return cohort::Json::parse(text, nullptr, /*allow_exceptions=*/false);
  };
  try {
    for (const auto& entry : read_manifest_entries(parse(lines[0]), "manifest.json")) {
      check_inside(entry.name);
    }
  } catch (const cohort::UsageError&) {
  }
  for (const char* name : {"zero", "optimizer"}) {
    try {
      const auto manifest = read_state_manifest(parse(lines[1]), name, "zero_manifest.json");
      if (!manifest.values.is_object()) std::abort();
      for (const auto& file : manifest.files) check_inside(file);
    } catch (const cohort::UsageError&) {
    }
  }
  std::vector<PieceRange> pieces;
  for (size_t i = 3; i < lines.size() && pieces.size() < 64; ++i) {
    const auto space = lines[i].rfind(' ');
    const auto piece = parse_piece_name(lines[i].substr(0, space));
    if (!piece) continue;
    if (piece->offset < 0 || piece_name(piece->tensor, piece->offset) != lines[i].substr(0, space))
      std::abort();
    if (piece->tensor != "w") continue;
    int64_t length = 0;
    if (space != std::string::npos) std::istringstream(lines[i].substr(space + 1)) >> length;
    pieces.push_back({piece->offset, length});
  }
  int64_t begin = 0, length = 0;
  std::istringstream(lines[2]) >> begin >> length;
  check_reads(pieces, begin, length);
  return 0;
}

// A checkpoint's manifests as data, read from files a checkpoint folder holds (which another
// program, a damaged disk or a hand may have changed): the folder's manifest.json (each file's
// size and checksum) and a part's "<name>_manifest.json" (its format, values and shard files),
// the names of the pieces in its shard files ("<tensor>/<first element>"), and which ranges of
// which pieces a read of a tensor's range takes. Every field is type- and range-checked and every
// file name stays inside the folder; an error is a UsageError that names `where` (the manifest)
// and the field. Without libtorch's tensors: the fuzz target checkpoint_manifests decodes them.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cohort/json.h"

namespace cohort::train::detail {

// The format a part's manifest and its shard files are written in.
inline constexpr const char* kStateFormat = "cohort.state.v1";

// Whether `relative` names a file inside a folder: not empty, relative, with no "..".
bool names_file_inside(const std::string& relative);

// One file that manifest.json describes.
struct ManifestEntry {
  std::string name;  // relative to the checkpoint folder, inside it
  uint64_t size = 0;
  std::string crc32;  // as hex
};
// manifest.json's "files"; UsageError "<where> <why>: it was altered or damaged; ...".
std::vector<ManifestEntry> read_manifest_entries(const Json& manifest, const std::string& where);

// A part's manifest: its values (an object) and its shard files (inside the folder).
struct StateManifest {
  Json values = Json::object();
  std::vector<std::string> files;
};
// The manifest of part `name` (format kStateFormat; for "zero" also the first release's, whose
// values are the manifest's top level).
StateManifest read_state_manifest(const Json& manifest, const std::string& name,
                                  const std::string& where);

// "<tensor>/<first element>": a piece's name in a shard file.
std::string piece_name(const std::string& tensor, int64_t offset);
// A piece's tensor and first element, or none for a name that is no piece's (no '/', or what
// follows the last '/' is not a count that fits int64_t, as piece_name writes it).
struct PieceName {
  std::string tensor;
  int64_t offset = 0;
};
std::optional<PieceName> parse_piece_name(const std::string& name);

// A piece of a tensor: `length` elements from element `begin`.
struct PieceRange {
  int64_t begin = 0, length = 0;
};
// Elements [begin, end) of the tensor, read from piece `piece`.
struct PieceRead {
  size_t piece = 0;
  int64_t begin = 0, end = 0;
};
// The reads that fill elements [begin, begin + length) from `pieces` (in any order, possibly
// overlapping): disjoint, in order, each inside its piece and the range. They cover the range
// when their lengths add up to `length`. UsageError when a piece or the range does not lie in a
// tensor's elements (negative, or past int64_t).
std::vector<PieceRead> plan_piece_reads(const std::vector<PieceRange>& pieces, int64_t begin,
                                        int64_t length);

}  // namespace cohort::train::detail

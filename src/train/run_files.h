// Files of a run directory: written atomically, verified before trusted.
#pragma once
#include <filesystem>
#include <functional>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "cohort/json.h"

namespace cohort {

inline constexpr const char* kManifestFile = "manifest.json";
inline constexpr const char* kMetaFile = "meta.json";
inline constexpr const char* kResultFile = "result.json";
inline constexpr const char* kMetricsFile = "metrics.jsonl";
inline constexpr const char* kMetricsCsvFile = "metrics.csv";
// train::log_step's records: {"step", "timestamp", metrics...}, one line each.
inline constexpr const char* kStepsFile = "steps.jsonl";
inline constexpr const char* kCheckpointManagerFile = "checkpoint_manager.json";
inline constexpr const char* kCheckpointPrefix = "checkpoint_";
// The loss scaler's state in a checkpoint of an fp16 run as the first release wrote it (now the
// Stateful part optim::kLossScalerPart); still loaded.
inline constexpr const char* kLossScalerFile = "loss_scaler.json";

// While it lives, the files and folders this process creates take `mask` (umask(2)): a run's
// (RunConfig::umask). The mask before it is back when it ends.
class ScopedUmask {
 public:
  explicit ScopedUmask(int mask);
  ~ScopedUmask();
  ScopedUmask(const ScopedUmask&) = delete;
  ScopedUmask& operator=(const ScopedUmask&) = delete;

 private:
  unsigned previous_;
};
// Sets `path`'s permissions to what a process with umask `mask` creates: 0777 & ~mask for a
// folder, 0666 & ~mask for a file (e.g. a folder made before the run's mask applied, or a copy
// that kept its source's bits).
void apply_umask(const std::filesystem::path& path, int mask);

// Removes `path` and everything under it, as std::filesystem::remove_all(path, ec) does, but
// without it: libtorch.so of PyTorch's wheels (2.11 seen) exports a remove_all of its own that
// crashes, and in a program linked against it that one can win the symbol lookup (see
// src/CMakeLists.txt). Errors are ignored: what cannot be removed stays.
void remove_tree(const std::filesystem::path& path);

// Writes through `fill` to a temporary name, flushes it to disk and renames it over `path`:
// a reader sees the old file or the new one, never half of one. `size`, when known (>= 0), is
// how many bytes `fill` writes: a capture in memory (FileCapture) allocates them at once.
void write_atomically(const std::filesystem::path& path,
                      const std::function<void(std::ostream&)>& fill, int64_t size = -1);
void write_atomically(const std::filesystem::path& path, const std::string& content);
// Appends `line` and a newline to `file` (created if missing) with one write, flushed to disk
// before it returns: a history that only grows, of which a crash loses at most the line being
// written (metrics.jsonl, a trial's results). RuntimeError naming the file when it cannot be
// opened, written or flushed.
void append_line(const std::filesystem::path& file, const std::string& line);
// Renames `from` (a file, or a folder and everything in it) to `to` so that a crash, even of
// the machine, leaves either the old state or `to` whole: `from` is flushed to disk first, then
// renamed, then the folder holding `to` flushed. RuntimeError naming the path and the reason when
// a flush or the rename fails.
void rename_durably(const std::filesystem::path& from, const std::filesystem::path& to);

// RunConfig::extra_files, into `dir`; a name that is not a plain file name is a UsageError.
void write_extra_files(const std::filesystem::path& dir,
                       const std::map<std::string, std::string>& files);

Json read_json(const std::filesystem::path& path);
// One JSON value per line. A line that is no JSON (cut by a crash mid-write, or being written
// now) is skipped, and the lines after it still count.
std::vector<Json> read_jsonl(const std::filesystem::path& path);

// steps.jsonl's records in the order of their "step", one per step: a step that a resumed run took
// again is its later record's. At most `max_records`, evenly spread, the last always among them.
std::vector<Json> read_steps(const std::filesystem::path& run_dir, size_t max_records);

// A CSV file with a header row: the columns are the union of the objects' keys, in the order
// first seen; strings unquoted unless they need it, other values as JSON.
void write_csv(const std::filesystem::path& file, const std::vector<Json>& rows);

// Held by the driver that owns a run directory, from start to finish: `<dir>/.driver.lock`, an
// flock (the kernel drops it when the process dies) holding the owner's pid, host and start
// time. A second driver of the same directory gets a UsageError naming the owner; a lock file
// whose owner died is taken over, and `on_takeover` gets a line saying so.
class RunDirLock {
 public:
  RunDirLock(const std::filesystem::path& dir,
             const std::function<void(const std::string&)>& on_takeover);
  ~RunDirLock();
  RunDirLock(const RunDirLock&) = delete;
  RunDirLock& operator=(const RunDirLock&) = delete;

 private:
  int fd_ = -1;
};

// A checkpoint's files captured in memory (FileCapture): their bytes by path relative to the
// capture's root. Kept from one capture to the next, so that each buffer's memory is reused: a
// copy into memory already touched costs milliseconds per GB, where fresh pages can cost seconds.
class CapturedFiles {
 public:
  // The files of the last capture, by relative path.
  std::vector<std::pair<std::string, const std::string*>> files() const;

 private:
  friend class FileCapture;
  struct Buffer {
    std::string bytes;
    bool current = false;  // written by the last capture
  };
  std::map<std::string, Buffer> buffers_;
};

// While it lives, write_atomically() on this thread of a file under `root` (however deep) writes
// into `captured` instead of the disk: what a save function writes, taken in memory to be written
// out later (merge_captured) while training goes on. The files of an earlier capture are dropped.
class FileCapture {
 public:
  FileCapture(std::filesystem::path root, CapturedFiles& captured);
  ~FileCapture();
  FileCapture(const FileCapture&) = delete;
  FileCapture& operator=(const FileCapture&) = delete;
  // The capture of this thread that takes `path`, or none; `relative` is set to its path under
  // the capture's root.
  static FileCapture* of(const std::filesystem::path& path, std::string& relative);
  // write_atomically()'s bytes of a captured file (`size` of them, when >= 0).
  void write(const std::string& relative, const std::function<void(std::ostream&)>& fill,
             int64_t size);

 private:
  std::filesystem::path root_;
  CapturedFiles& captured_;
  FileCapture* previous_;
};

// Copies the files of `from` into `into` (a checkpoint's staging folder), each given the run's
// `umask`. Rank 0's copy of a file replaces another rank's; the others' never replace an existing
// file (link() fails on an existing name, atomically).
void merge_files(const std::filesystem::path& from, const std::filesystem::path& into, int rank,
                 int umask);
// The same for files captured in memory.
void merge_captured(const CapturedFiles& captured, const std::filesystem::path& into, int rank,
                    int umask);
// manifest.json: every file under `dir` with its size and CRC-32.
void write_manifest(const std::filesystem::path& dir);
// Throws UsageError naming the first file that is missing, truncated or altered.
void verify_manifest(const std::filesystem::path& dir);

// "checkpoint_000042" for 42; -1 for a name that is not a checkpoint's.
std::string checkpoint_name(int64_t index);
int64_t checkpoint_index(const std::filesystem::path& dir);

}  // namespace cohort

#include "train/run_files.h"

#include <fcntl.h>
#include <ftw.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <sstream>

#include "cohort/error.h"
#include "cohort/runtime/worker_info.h"
#include "train/manifest.h"

namespace cohort {
namespace {

std::string read_fd(int fd) {
  std::string text;
  char buffer[512];
  ::lseek(fd, 0, SEEK_SET);
  for (ssize_t n; (n = ::read(fd, buffer, sizeof buffer)) > 0;) text.append(buffer, n);
  return text;
}

// "pid 123 on host h, started 2026-11-23 20:01:02" from a lock file's JSON; the raw text if
// it is not JSON.
std::string describe_owner(const std::string& text) {
  try {
    const auto owner = Json::parse(text);
    return "pid " + std::to_string(owner.at("pid").get<long>()) + " on host " +
           owner.at("host").get<std::string>() + ", started " +
           owner.at("started").get<std::string>();
  } catch (const std::exception&) {
    return "'" + text + "'";
  }
}

// fsync(2) of `fd`: 0, or the errno of a failure. A file system that cannot flush a folder
// (EINVAL) is taken as having nothing to do.
int fsync_error(int fd) { return ::fsync(fd) == 0 || errno == EINVAL ? 0 : errno; }

// Flushes a file or a folder (its entries) to disk; RuntimeError naming it and the reason when
// that fails.
void fsync_path(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    throw RuntimeError("cannot open " + path.string() +
                       " to flush it to disk: " + std::strerror(errno));
  }
  const int error = fsync_error(fd);
  ::close(fd);
  if (error != 0) {
    throw RuntimeError("flushing " + path.string() + " to disk failed: " + std::strerror(error) +
                       " (is the disk full or failing?)");
  }
}

// `path` flushed, and with a folder every file and folder under it first.
void fsync_tree(const std::filesystem::path& path) {
  if (std::filesystem::is_directory(path)) {
    for (const auto& entry : std::filesystem::recursive_directory_iterator(path))
      if (entry.is_regular_file() || entry.is_directory()) fsync_path(entry.path());
  }
  fsync_path(path);
}

uint32_t file_crc32(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> buffer(1 << 20);
  uLong crc = crc32(0L, Z_NULL, 0);
  while (in) {
    in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
    crc = crc32(crc, reinterpret_cast<const Bytef*>(buffer.data()), static_cast<uInt>(in.gcount()));
  }
  return static_cast<uint32_t>(crc);
}

std::string hex(uint32_t v) {
  char buffer[16];
  std::snprintf(buffer, sizeof buffer, "%08x", v);
  return buffer;
}

}  // namespace

namespace {

// The innermost FileCapture of this thread.
thread_local FileCapture* active_capture = nullptr;

// An ostream's buffer that appends to a string (whose capacity a capture keeps).
class AppendBuffer : public std::streambuf {
 public:
  explicit AppendBuffer(std::string& out) : out_(out) {}

 protected:
  std::streamsize xsputn(const char* data, std::streamsize n) override {
    out_.append(data, static_cast<size_t>(n));
    return n;
  }
  int_type overflow(int_type c) override {
    if (c != traits_type::eof()) out_.push_back(static_cast<char>(c));
    return traits_type::not_eof(c);
  }

 private:
  std::string& out_;
};

// Puts `tmp` (a complete file) in place as `target` of a staging folder shared by the ranks:
// rank 0's replaces another rank's; the others' never replace an existing file (link() fails on
// an existing name, atomically).
void place_file(const std::filesystem::path& tmp, const std::filesystem::path& target, int rank,
                int umask) {
  apply_umask(tmp, umask);  // not the bits of the file the loop wrote
  if (rank == 0) {
    std::filesystem::rename(tmp, target);
  } else {
    ::link(tmp.c_str(), target.c_str());
    std::filesystem::remove(tmp);
  }
}

std::filesystem::path rank_tmp(const std::filesystem::path& target, int rank) {
  auto tmp = target;
  tmp += ".rank" + std::to_string(rank) + ".tmp";
  return tmp;
}

}  // namespace

std::vector<std::pair<std::string, const std::string*>> CapturedFiles::files() const {
  std::vector<std::pair<std::string, const std::string*>> out;
  for (const auto& [name, buffer] : buffers_)
    if (buffer.current) out.emplace_back(name, &buffer.bytes);
  return out;
}

FileCapture::FileCapture(std::filesystem::path root, CapturedFiles& captured)
    : root_(std::move(root)), captured_(captured), previous_(active_capture) {
  for (auto& [name, buffer] : captured_.buffers_) {
    buffer.current = false;
    buffer.bytes.clear();  // its capacity stays
  }
  active_capture = this;
}

FileCapture::~FileCapture() { active_capture = previous_; }

FileCapture* FileCapture::of(const std::filesystem::path& path, std::string& relative) {
  if (active_capture == nullptr) return nullptr;
  const auto rel = path.lexically_normal().lexically_relative(active_capture->root_);
  if (rel.empty() || *rel.begin() == "..") return nullptr;
  relative = rel.string();
  return active_capture;
}

void FileCapture::write(const std::string& relative, const std::function<void(std::ostream&)>& fill,
                        int64_t size) {
  auto& buffer = captured_.buffers_[relative];
  buffer.bytes.clear();
  // At once: growing a buffer of a GB by doubling copies it and touches fresh pages again.
  if (size > 0) buffer.bytes.reserve(static_cast<size_t>(size));
  AppendBuffer sink(buffer.bytes);
  std::ostream out(&sink);
  fill(out);
  if (!out) throw RuntimeError("failed capturing " + relative + " in memory");
  buffer.current = true;
}

void write_atomically(const std::filesystem::path& path,
                      const std::function<void(std::ostream&)>& fill, int64_t size) {
  std::string relative;
  if (auto* capture = FileCapture::of(path, relative)) {
    capture->write(relative, fill, size);
    return;
  }
  auto tmp = path;
  tmp += ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out)
      throw RuntimeError("cannot write " + tmp.string() + ": check that the folder is writable");
    fill(out);
    out.flush();
    if (!out) throw RuntimeError("failed writing " + tmp.string() + " (disk full?)");
  }
  rename_durably(tmp, path);
}

void append_line(const std::filesystem::path& file, const std::string& line) {
  const int fd = ::open(file.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0666);
  if (fd < 0) {
    throw RuntimeError("cannot open " + file.string() +
                       " to append to it: " + std::strerror(errno));
  }
  const std::string text = line + "\n";
  size_t written = 0;
  int error = 0;
  while (written < text.size()) {
    const ssize_t n = ::write(fd, text.data() + written, text.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      error = n < 0 ? errno : EIO;
      break;
    }
    written += static_cast<size_t>(n);
  }
  if (error == 0) error = fsync_error(fd);
  ::close(fd);
  if (error != 0) {
    throw RuntimeError("appending to " + file.string() + " failed: " + std::strerror(error) +
                       " (is the disk full or failing?)");
  }
}

void rename_durably(const std::filesystem::path& from, const std::filesystem::path& to) {
  fsync_tree(from);
  std::error_code error;
  std::filesystem::rename(from, to, error);
  if (error) {
    throw RuntimeError("cannot rename " + from.string() + " to " + to.string() + ": " +
                       error.message());
  }
  fsync_path(to.has_parent_path() ? to.parent_path() : std::filesystem::path("."));
}

ScopedUmask::ScopedUmask(int mask)
    : previous_(static_cast<unsigned>(::umask(static_cast<mode_t>(mask & 0777)))) {}

ScopedUmask::~ScopedUmask() { ::umask(static_cast<mode_t>(previous_)); }

void apply_umask(const std::filesystem::path& path, int mask) {
  const unsigned full = std::filesystem::is_directory(path) ? 0777 : 0666;
  std::error_code error;
  std::filesystem::permissions(path, static_cast<std::filesystem::perms>(full & ~unsigned(mask)),
                               error);
  if (error) {
    throw RuntimeError("cannot set the permissions of " + path.string() + ": " + error.message());
  }
}

void remove_tree(const std::filesystem::path& path) {
  // Depth first (a folder after its contents), links not followed.
  ::nftw(
      path.c_str(),
      [](const char* file, const struct stat*, int, struct FTW*) {
        ::remove(file);
        return 0;
      },
      64, FTW_DEPTH | FTW_PHYS);
}

void write_atomically(const std::filesystem::path& path, const std::string& content) {
  write_atomically(
      path, [&](std::ostream& out) { out << content; }, static_cast<int64_t>(content.size()));
}

void write_extra_files(const std::filesystem::path& dir,
                       const std::map<std::string, std::string>& files) {
  for (const auto& [file, content] : files) {
    const std::filesystem::path path(file);
    if (file.empty() || path.has_parent_path() || file == "." || file == "..") {
      throw UsageError("RunConfig.extra_files: '" + file +
                       "' must be a plain file name (no folder)");
    }
    write_atomically(dir / path, content);
  }
}

Json read_json(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) throw UsageError("cannot read " + path.string());
  try {
    return Json::parse(in);
  } catch (const std::exception& e) {
    throw UsageError(path.string() + " is not valid JSON (" + e.what() + ")");
  }
}

std::vector<Json> read_jsonl(const std::filesystem::path& path) {
  std::vector<Json> records;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    try {
      records.push_back(Json::parse(line));
    } catch (const std::exception&) {
      continue;
    }
  }
  return records;
}

std::vector<Json> read_steps(const std::filesystem::path& run_dir, size_t max_records) {
  std::map<int64_t, Json> by_step;
  for (auto& record : read_jsonl(run_dir / kStepsFile)) {
    if (!record.is_object() || !record.contains("step") || !record["step"].is_number_integer())
      continue;
    const auto step = record["step"].get<int64_t>();
    by_step[step] = std::move(record);
  }
  std::vector<Json> steps;
  steps.reserve(std::min(by_step.size(), max_records));
  const size_t n = by_step.size();
  size_t i = 0;
  for (auto& [step, record] : by_step) {
    // Record i of n is kept when it ends one of max_records equal parts (the last record ends
    // the last part).
    if (n <= max_records || (i * max_records) / n != ((i + 1) * max_records) / n)
      steps.push_back(std::move(record));
    ++i;
  }
  return steps;
}

void merge_files(const std::filesystem::path& from, const std::filesystem::path& into, int rank,
                 int umask) {
  for (const auto& entry : std::filesystem::recursive_directory_iterator(from)) {
    if (!entry.is_regular_file()) continue;
    const auto target = into / std::filesystem::relative(entry.path(), from);
    std::filesystem::create_directories(target.parent_path());
    const auto tmp = rank_tmp(target, rank);
    std::filesystem::copy_file(entry.path(), tmp,
                               std::filesystem::copy_options::overwrite_existing);
    place_file(tmp, target, rank, umask);
  }
}

void merge_captured(const CapturedFiles& captured, const std::filesystem::path& into, int rank,
                    int umask) {
  for (const auto& [relative, bytes] : captured.files()) {
    const auto target = into / relative;
    std::filesystem::create_directories(target.parent_path());
    const auto tmp = rank_tmp(target, rank);
    {
      std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
      out.write(bytes->data(), static_cast<std::streamsize>(bytes->size()));
      out.flush();
      if (!out) throw RuntimeError("failed writing " + tmp.string() + " (disk full?)");
    }
    place_file(tmp, target, rank, umask);
  }
}

void write_manifest(const std::filesystem::path& dir) {
  Json files = Json::object();
  for (const auto& entry : std::filesystem::recursive_directory_iterator(dir)) {
    if (!entry.is_regular_file()) continue;
    const auto rel = std::filesystem::relative(entry.path(), dir).string();
    if (rel == kManifestFile) continue;
    files[rel] = {{"size", entry.file_size()}, {"crc32", hex(file_crc32(entry.path()))}};
  }
  write_atomically(dir / kManifestFile, Json{{"files", files}}.dump(2) + "\n");
}

void verify_manifest(const std::filesystem::path& dir) {
  const auto manifest_path = dir / kManifestFile;
  if (!std::filesystem::exists(manifest_path)) {
    throw UsageError("checkpoint " + dir.string() + " has no " + kManifestFile +
                     ": it was not completely written");
  }
  const auto entries = train::detail::read_manifest_entries(
      read_json(manifest_path), "checkpoint " + dir.string() + ": " + kManifestFile);
  for (const auto& entry : entries) {
    const auto file = dir / entry.name;
    if (!std::filesystem::exists(file)) {
      throw UsageError("checkpoint " + dir.string() + ": file " + entry.name + " is missing");
    }
    const auto size = std::filesystem::file_size(file);
    if (size != entry.size) {
      throw UsageError("checkpoint " + dir.string() + ": file " + entry.name + " has " +
                       std::to_string(size) + " bytes, the manifest says " +
                       std::to_string(entry.size) + (size < entry.size ? " (truncated)" : ""));
    }
    const auto crc = hex(file_crc32(file));
    if (crc != entry.crc32) {
      throw UsageError("checkpoint " + dir.string() + ": file " + entry.name + " has checksum " +
                       crc + ", the manifest says " + entry.crc32 + " (corrupt)");
    }
  }
}

std::string checkpoint_name(int64_t index) {
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%s%06lld", kCheckpointPrefix,
                static_cast<long long>(index));
  return buffer;
}

int64_t checkpoint_index(const std::filesystem::path& dir) {
  const auto name = dir.filename().string();
  const std::string prefix = kCheckpointPrefix;
  if (name.size() != prefix.size() + 6 || name.compare(0, prefix.size(), prefix) != 0) return -1;
  for (size_t i = prefix.size(); i < name.size(); ++i) {
    if (!std::isdigit(static_cast<unsigned char>(name[i]))) return -1;
  }
  return std::stoll(name.substr(prefix.size()));
}

namespace {
std::string csv_cell(const Json& value) {
  std::string text = value.is_string() ? value.get<std::string>() : value.dump();
  if (text.find_first_of(",\"\n") == std::string::npos) return text;
  std::string quoted = "\"";
  for (char c : text) quoted += c == '"' ? std::string("\"\"") : std::string(1, c);
  return quoted + "\"";
}
}  // namespace

void write_csv(const std::filesystem::path& file, const std::vector<Json>& history) {
  std::vector<std::string> columns;
  for (const auto& record : history) {
    for (const auto& [key, value] : record.items()) {
      if (std::find(columns.begin(), columns.end(), key) == columns.end()) columns.push_back(key);
    }
  }
  write_atomically(file, [&](std::ostream& out) {
    for (size_t c = 0; c < columns.size(); ++c) out << (c ? "," : "") << csv_cell(columns[c]);
    out << '\n';
    for (const auto& record : history) {
      for (size_t c = 0; c < columns.size(); ++c) {
        out << (c ? "," : "") << (record.contains(columns[c]) ? csv_cell(record[columns[c]]) : "");
      }
      out << '\n';
    }
  });
}

RunDirLock::RunDirLock(const std::filesystem::path& dir,
                       const std::function<void(const std::string&)>& on_takeover) {
  const auto file = dir / ".driver.lock";
  fd_ = ::open(file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) {
    throw UsageError("cannot open " + file.string() + " (" + std::strerror(errno) +
                     "): give a writable --storage-path / RunConfig.storage_path");
  }
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const auto owner = describe_owner(read_fd(fd_));
    ::close(fd_);
    fd_ = -1;
    throw UsageError("run directory " + dir.string() + " is in use by the driver with " + owner +
                     ": wait for it to finish or stop it, or give another --name / "
                     "RunConfig.name");
  }
  const auto previous = read_fd(fd_);
  if (!previous.empty() && on_takeover) {
    on_takeover("cohort: taking over the run directory from a driver that is gone (" +
                describe_owner(previous) + ")");
  }
  const std::string host = runtime::host_name();
  const std::time_t now = std::time(nullptr);
  char started[64];
  std::strftime(started, sizeof started, "%Y-%m-%d %H:%M:%S", std::localtime(&now));
  const auto me =
      Json{{"pid", static_cast<long>(::getpid())}, {"host", host}, {"started", started}}.dump();
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, me.data(), me.size(), 0) < 0) {
    // The lock holds without the description; a second driver's message is only vaguer.
  }
}

RunDirLock::~RunDirLock() {
  if (fd_ < 0) return;
  // Emptied: the next driver finds no owner to take over from.
  if (::ftruncate(fd_, 0) != 0) {
  }
  ::close(fd_);
}

}  // namespace cohort

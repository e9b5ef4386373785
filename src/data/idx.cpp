#include "cohort/data/idx.h"

#include <torch/types.h>
#include <zlib.h>

#include <array>
#include <fstream>

#include "cohort/error.h"

namespace cohort::data {
namespace {

bool is_gzip(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::array<unsigned char, 2> magic{};
  in.read(reinterpret_cast<char*>(magic.data()), 2);
  return in.gcount() == 2 && magic[0] == 0x1f && magic[1] == 0x8b;
}

// Reads through zlib, which passes plain files through unchanged.
class Reader {
 public:
  explicit Reader(const std::filesystem::path& path) : path_(path) {
    if (!std::filesystem::exists(path)) {
      throw UsageError("IDX file " + path.string() + " does not exist: check the data directory");
    }
    file_ = gzopen(path.c_str(), "rb");
    if (file_ == nullptr) throw UsageError("cannot open IDX file " + path.string());
    gzbuffer(file_, 1 << 20);
  }
  ~Reader() { gzclose(file_); }
  Reader(const Reader&) = delete;
  Reader& operator=(const Reader&) = delete;

  // Returns the number of bytes read (fewer only at end of file).
  int64_t read(void* out, int64_t bytes) {
    int64_t done = 0;
    auto* p = static_cast<char*>(out);
    while (done < bytes) {
      const auto chunk = static_cast<unsigned>(std::min<int64_t>(bytes - done, 1 << 30));
      int n = gzread(file_, p + done, chunk);
      if (n < 0) {
        int err = 0;
        throw UsageError("IDX file " + path_.string() + " is corrupt: " + gzerror(file_, &err));
      }
      if (n == 0) break;
      done += n;
    }
    return done;
  }

 private:
  std::filesystem::path path_;
  gzFile file_ = nullptr;
};

// The header, read from `reader` as far as its magic number says it goes.
IdxHeader parse_header(Reader& reader, const std::filesystem::path& path) {
  std::string bytes(4, '\0');
  bytes.resize(static_cast<size_t>(reader.read(bytes.data(), 4)));
  const int64_t length = idx_header_bytes(bytes, path.string());
  bytes.resize(static_cast<size_t>(length));
  const int64_t got = reader.read(bytes.data() + 4, length - 4);
  bytes.resize(static_cast<size_t>(4 + got));
  return parse_idx_header(bytes, path.string());
}

std::string truncated(const std::filesystem::path& path, int64_t expected, int64_t got) {
  return "IDX file " + path.string() + " is truncated: header announces " +
         std::to_string(expected) + " data bytes, file has " + std::to_string(got) +
         " (re-download or reinstall the data set)";
}

}  // namespace

IdxHeader inspect_idx(const std::filesystem::path& path) {
  Reader reader(path);
  IdxHeader header = parse_header(reader, path);
  const int64_t header_bytes = 4 + 4 * static_cast<int64_t>(header.shape.size());
  int64_t total = 0;
  if (is_gzip(path)) {
    // gzip's trailer holds the uncompressed size modulo 2^32.
    std::ifstream in(path, std::ios::binary | std::ios::ate);
    const auto size = static_cast<int64_t>(in.tellg());
    std::array<unsigned char, 4> le{};
    in.seekg(size - 4);
    in.read(reinterpret_cast<char*>(le.data()), 4);
    total =
        int64_t{le[0]} | (int64_t{le[1]} << 8) | (int64_t{le[2]} << 16) | (int64_t{le[3]} << 24);
    const int64_t expected = (header_bytes + header.payload_bytes()) & 0xffffffffLL;
    if (total != expected) {
      throw UsageError(truncated(path, header.payload_bytes(), total - header_bytes) +
                       " or the gzip stream is damaged");
    }
    return header;
  }
  total = static_cast<int64_t>(std::filesystem::file_size(path));
  if (total < header_bytes + header.payload_bytes()) {
    throw UsageError(truncated(path, header.payload_bytes(), total - header_bytes));
  }
  if (total > header_bytes + header.payload_bytes()) {
    throw UsageError("IDX file " + path.string() + " has " +
                     std::to_string(total - header_bytes - header.payload_bytes()) +
                     " bytes after its data: not a valid IDX file");
  }
  return header;
}

at::Tensor read_idx(const std::filesystem::path& path) {
  inspect_idx(path);  // the announced size checked against the file's before it is allocated
  Reader reader(path);
  IdxHeader header = parse_header(reader, path);
  auto tensor = torch::empty(header.shape, torch::kUInt8);
  const int64_t got = reader.read(tensor.data_ptr(), header.payload_bytes());
  if (got != header.payload_bytes()) throw UsageError(truncated(path, header.payload_bytes(), got));
  char extra = 0;
  if (reader.read(&extra, 1) != 0) {
    throw UsageError("IDX file " + path.string() +
                     " has bytes after its data: not a valid IDX file");
  }
  return tensor;
}

void write_idx(const std::filesystem::path& path, const at::Tensor& tensor) {
  if (tensor.scalar_type() != torch::kUInt8 || tensor.dim() < 1 || tensor.dim() > 4) {
    throw UsageError("write_idx: expected a uint8 tensor of 1 to 4 dimensions");
  }
  auto data = tensor.contiguous().cpu();
  std::string bytes = {0, 0, static_cast<char>(kIdxUnsignedByte), static_cast<char>(data.dim())};
  for (int64_t d : data.sizes()) {
    for (int shift = 24; shift >= 0; shift -= 8)
      bytes.push_back(static_cast<char>((d >> shift) & 0xff));
  }
  bytes.append(static_cast<const char*>(data.data_ptr()), static_cast<size_t>(data.numel()));
  const bool gz = path.extension() == ".gz";
  gzFile file = gzopen(path.c_str(), gz ? "wb" : "wbT");
  if (file == nullptr) throw RuntimeError("cannot write " + path.string());
  const int written = gzwrite(file, bytes.data(), static_cast<unsigned>(bytes.size()));
  if (gzclose(file) != Z_OK || written != static_cast<int>(bytes.size())) {
    throw RuntimeError("failed writing " + path.string());
  }
}

}  // namespace cohort::data

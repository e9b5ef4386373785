#include "cohort/train/summary_writer.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string_view>
#include <type_traits>

#include <ATen/ATen.h>

#include "cohort/error.h"
#include "cohort/runtime/worker_info.h"

namespace cohort::train {

namespace {

// CRC-32C (Castagnoli), reflected, as TFRecord frames use it.
uint32_t crc32c(const char* data, size_t size) {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  uint32_t crc = 0xFFFFFFFFu;
  for (size_t i = 0; i < size; ++i)
    crc = table[(crc ^ static_cast<uint8_t>(data[i])) & 0xFFu] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

uint32_t masked_crc(const char* data, size_t size) {
  const uint32_t crc = crc32c(data, size);
  return ((crc >> 15) | (crc << 17)) + 0xA282EAD8u;
}

std::string little_endian(uint64_t value, int bytes) {
  std::string out(static_cast<size_t>(bytes), '\0');
  for (int i = 0; i < bytes; ++i) out[static_cast<size_t>(i)] = static_cast<char>(value >> (8 * i));
  return out;
}

uint64_t read_little_endian(const char* data, int bytes) {
  uint64_t value = 0;
  for (int i = 0; i < bytes; ++i)
    value |= static_cast<uint64_t>(static_cast<uint8_t>(data[i])) << (8 * i);
  return value;
}

// A double or float as protocol buffers' fixed64 / fixed32: its bits, little-endian.
template <typename T>
std::string fixed(T value) {
  static_assert(sizeof(T) == 8 || sizeof(T) == 4);
  std::conditional_t<sizeof(T) == 8, uint64_t, uint32_t> bits;
  std::memcpy(&bits, &value, sizeof bits);
  return little_endian(bits, sizeof bits);
}

// Protocol-buffer encoding of the few messages an event file holds.
class Message {
 public:
  Message& varint(int field, uint64_t value) {
    key(field, 0);
    raw_varint(value);
    return *this;
  }
  Message& f64(int field, double value) {
    key(field, 1);
    bytes_ += fixed(value);
    return *this;
  }
  Message& f32(int field, float value) {
    key(field, 5);
    bytes_ += fixed(value);
    return *this;
  }
  Message& bytes(int field, std::string_view value) {
    key(field, 2);
    raw_varint(value.size());
    bytes_.append(value);
    return *this;
  }
  Message& message(int field, const Message& value) { return bytes(field, value.bytes_); }
  Message& packed_f64(int field, const std::vector<double>& values) {
    std::string packed;
    for (double v : values) packed += fixed(v);
    return bytes(field, packed);
  }
  const std::string& str() const { return bytes_; }

 private:
  void key(int field, int wire_type) {
    raw_varint((static_cast<uint64_t>(field) << 3) | static_cast<uint64_t>(wire_type));
  }
  void raw_varint(uint64_t value) {
    while (value >= 0x80) {
      bytes_.push_back(static_cast<char>((value & 0x7F) | 0x80));
      value >>= 7;
    }
    bytes_.push_back(static_cast<char>(value));
  }
  std::string bytes_;
};

// Field numbers of tensorflow.Event, Summary, Summary.Value, SummaryMetadata, HistogramProto and
// TensorProto (tensorflow/core/util/event.proto, tensorflow/core/framework/summary.proto).
enum EventField { kWallTime = 1, kStep = 2, kFileVersion = 3, kSummary = 5 };
enum ValueField { kTag = 1, kSimpleValue = 2, kHisto = 5, kTensor = 8, kMetadata = 9 };
constexpr int kSummaryValue = 1;
constexpr int kMetadataPluginData = 1;
constexpr int kPluginName = 1, kPluginContent = 2;
constexpr int kTensorDtype = 1, kTensorShape = 2, kTensorStringVal = 8;
constexpr int kDtString = 7;
constexpr const char* kFileVersionText = "brain.Event:2";

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

Message event_at(int64_t step) {
  Message event;
  event.f64(kWallTime, now_seconds()).varint(kStep, static_cast<uint64_t>(step));
  return event;
}

Message plugin_metadata(const std::string& plugin, const std::string& content = "") {
  Message plugin_data;
  plugin_data.bytes(kPluginName, plugin);
  if (!content.empty()) plugin_data.bytes(kPluginContent, content);
  Message metadata;
  metadata.message(kMetadataPluginData, plugin_data);
  return metadata;
}

std::string summary_event(int64_t step, const Message& value) {
  Message summary;
  summary.message(kSummaryValue, value);
  return event_at(step).message(kSummary, summary).str();
}

// google.protobuf.Value of a JSON scalar.
Message protobuf_value(const Json& value) {
  Message out;
  if (value.is_boolean()) {
    out.varint(4, value.get<bool>() ? 1 : 0);
  } else if (value.is_number()) {
    out.f64(2, value.get<double>());
  } else if (value.is_string()) {
    out.bytes(3, value.get<std::string>());
  } else {
    out.bytes(3, value.dump());
  }
  return out;
}

// The hparams plugin's records (tensorboard/plugins/hparams/api.proto, plugin_data.proto).
constexpr const char* kHparamsPlugin = "hparams";
enum HparamsField { kExperiment = 2, kSessionStartInfo = 3, kSessionEndInfo = 4 };

std::string hparams_event(int field, const Message& content, const std::string& tag) {
  Message plugin_data;
  plugin_data.message(field, content);
  Message value;
  value.bytes(kTag, tag).message(kMetadata, plugin_metadata(kHparamsPlugin, plugin_data.str()));
  return summary_event(0, value);
}

// Decoding, for read_events.
class Reader {
 public:
  explicit Reader(std::string_view bytes) : bytes_(bytes) {}
  // The next field's number and wire type; false at the end.
  bool next(int& field, int& wire_type) {
    if (pos_ >= bytes_.size()) return false;
    const uint64_t key = varint();
    field = static_cast<int>(key >> 3);
    wire_type = static_cast<int>(key & 7);
    return true;
  }
  uint64_t varint() {
    uint64_t value = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      const auto byte = static_cast<uint8_t>(take(1)[0]);
      value |= static_cast<uint64_t>(byte & 0x7F) << shift;
      if ((byte & 0x80) == 0) return value;
    }
    throw std::runtime_error("a varint longer than 10 bytes");
  }
  double f64() {
    const uint64_t bits = read_little_endian(take(8).data(), 8);
    double value;
    std::memcpy(&value, &bits, sizeof value);
    return value;
  }
  float f32() {
    const auto bits = static_cast<uint32_t>(read_little_endian(take(4).data(), 4));
    float value;
    std::memcpy(&value, &bits, sizeof value);
    return value;
  }
  std::string_view bytes() { return take(varint()); }
  void skip(int wire_type) {
    switch (wire_type) {
      case 0:
        varint();
        break;
      case 1:
        take(8);
        break;
      case 2:
        bytes();
        break;
      case 5:
        take(4);
        break;
      default:
        throw std::runtime_error("wire type " + std::to_string(wire_type));
    }
  }

 private:
  std::string_view take(uint64_t n) {
    if (n > bytes_.size() - pos_) throw std::runtime_error("a field runs past its message");
    const auto out = bytes_.substr(pos_, n);
    pos_ += n;
    return out;
  }
  std::string_view bytes_;
  size_t pos_ = 0;
};

std::vector<double> packed_doubles(std::string_view bytes) {
  std::vector<double> out;
  Reader reader(bytes);
  for (size_t i = 0; i + 8 <= bytes.size(); i += 8) out.push_back(reader.f64());
  return out;
}

Histogram decode_histogram(std::string_view bytes) {
  Histogram h;
  Reader r(bytes);
  for (int field, wire; r.next(field, wire);) {
    if (field >= 1 && field <= 5 && wire == 1) {
      double* targets[] = {&h.min, &h.max, &h.num, &h.sum, &h.sum_squares};
      *targets[field - 1] = r.f64();
    } else if ((field == 6 || field == 7) && wire == 2) {
      (field == 6 ? h.bucket_limit : h.bucket) = packed_doubles(r.bytes());
    } else {
      r.skip(wire);
    }
  }
  return h;
}

void decode_metadata(std::string_view bytes, SummaryEvent& event) {
  Reader r(bytes);
  for (int field, wire; r.next(field, wire);) {
    if (field != kMetadataPluginData || wire != 2) {
      r.skip(wire);
      continue;
    }
    Reader plugin(r.bytes());
    for (int f, w; plugin.next(f, w);) {
      if (f == kPluginName && w == 2) {
        event.plugin = std::string(plugin.bytes());
      } else if (f == kPluginContent && w == 2) {
        event.plugin_content = std::string(plugin.bytes());
      } else {
        plugin.skip(w);
      }
    }
  }
}

std::string decode_string_tensor(std::string_view bytes) {
  Reader r(bytes);
  std::string out;
  for (int field, wire; r.next(field, wire);) {
    if (field == kTensorStringVal && wire == 2) {
      out += r.bytes();
    } else {
      r.skip(wire);
    }
  }
  return out;
}

void decode_value(std::string_view bytes, SummaryEvent& event) {
  Reader r(bytes);
  bool has_tensor = false;
  std::string_view tensor;
  for (int field, wire; r.next(field, wire);) {
    if (field == kTag && wire == 2) {
      event.tag = std::string(r.bytes());
    } else if (field == kSimpleValue && wire == 5) {
      event.kind = SummaryEvent::Kind::kScalar;
      event.scalar = r.f32();
    } else if (field == kHisto && wire == 2) {
      event.kind = SummaryEvent::Kind::kHistogram;
      event.histogram = decode_histogram(r.bytes());
    } else if (field == kTensor && wire == 2) {
      has_tensor = true;
      tensor = r.bytes();
    } else if (field == kMetadata && wire == 2) {
      decode_metadata(r.bytes(), event);
    } else {
      r.skip(wire);
    }
  }
  if (event.plugin == "text" && has_tensor) {
    event.kind = SummaryEvent::Kind::kText;
    event.text = decode_string_tensor(tensor);
  }
}

std::vector<SummaryEvent> decode_event(std::string_view bytes) {
  std::vector<SummaryEvent> out;
  double wall_time = 0;
  int64_t step = 0;
  Reader r(bytes);
  for (int field, wire; r.next(field, wire);) {
    if (field == kWallTime && wire == 1) {
      wall_time = r.f64();
    } else if (field == kStep && wire == 0) {
      step = static_cast<int64_t>(r.varint());
    } else if (field == kFileVersion && wire == 2) {
      SummaryEvent e;
      e.kind = SummaryEvent::Kind::kFileVersion;
      e.tag = std::string(r.bytes());
      out.push_back(std::move(e));
    } else if (field == kSummary && wire == 2) {
      Reader summary(r.bytes());
      for (int f, w; summary.next(f, w);) {
        if (f != kSummaryValue || w != 2) {
          summary.skip(w);
          continue;
        }
        SummaryEvent e;
        decode_value(summary.bytes(), e);
        out.push_back(std::move(e));
      }
    } else {
      r.skip(wire);
    }
  }
  for (auto& e : out) {
    e.wall_time = wall_time;
    e.step = step;
  }
  return out;
}

}  // namespace

Histogram Histogram::of(const at::Tensor& values, int bins) {
  if (bins < 1) throw UsageError("Histogram::of: bins is " + std::to_string(bins) + ", give >= 1");
  Histogram h;
  auto v = values.detach().to(at::kCPU, at::kDouble).flatten();
  v = v.masked_select(at::isfinite(v));
  if (v.numel() == 0) return h;
  h.min = v.min().item<double>();
  h.max = v.max().item<double>();
  h.num = static_cast<double>(v.numel());
  h.sum = v.sum().item<double>();
  h.sum_squares = (v * v).sum().item<double>();
  if (h.max == h.min) {
    h.bucket_limit = {h.max};
    h.bucket = {h.num};
    return h;
  }
  const auto counts = at::histc(v, bins, h.min, h.max).contiguous();
  const double* count = counts.data_ptr<double>();
  h.bucket.assign(count, count + bins);
  const double width = (h.max - h.min) / bins;
  for (int i = 0; i < bins; ++i)
    h.bucket_limit.push_back(i + 1 == bins ? h.max : h.min + width * (i + 1));
  return h;
}

SummaryWriter::SummaryWriter(const std::filesystem::path& log_dir) {
  static std::atomic<int> files{0};
  std::error_code ec;
  std::filesystem::create_directories(log_dir, ec);
  const auto seconds = static_cast<int64_t>(now_seconds());
  path_ = log_dir / ("events.out.tfevents." + std::to_string(seconds) + "." + runtime::host_name() +
                     "." + std::to_string(getpid()) + "." + std::to_string(files++));
  out_.open(path_, std::ios::binary | std::ios::trunc);
  if (ec || !out_) {
    throw UsageError("TensorBoard folder " + log_dir.string() + " is not writable" +
                     (ec ? " (" + ec.message() + ")" : std::string()) +
                     ": give a writable storage path, or turn TensorBoard off");
  }
  Message event;
  event.f64(kWallTime, now_seconds()).bytes(kFileVersion, kFileVersionText);
  write_event(event.str());
  flush();
}

SummaryWriter::~SummaryWriter() { out_.flush(); }

void SummaryWriter::write_event(const std::string& event) {
  const std::string length = little_endian(event.size(), 8);
  out_ << length << little_endian(masked_crc(length.data(), length.size()), 4) << event
       << little_endian(masked_crc(event.data(), event.size()), 4);
}

void SummaryWriter::flush() {
  out_.flush();
  if (!out_) throw RuntimeError("could not write TensorBoard events to " + path_.string());
}

void SummaryWriter::add_scalar(const std::string& tag, double value, int64_t step) {
  Message v;
  v.bytes(kTag, tag).f32(kSimpleValue, static_cast<float>(value));
  write_event(summary_event(step, v));
}

void SummaryWriter::add_histogram(const std::string& tag, const Histogram& h, int64_t step) {
  Message histo;
  histo.f64(1, h.min).f64(2, h.max).f64(3, h.num).f64(4, h.sum).f64(5, h.sum_squares);
  histo.packed_f64(6, h.bucket_limit).packed_f64(7, h.bucket);
  Message v;
  v.bytes(kTag, tag).message(kHisto, histo);
  write_event(summary_event(step, v));
}

void SummaryWriter::add_histogram(const std::string& tag, const at::Tensor& values, int64_t step) {
  add_histogram(tag, Histogram::of(values), step);
}

void SummaryWriter::add_text(const std::string& tag, const std::string& markdown, int64_t step) {
  Message dim;
  dim.varint(1, 1);
  Message shape;
  shape.message(2, dim);
  Message tensor;
  tensor.varint(kTensorDtype, kDtString)
      .message(kTensorShape, shape)
      .bytes(kTensorStringVal, markdown);
  Message v;
  v.bytes(kTag, tag).message(kMetadata, plugin_metadata("text")).message(kTensor, tensor);
  write_event(summary_event(step, v));
}

void SummaryWriter::add_hparams_experiment(const Json& domains,
                                           const std::vector<std::string>& metrics) {
  Message experiment;
  experiment.f64(3, now_seconds());
  for (const auto& [name, domain] : domains.items()) {
    Message info;
    info.bytes(1, name);
    if (domain.contains("values")) {
      Message list;
      bool all_numbers = true, all_bools = true;
      for (const auto& v : domain["values"]) {
        list.message(1, protobuf_value(v));
        all_numbers &= v.is_number();
        all_bools &= v.is_boolean();
      }
      info.varint(4, all_bools ? 2 : all_numbers ? 3 : 1);  // BOOL, FLOAT64, STRING
      info.message(5, list);
    } else if (domain.contains("min") && domain.contains("max")) {
      Message interval;
      interval.f64(1, domain["min"].get<double>()).f64(2, domain["max"].get<double>());
      info.varint(4, 3).message(6, interval);
    }
    experiment.message(4, info);
  }
  for (const auto& metric : metrics) {
    Message name;
    name.bytes(2, metric);
    Message info;
    info.message(1, name);
    experiment.message(5, info);
  }
  write_event(hparams_event(kExperiment, experiment, "_hparams_/experiment"));
}

void SummaryWriter::add_hparams_session_start(const Json& hparams, const std::string& group_name) {
  Message start;
  for (const auto& [name, value] : hparams.items()) {
    Message entry;
    entry.bytes(1, name).message(2, protobuf_value(value));
    start.message(1, entry);
  }
  if (!group_name.empty()) start.bytes(4, group_name);
  start.f64(5, now_seconds());
  write_event(hparams_event(kSessionStartInfo, start, "_hparams_/session_start_info"));
}

void SummaryWriter::add_hparams_session_end(SessionStatus status) {
  Message end;
  end.varint(1, static_cast<uint64_t>(status)).f64(2, now_seconds());
  write_event(hparams_event(kSessionEndInfo, end, "_hparams_/session_end_info"));
}

std::vector<SummaryEvent> read_events(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw UsageError("cannot read TensorBoard event file " + file.string());
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<SummaryEvent> out;
  size_t pos = 0;
  while (pos < bytes.size()) {
    const auto bad = [&](const std::string& what) {
      return UsageError("TensorBoard event file " + file.string() + ": the record at byte " +
                        std::to_string(pos) + " " + what +
                        " (the file is corrupt or was cut short; TensorBoard reads the records "
                        "before it)");
    };
    if (bytes.size() - pos < 12) throw bad("is cut inside its length");
    const uint64_t length = read_little_endian(bytes.data() + pos, 8);
    if (static_cast<uint32_t>(read_little_endian(bytes.data() + pos + 8, 4)) !=
        masked_crc(bytes.data() + pos, 8))
      throw bad("has a length that does not match its CRC");
    if (length > bytes.size() - pos - 12 || bytes.size() - pos - 12 - length < 4)
      throw bad("is cut short: its length says " + std::to_string(length) + " bytes");
    const char* data = bytes.data() + pos + 12;
    if (static_cast<uint32_t>(read_little_endian(data + length, 4)) != masked_crc(data, length))
      throw bad("has bytes that do not match their CRC");
    try {
      for (auto& e : decode_event(std::string_view(data, length))) out.push_back(std::move(e));
    } catch (const std::runtime_error& e) {
      throw bad(std::string("is not an Event message: ") + e.what());
    }
    pos += 12 + length + 4;
  }
  return out;
}

std::vector<std::filesystem::path> event_files(const std::filesystem::path& log_dir) {
  std::vector<std::filesystem::path> files;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(log_dir, ec)) {
    if (entry.path().filename().string().rfind("events.out.tfevents.", 0) == 0)
      files.push_back(entry.path());
  }
  // events.out.tfevents.<seconds>.<host>.<pid>.<n>: by the creation second, then by name.
  const auto seconds = [](const std::filesystem::path& p) -> long long {
    const std::string name = p.filename().string().substr(20);
    try {
      return std::stoll(name.substr(0, name.find('.')));
    } catch (const std::exception&) {
      return 0;
    }
  };
  std::sort(files.begin(), files.end(), [&](const auto& a, const auto& b) {
    return std::make_pair(seconds(a), a.filename()) < std::make_pair(seconds(b), b.filename());
  });
  return files;
}

}  // namespace cohort::train

#include "cohort/train/safetensors_header.h"

#include <c10/util/ArrayRef.h>
#include <c10/util/StringUtil.h>

#include <fstream>
#include <utility>

#include "cohort/error.h"
#include "cohort/json.h"
#include "cohort/limits.h"

namespace cohort::safetensors {
namespace {

const std::vector<std::pair<c10::ScalarType, std::string>>& dtype_names() {
  static const std::vector<std::pair<c10::ScalarType, std::string>> names{
      {c10::ScalarType::Float, "F32"}, {c10::ScalarType::Double, "F64"},
      {c10::ScalarType::Half, "F16"},  {c10::ScalarType::BFloat16, "BF16"},
      {c10::ScalarType::Long, "I64"},  {c10::ScalarType::Int, "I32"},
      {c10::ScalarType::Short, "I16"}, {c10::ScalarType::Char, "I8"},
      {c10::ScalarType::Byte, "U8"},   {c10::ScalarType::Bool, "BOOL"}};
  return names;
}

UsageError corrupt(const std::string& file, const std::string& why) {
  return UsageError("safetensors file " + file + " " + why +
                    ": the file is truncated, corrupt or not a safetensors file");
}

}  // namespace

const std::string& dtype_name(c10::ScalarType dtype, const std::string& what) {
  for (const auto& [type, name] : dtype_names())
    if (type == dtype) return name;
  throw UsageError("safetensors: tensor '" + what + "' is of dtype " + c10::toString(dtype) +
                   ", which safetensors cannot hold");
}

uint64_t header_length(std::string_view prefix, int64_t file_size, const std::string& file) {
  if (prefix.size() < 8) throw corrupt(file, "has no header length");
  uint64_t length = 0;
  for (int i = 7; i >= 0; --i) length = (length << 8) | static_cast<unsigned char>(prefix[i]);
  if (length > kMaxSafetensorsHeader) {
    throw corrupt(file, "announces a header of " + std::to_string(length) +
                            " bytes, over the cap of " + std::to_string(kMaxSafetensorsHeader) +
                            " (kMaxSafetensorsHeader)");
  }
  if (length > static_cast<uint64_t>(file_size - 8)) {
    throw corrupt(file, "announces a header of " + std::to_string(length) + " bytes in a file of " +
                            std::to_string(file_size));
  }
  return length;
}

Header parse_header(std::string_view text, int64_t file_size, const std::string& file) {
  const auto bad = [&](const std::string& why) { return corrupt(file, why); };
  Json json;
  try {
    json = Json::parse(text);
  } catch (const std::exception& e) {
    throw bad(std::string("has a header that is no JSON (") + e.what() + ")");
  }
  if (!json.is_object()) throw bad("has a header that is no JSON object");
  Header header;
  header.data_start = 8 + static_cast<int64_t>(text.size());
  const int64_t data_bytes = file_size - header.data_start;
  if (data_bytes < 0) throw bad("ends inside its header");
  // Not a structured binding: clang 14 (the fuzzer's) captures none in a lambda.
  for (const auto& item : json.items()) {
    const std::string& name = item.key();
    const Json& info = item.value();
    const auto field = [&](const std::string& key, const std::string& why) {
      return bad("has tensor '" + name + "' whose '" + key + "' " + why);
    };
    if (name == "__metadata__") {
      if (!info.is_object()) throw bad("has a '__metadata__' that is no object");
      for (const auto& [key, value] : info.items()) {
        if (!value.is_string())
          throw bad("has '__metadata__' entry '" + key + "' that is no string");
        header.metadata[key] = value.get<std::string>();
      }
      continue;
    }
    if (!info.is_object()) throw bad("has tensor '" + name + "' described by no object");
    const auto dtype = info.find("dtype");
    if (dtype == info.end() || !dtype->is_string()) throw field("dtype", "is missing or no string");
    TensorInfo t;
    bool known = false;
    for (const auto& [type, n] : dtype_names()) {
      if (n == dtype->get<std::string>()) {
        t.dtype = type;
        known = true;
      }
    }
    if (!known) {
      std::string read;
      for (const auto& [type, n] : dtype_names()) read += (read.empty() ? "" : ", ") + n;
      throw field("dtype", "is the unsupported dtype " + dtype->get<std::string>() + " (" + read +
                               " are read)");
    }
    const auto shape = info.find("shape");
    if (shape == info.end() || !shape->is_array()) throw field("shape", "is missing or no array");
    for (const auto& d : *shape) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0)
        throw field("shape", "holds " + d.dump() + ", not a size (an integer >= 0)");
      t.shape.push_back(d.get<int64_t>());
    }
    // Past the data (data_bytes + 1) when the shape asks for more than the file holds.
    const int64_t bytes =
        bytes_up_to(t.shape, static_cast<int64_t>(c10::elementSize(t.dtype)), data_bytes);
    const auto offsets = info.find("data_offsets");
    if (offsets == info.end() || !offsets->is_array() || offsets->size() != 2 ||
        !(*offsets)[0].is_number_integer() || !(*offsets)[1].is_number_integer()) {
      throw field("data_offsets", "is missing or not two integers");
    }
    t.begin = (*offsets)[0].get<int64_t>();
    t.end = (*offsets)[1].get<int64_t>();
    if (t.begin < 0 || t.end < t.begin || t.end > data_bytes) {
      throw field("data_offsets", "[" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
                                      "] is no byte range inside the " +
                                      std::to_string(data_bytes) + " bytes of data");
    }
    if (t.end - t.begin != bytes) {
      throw field("data_offsets", "[" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
                                      "] does not hold its shape " +
                                      c10::str(c10::IntArrayRef(t.shape)) + " of " +
                                      dtype->get<std::string>());
    }
    header.tensors[name] = std::move(t);
  }
  return header;
}

Header read_header(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw UsageError("cannot open safetensors file " + file.string());
  const auto size = static_cast<int64_t>(std::filesystem::file_size(file));
  std::string prefix(8, '\0');
  in.read(prefix.data(), 8);
  prefix.resize(static_cast<size_t>(in.gcount()));
  const uint64_t length = header_length(prefix, size, file.string());
  std::string text(length, '\0');
  if (!in.read(text.data(), static_cast<std::streamsize>(length)))
    throw corrupt(file.string(), "ends inside its header");
  return parse_header(text, size, file.string());
}

}  // namespace cohort::safetensors

#include "comm/store_frame.h"

#include <cstring>

#include "cohort/error.h"
#include "cohort/limits.h"

namespace cohort::comm {
namespace {

void put_u32(std::string& out, uint32_t v) { out.append(reinterpret_cast<const char*>(&v), 4); }

}  // namespace

std::string encode_store_frame(const StoreFrame& frame) {
  std::string body;
  body.append(reinterpret_cast<const char*>(&frame.id), 8);
  body.push_back(static_cast<char>(frame.code));
  put_u32(body, static_cast<uint32_t>(frame.fields.size()));
  for (const auto& f : frame.fields) {
    put_u32(body, static_cast<uint32_t>(f.size()));
    body += f;
  }
  std::string out;
  put_u32(out, static_cast<uint32_t>(body.size()));
  return out + body;
}

bool decode_store_frame(std::string& buffer, StoreFrame& frame) {
  if (buffer.size() < 4) return false;
  uint32_t length = 0;
  std::memcpy(&length, buffer.data(), 4);
  if (length > kMaxStoreFrame)
    throw RuntimeError("store: malformed frame (length " + std::to_string(length) + ")");
  if (buffer.size() < 4 + static_cast<size_t>(length)) return false;
  const char* p = buffer.data() + 4;
  const char* end = p + length;
  auto need = [&](size_t n) {
    if (static_cast<size_t>(end - p) < n) throw RuntimeError("store: malformed frame");
  };
  need(13);
  std::memcpy(&frame.id, p, 8);
  frame.code = static_cast<uint8_t>(p[8]);
  uint32_t count = 0;
  std::memcpy(&count, p + 9, 4);
  p += 13;
  frame.fields.clear();
  for (uint32_t i = 0; i < count; ++i) {
    need(4);
    uint32_t n = 0;
    std::memcpy(&n, p, 4);
    p += 4;
    need(n);
    frame.fields.emplace_back(p, n);
    p += n;
  }
  buffer.erase(0, 4 + static_cast<size_t>(length));
  return true;
}

}  // namespace cohort::comm

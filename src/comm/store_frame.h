// The rendezvous store's wire format (private to comm/), both ways: u32 length of the rest, u64
// request id, u8 op (request) or status (reply: 0 ok, 1 error), u32 field count, then each field
// as u32 length + bytes. Its own file so that the decoder is fuzzed alone (tests/fuzz).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace cohort::comm {

// The operations of a request.
enum StoreOp : uint8_t {
  kHello = 1,
  kSet,
  kGet,
  kAdd,
  kCheck,
  kWait,
  kDelete,
  kNumKeys,
  kCompareSet,
  kGetMany,
  kDeletePrefix,
  kStats,
};

struct StoreFrame {
  uint64_t id = 0;
  uint8_t code = 0;  // a StoreOp, or a reply's status
  std::vector<std::string> fields;
};

// The bytes of `frame` on the wire.
std::string encode_store_frame(const StoreFrame& frame);

// Takes one whole frame off the front of `buffer`; false while it is incomplete. RuntimeError for
// a malformed one (a length past kMaxStoreFrame of cohort/limits.h, fields that overrun it).
bool decode_store_frame(std::string& buffer, StoreFrame& frame);

}  // namespace cohort::comm

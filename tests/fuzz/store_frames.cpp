// Fuzz target: the rendezvous store's frames (src/comm/store_frame.h), as a server reads them
// from a client that proved the job secret. Every input is a stream of bytes: decoding never
// reads past it, never allocates what a length merely announces, and a frame decoded, encoded
// and decoded again is the same frame.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "cohort/error.h"
#include "comm/store_frame.h"

using cohort::comm::StoreFrame;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string buffer(reinterpret_cast<const char*>(data), size);
  try {
    StoreFrame frame;
    while (cohort::comm::decode_store_frame(buffer, frame)) {
      std::string again = cohort::comm::encode_store_frame(frame);
      StoreFrame copy;
      if (!cohort::comm::decode_store_frame(again, copy) || !again.empty() || copy.id != frame.id ||
          copy.code != frame.code || copy.fields != frame.fields) {
        std::abort();  // the codec does not round-trip
      }
    }
  } catch (const cohort::RuntimeError&) {
    // A malformed frame: the server closes that connection.
  }
  return 0;
}

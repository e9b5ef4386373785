// Fuzz target: the parameter server's messages (src/parallel/parameter_server_messages.h) as a
// server of a group of 4 reads them from one connection (40-byte requests, in turn) and a worker
// reads a server's 32-byte replies. A request may be refused, which closes the connection (the
// target then starts a new one); one the server serves comes from a worker of the group, the
// same worker as the connection's earlier requests, of a known kind, and a push carries a finite
// learning rate >= 0. A reply a worker takes has the magic, a known kind and the shard's size.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "parallel/parameter_server_messages.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace cohort::parallel::ps;
  constexpr int64_t kWorkers = 4, kShard = 1000;
  int64_t connection_worker = -1;
  size_t at = 0;
  while (size - at >= sizeof(Request)) {
    Request request;
    std::memcpy(&request, data + at, sizeof request);
    at += sizeof request;
    const auto why = request_refusal(request, kWorkers, connection_worker);
    if (!why.empty()) {
      connection_worker = -1;  // closed; the next request comes on a new connection
      continue;
    }
    if (request.magic != kMagic || request.worker < 0 || request.worker >= kWorkers ||
        (connection_worker >= 0 && request.worker != connection_worker) ||
        (request.kind != kPush && request.kind != kPull && request.kind != kBye) ||
        (request.kind == kPush && !(std::isfinite(request.lr) && request.lr >= 0))) {
      std::abort();
    }
    connection_worker = request.kind == kBye ? -1 : request.worker;
  }
  if (size - at >= sizeof(Reply)) {
    Reply reply;
    std::memcpy(&reply, data + at, sizeof reply);
    if (reply_accepted(reply, kShard) && (reply.magic != kMagic || reply.numel != kShard ||
                                          (reply.kind != kPush && reply.kind != kPull))) {
      std::abort();
    }
  }
  return 0;
}

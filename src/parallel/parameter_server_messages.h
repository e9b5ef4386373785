// The parameter server's messages (parallel/parameter_server.cpp): a worker's fixed-size request
// (a push's gradient follows it) and a server's fixed-size reply (the shard's parameters follow
// it), and the checks that decide whether a server serves a request or a worker takes a reply.
// Without libtorch: the fuzz target parameter_server_messages decodes them.
#pragma once
#include <cstdint>
#include <string>
#include <type_traits>

namespace cohort::parallel::ps {

inline constexpr uint32_t kMagic = 0x31535043;  // "CPS1"
enum Kind : uint32_t { kPush = 1, kPull = 2, kBye = 3 };

// A worker's message to a server; a push's gradient (numel float32) follows.
struct Request {
  uint32_t magic = kMagic;
  uint32_t kind = kPush;
  int64_t worker = 0;
  int64_t base_version = 0;  // the server's version of the parameters the gradient was taken on
  double lr = 0;
  int64_t numel = 0;
};

// A server's answer to a push or a pull; the shard's parameters (numel float32) follow.
struct Reply {
  uint32_t magic = kMagic;
  uint32_t kind = kPush;
  int64_t version = 0;
  int64_t staleness = 0;  // of the push answered: updates applied after its base version
  int64_t numel = 0;
};

// Read and written as their bytes: no padding, no pointers.
static_assert(std::is_trivially_copyable_v<Request> && sizeof(Request) == 40);
static_assert(std::is_trivially_copyable_v<Reply> && sizeof(Reply) == 32);

// Why a server of a group of `workers` refuses `request` on a connection that earlier requests
// tied to worker `connection_worker` (-1: none yet): another program's bytes (magic, kind), a
// worker outside the group or other than the connection's, a push with a learning rate that is
// not finite and >= 0. Empty when it serves it (a push's size is checked against its shard).
std::string request_refusal(const Request& request, int64_t workers, int64_t connection_worker);

// Whether a worker takes `reply` to a request for a shard of `numel` elements.
bool reply_accepted(const Reply& reply, int64_t numel);

}  // namespace cohort::parallel::ps

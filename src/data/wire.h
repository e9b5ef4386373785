// How a preprocessing worker and its consumer talk: length-prefixed JSON messages over a stream
// socket; a finished task's columns follow in a memfd passed along (local workers, no copy on the
// consumer's side) or inline after the header (workers on other hosts, over TCP).
#pragma once
#include <chrono>
#include <string>

#include "cohort/comm/job_secret.h"
#include "cohort/data/block.h"
#include "cohort/error.h"
#include "cohort/json.h"
#include "comm/socket.h"

namespace cohort::data::wire {

// The other end closed its connection (or was never there): for a worker, its consumer is done.
using PeerGone = comm::socket::PeerGone;

// Sends `header`; with `payload_fd` >= 0 passes that descriptor along (Unix sockets only).
void send(int socket, const Json& header, int payload_fd = -1);
// Reads one message; `payload_fd` gets a passed descriptor (or -1). Returns false at end of stream.
// Throws RuntimeError on a broken message or when `timeout` passes in the middle of one.
bool receive(int socket, Json& header, int& payload_fd, std::chrono::milliseconds timeout);

// Within kDefaultDataMessageTimeout (cohort/timeouts.h), as a message is read.
void write_all(int fd, const void* data, size_t bytes);
void read_all(int fd, void* data, size_t bytes, std::chrono::milliseconds timeout);

// Describes `block`'s columns into `header["columns"]` and writes their bytes: into a new memfd
// (returned) when `use_memfd`, else to `socket` right after the header (call send first with
// header["payload_bytes"] set by describe_block).
Json describe_block(const Block& block, size_t& payload_bytes);
int write_block_memfd(const Block& block, const Json& columns, size_t payload_bytes);
void write_block_inline(int socket, const Block& block);
// The consumer's side: the columns as tensors over the memfd's mapping (freed with the last one),
// or read from the socket.
Block map_block_memfd(int fd, const Json& columns, size_t payload_bytes);
Block read_block_inline(int socket, const Json& columns, size_t payload_bytes,
                        std::chrono::milliseconds timeout);

// "unix:<name>" (abstract socket) or "host:port". Returns a connected socket that proved it holds
// `secret`; throws RuntimeError (comm::SecretRefused, a UsageError, when the consumer holds
// another secret).
int connect_to(const std::string& address, const comm::JobSecret& secret,
               std::chrono::milliseconds timeout);
// Listens; `address` as above (a port of 0 picks one). Returns the socket and the bound address.
int listen_on(const std::string& address, std::string& bound);

}  // namespace cohort::data::wire

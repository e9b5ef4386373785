#include "data/wire.h"

#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <torch/types.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>

#include "cohort/error.h"
#include "cohort/limits.h"
#include "cohort/timeouts.h"
#include "comm/handshake.h"
#include "comm/socket.h"
#include "data/wire_messages.h"

namespace cohort::data::wire {

namespace {

constexpr size_t kAlign = 64;
constexpr const char* kPeer = "a preprocessing peer";

std::string errno_text() { return std::strerror(errno); }

size_t aligned(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// A message's 4-byte length prefix as a msghdr with room for one passed descriptor: the prefix
// carries the descriptor, so it arrives with the message's first bytes.
struct PrefixMessage {
  uint32_t length = 0;
  iovec io{&length, sizeof length};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))]{};
  msghdr msg{};
  PrefixMessage() {
    msg.msg_iov = &io;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
  }
  PrefixMessage(const PrefixMessage&) = delete;
  PrefixMessage& operator=(const PrefixMessage&) = delete;
};

struct Mapping {
  void* base = nullptr;
  size_t bytes = 0;
  ~Mapping() {
    if (base != nullptr && base != MAP_FAILED) ::munmap(base, bytes);
  }
};

}  // namespace

void write_all(int fd, const void* data, size_t bytes) {
  comm::socket::write_all(fd, data, bytes, kPeer, kDefaultDataMessageTimeout);
}

void read_all(int fd, void* data, size_t bytes, std::chrono::milliseconds timeout) {
  comm::socket::read_all(fd, data, bytes, timeout, kPeer);
}

void send(int socket, const Json& header, int payload_fd) {
  const std::string text = header.dump();
  const auto length = static_cast<uint32_t>(text.size());
  if (payload_fd < 0) {
    std::string message(reinterpret_cast<const char*>(&length), sizeof length);
    message += text;
    write_all(socket, message.data(), message.size());
    return;
  }
  PrefixMessage prefix;
  prefix.length = length;
  cmsghdr* cmsg = CMSG_FIRSTHDR(&prefix.msg);
  cmsg->cmsg_level = SOL_SOCKET;
  cmsg->cmsg_type = SCM_RIGHTS;
  cmsg->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(cmsg), &payload_fd, sizeof(int));
  ssize_t n;
  do {
    n = ::sendmsg(socket, &prefix.msg, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  if (n < 0 && (errno == EPIPE || errno == ECONNRESET))
    throw PeerGone("the consumer closed its connection");
  if (n != static_cast<ssize_t>(sizeof length))
    throw RuntimeError("sending a batch to the consumer failed: " + errno_text());
  write_all(socket, text.data(), text.size());
}

bool receive(int socket, Json& header, int& payload_fd, std::chrono::milliseconds timeout) {
  payload_fd = -1;
  PrefixMessage prefix;
  auto& length = prefix.length;
  ssize_t n;
  do {
    n = ::recvmsg(socket, &prefix.msg, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n == 0) return false;
  if (n < 0) {
    if (errno == ECONNRESET) return false;
    throw RuntimeError("reading from a preprocessing peer failed: " + errno_text());
  }
  for (cmsghdr* c = CMSG_FIRSTHDR(&prefix.msg); c != nullptr; c = CMSG_NXTHDR(&prefix.msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS)
      std::memcpy(&payload_fd, CMSG_DATA(c), sizeof(int));
  }
  if (static_cast<size_t>(n) < sizeof length) {
    read_all(socket, reinterpret_cast<char*>(&length) + n, sizeof length - static_cast<size_t>(n),
             timeout);
  }
  if (length > kMaxDataHeader) {
    throw RuntimeError("a preprocessing peer sent a header of " + std::to_string(length) +
                       " bytes, over the cap of " + std::to_string(kMaxDataHeader) +
                       " (kMaxDataHeader)");
  }
  std::string text(length, '\0');
  read_all(socket, text.data(), length, timeout);
  header = Json::parse(text);
  return true;
}

Json describe_block(const Block& block, size_t& payload_bytes) {
  Json columns = Json::array();
  size_t offset = 0;
  for (const auto& [name, column] : block.columns) {
    const size_t bytes = static_cast<size_t>(column.numel()) * column.element_size();
    columns.push_back({{"name", name},
                       {"dtype", c10::toString(column.scalar_type())},
                       {"shape", column.sizes().vec()},
                       {"offset", offset},
                       {"bytes", bytes}});
    offset = aligned(offset + bytes);
  }
  payload_bytes = offset;
  return columns;
}

int write_block_memfd(const Block& block, const Json& columns, size_t payload_bytes) {
  const int fd = ::memfd_create("cohort-batch", MFD_CLOEXEC);
  if (fd < 0) throw RuntimeError("memfd_create: " + errno_text());
  if (payload_bytes == 0) return fd;
  if (::ftruncate(fd, static_cast<off_t>(payload_bytes)) != 0) {
    ::close(fd);
    throw RuntimeError("cannot size shared memory for a batch of " + std::to_string(payload_bytes) +
                       " bytes: " + errno_text());
  }
  void* base = ::mmap(nullptr, payload_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    ::close(fd);
    throw RuntimeError("mmap of a batch's shared memory: " + errno_text());
  }
  size_t i = 0;
  for (const auto& [name, column] : block.columns) {
    auto c = column.contiguous().cpu();
    std::memcpy(static_cast<char*>(base) + columns[i]["offset"].get<size_t>(), c.data_ptr(),
                columns[i]["bytes"].get<size_t>());
    ++i;
  }
  ::munmap(base, payload_bytes);
  return fd;
}

void write_block_inline(int socket, const Block& block) {
  size_t offset = 0;
  static const char zeros[kAlign] = {};
  for (const auto& [name, column] : block.columns) {
    auto c = column.contiguous().cpu();
    const size_t bytes = static_cast<size_t>(c.numel()) * c.element_size();
    write_all(socket, c.data_ptr(), bytes);
    const size_t pad = aligned(offset + bytes) - (offset + bytes);
    if (pad > 0) write_all(socket, zeros, pad);
    offset = aligned(offset + bytes);
  }
}

Block map_block_memfd(int fd, const Json& columns, size_t payload_bytes) {
  std::vector<ColumnLayout> checked;
  try {
    checked = read_columns(columns, payload_bytes);
    // A region smaller than announced would fault (SIGBUS) where the tensors read past its end.
    struct stat region {};
    if (::fstat(fd, &region) != 0 || region.st_size < 0 ||
        static_cast<uint64_t>(region.st_size) < payload_bytes) {
      throw RuntimeError("a preprocessing peer passed shared memory of " +
                         std::to_string(region.st_size) + " bytes for a batch of " +
                         std::to_string(payload_bytes));
    }
  } catch (...) {
    ::close(fd);
    throw;
  }
  auto mapping = std::make_shared<Mapping>();
  mapping->bytes = payload_bytes;
  if (payload_bytes > 0) {
    mapping->base = ::mmap(nullptr, payload_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  ::close(fd);
  if (mapping->base == MAP_FAILED)
    throw RuntimeError("mmap of a batch from a preprocessing worker: " + errno_text());
  Block block;
  for (const auto& column : checked) {
    auto* data = static_cast<char*>(mapping->base) + column.offset;
    block.columns[column.name] = torch::from_blob(
        data, column.shape, [mapping](void*) {}, torch::TensorOptions(column.dtype));
  }
  return block;
}

Block read_block_inline(int socket, const Json& columns, size_t payload_bytes,
                        std::chrono::milliseconds timeout) {
  const auto checked = read_columns(columns, payload_bytes);  // before the allocation
  auto buffer = torch::empty({static_cast<int64_t>(payload_bytes)}, torch::kUInt8);
  read_all(socket, buffer.data_ptr(), payload_bytes, timeout);
  Block block;
  for (const auto& column : checked) {
    block.columns[column.name] =
        buffer.narrow(0, static_cast<int64_t>(column.offset), static_cast<int64_t>(column.bytes))
            .view(column.dtype)
            .view(column.shape);
  }
  return block;
}

int connect_to(const std::string& address, const comm::JobSecret& secret,
               std::chrono::milliseconds timeout) {
  const int fd = comm::socket::connect_to(
      address, timeout, "the consumer",
      " (is the training process running, and does it listen on that address?)");
  try {
    comm::prove_secret(fd, secret, std::chrono::steady_clock::now() + timeout,
                       "the consumer at " + address);
  } catch (...) {
    ::close(fd);
    throw;
  }
  return fd;
}

int listen_on(const std::string& address, std::string& bound) {
  return comm::socket::listen_on(address, bound, "preprocessing workers");
}

}  // namespace cohort::data::wire

#include "support/etcd_server.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <csignal>
#include <filesystem>
#include <stdexcept>
#include <thread>

namespace cohort::testing {
namespace {

// Sends one HTTP/1.0 request to 127.0.0.1:port and returns the whole reply ("" when none came
// within 2 s). HTTP/1.0, so that etcd's gateway answers without chunks and closes.
std::string http_exchange(int port, const std::string& request) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return "";
  timeval wait{.tv_sec = 2, .tv_usec = 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &wait, sizeof wait);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port));
  std::string reply;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0) {
    if (::send(fd, request.data(), request.size(), MSG_NOSIGNAL) ==
        static_cast<ssize_t>(request.size())) {
      char buffer[1024];
      ssize_t n = 0;
      while ((n = ::recv(fd, buffer, sizeof buffer, 0)) > 0)
        reply.append(buffer, static_cast<size_t>(n));
    }
  }
  ::close(fd);
  return reply;
}

// Whether etcd on 127.0.0.1:port answers GET /health with {"health":"true"}.
bool healthy(int port) {
  return http_exchange(port, "GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
             .find("\"health\":\"true\"") != std::string::npos;
}

}  // namespace

std::string etcd_binary() {
  const auto tool = std::filesystem::path(tools_dir()) / "etcd";
  if (::access(tool.c_str(), X_OK) == 0) return tool.string();
  for (const char* dir : {"/usr/bin", "/usr/local/bin"}) {
    const auto path = std::filesystem::path(dir) / "etcd";
    if (::access(path.c_str(), X_OK) == 0) return path.string();
  }
  return "";
}

std::unique_ptr<EtcdServer> EtcdServer::start(std::string& why_not) {
  const std::string binary = etcd_binary();
  if (binary.empty()) {
    why_not =
        "no etcd in " + tools_dir() + " or /usr/bin: scripts/setup.sh unpacks Debian's etcd-server";
    return nullptr;
  }
  std::unique_ptr<EtcdServer> server(new EtcdServer());
  // On memory-backed storage where there is one: etcd syncs every write, which a test's need not.
  char folder[] = "/dev/shm/cohort-etcd-XXXXXX";
  char fallback[] = "/tmp/cohort-etcd-XXXXXX";
  const char* made = ::mkdtemp(folder);
  if (made == nullptr) made = ::mkdtemp(fallback);
  if (made == nullptr) throw std::runtime_error("mkdtemp failed for etcd's data");
  server->data_dir_ = made;
  server->port_ = free_port();
  const std::string client = "http://127.0.0.1:" + std::to_string(server->port_);
  const std::string peer = "http://127.0.0.1:" + std::to_string(free_port());
  // Its log goes to a file: a pipe that nobody reads while the test runs would fill (etcd logs
  // every request it fails) and stop etcd in its next write.
  const std::string log = server->data_dir_ + "/etcd.log";
  server->process_ = std::make_unique<Process>(std::vector<std::string>{
      "/bin/sh", "-c", "exec \"$0\" \"$@\" >\"" + log + "\" 2>&1", binary, "--name", "test",
      "--data-dir", server->data_dir_ + "/data", "--listen-client-urls", client,
      "--advertise-client-urls", client, "--listen-peer-urls", peer,
      "--initial-advertise-peer-urls", peer, "--initial-cluster", "test=" + peer});
  // Serving once /health says so (what etcd logs on the way differs between its versions).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!healthy(server->port_)) {
    if (std::chrono::steady_clock::now() >= deadline || !process_alive(server->process_->pid())) {
      server->process_->wait(std::chrono::seconds(5));
      throw std::runtime_error("etcd did not serve within 60 s:\n" + read_text(log));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return server;
}

EtcdServer::~EtcdServer() {
  process_.reset();  // kills it
  std::error_code ignored;
  std::filesystem::remove_all(data_dir_, ignored);
}

std::string EtcdServer::post(const std::string& path, const std::string& body) const {
  const std::string reply = http_exchange(
      port_, "POST " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: " +
                 "application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" +
                 body);
  const size_t start = reply.find("\r\n\r\n");
  return start == std::string::npos ? "" : reply.substr(start + 4);
}

std::string EtcdServer::endpoint() const { return "etcd://127.0.0.1:" + std::to_string(port_); }

void EtcdServer::kill() {
  process_->send_signal(SIGKILL);
  process_->wait(std::chrono::seconds(10));
}

}  // namespace cohort::testing

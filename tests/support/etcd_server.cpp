#include "support/etcd_server.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <csignal>
#include <filesystem>
#include <stdexcept>

namespace cohort::testing {
namespace {

// A port no one listens on now (the kernel's pick for a socket bound to port 0).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof address;
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    if (fd >= 0) ::close(fd);
    throw std::runtime_error("no free port on 127.0.0.1");
  }
  ::close(fd);
  return ntohs(address.sin_port);
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
  server->process_ = std::make_unique<Process>(std::vector<std::string>{
      binary, "--name", "test", "--data-dir", server->data_dir_, "--listen-client-urls", client,
      "--advertise-client-urls", client, "--listen-peer-urls", peer,
      "--initial-advertise-peer-urls", peer, "--initial-cluster", "test=" + peer});
  if (!server->process_->wait_for_line("ready to serve client requests",
                                       std::chrono::seconds(60))) {
    throw std::runtime_error("etcd did not start within 60 s:\n" + server->process_->output());
  }
  return server;
}

EtcdServer::~EtcdServer() {
  process_.reset();  // kills it
  std::error_code ignored;
  std::filesystem::remove_all(data_dir_, ignored);
}

std::string EtcdServer::endpoint() const { return "etcd://127.0.0.1:" + std::to_string(port_); }

void EtcdServer::kill() {
  process_->send_signal(SIGKILL);
  process_->wait(std::chrono::seconds(10));
}

}  // namespace cohort::testing

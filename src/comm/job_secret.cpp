#include "cohort/comm/job_secret.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "cohort/error.h"

namespace cohort::comm {

JobSecret JobSecret::generate() {
  uint8_t bytes[32];
  size_t got = 0;
  while (got < sizeof bytes) {
    const ssize_t n = ::getrandom(bytes + got, sizeof bytes - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw RuntimeError(std::string("getrandom failed: ") + std::strerror(errno));
    got += static_cast<size_t>(n);
  }
  static const char* digits = "0123456789abcdef";
  JobSecret secret;
  for (uint8_t b : bytes) {
    secret.text_ += digits[b >> 4];
    secret.text_ += digits[b & 15];
  }
  return secret;
}

JobSecret JobSecret::from_text(std::string text, const std::string& source) {
  if (text.size() < kMinBytes) {
    throw UsageError(source + " holds a secret of " + std::to_string(text.size()) +
                     " bytes; a job secret needs at least " + std::to_string(kMinBytes) +
                     " (make one with: head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n')");
  }
  JobSecret secret;
  secret.text_ = std::move(text);
  return secret;
}

JobSecret JobSecret::read_file(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    throw UsageError("job secret file " + path + ": " + std::strerror(errno));
  }
  if ((st.st_mode & 077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    throw UsageError("job secret file " + path + " has mode " + mode +
                     ": others could read it; make it private with: chmod 600 " + path);
  }
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  if (!in) throw UsageError("job secret file " + path + " cannot be read");
  std::string secret = text.str();
  if (!secret.empty() && secret.back() == '\n') secret.pop_back();
  if (secret.empty()) {
    throw UsageError("job secret file " + path + " is empty: write a secret of at least " +
                     std::to_string(kMinBytes) + " bytes to it");
  }
  return from_text(std::move(secret), "job secret file " + path);
}

void JobSecret::write_file(const std::string& path) const {
  const std::string temporary = path + ".tmp-" + std::to_string(::getpid());
  const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) {
    throw RuntimeError("cannot write the job secret to " + temporary + ": " + std::strerror(errno));
  }
  const std::string line = text_ + "\n";
  const bool written = ::fchmod(fd, 0600) == 0 &&
                       ::write(fd, line.data(), line.size()) == static_cast<ssize_t>(line.size()) &&
                       ::fsync(fd) == 0;
  const int error = errno;
  ::close(fd);
  if (!written || ::rename(temporary.c_str(), path.c_str()) != 0) {
    const int why = written ? errno : error;
    ::unlink(temporary.c_str());
    throw RuntimeError("cannot write the job secret to " + path + ": " + std::strerror(why));
  }
}

std::array<uint8_t, 32> JobSecret::mac(std::string_view message) const {
  std::array<uint8_t, 32> out{};
  unsigned int length = 0;
  if (::HMAC(EVP_sha256(), text_.data(), static_cast<int>(text_.size()),
             reinterpret_cast<const unsigned char*>(message.data()), message.size(), out.data(),
             &length) == nullptr ||
      length != out.size()) {
    throw RuntimeError("HMAC-SHA256 failed (libcrypto)");
  }
  return out;
}

}  // namespace cohort::comm

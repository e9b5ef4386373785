#include "parallel/parameter_server_messages.h"

#include <cmath>

namespace cohort::parallel::ps {

std::string request_refusal(const Request& request, int64_t workers, int64_t connection_worker) {
  if (request.magic != kMagic || request.worker < 0 || request.worker >= workers ||
      (connection_worker >= 0 && request.worker != connection_worker) ||
      (request.kind != kPush && request.kind != kPull && request.kind != kBye)) {
    return "a malformed request (kind " + std::to_string(request.kind) + ", worker " +
           std::to_string(request.worker) + "): another program on its port?";
  }
  if (request.kind == kPush && !(std::isfinite(request.lr) && request.lr >= 0))
    return "a push with learning rate " + std::to_string(request.lr);
  return "";
}

bool reply_accepted(const Reply& reply, int64_t numel) {
  return reply.magic == kMagic && (reply.kind == kPush || reply.kind == kPull) &&
         reply.numel == numel;
}

}  // namespace cohort::parallel::ps

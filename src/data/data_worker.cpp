// The preprocessing worker's side: this program re-executed in the data role, serving the tasks
// of one pipeline until its consumer is done.
#include <torch/types.h>
#include <torch/utils.h>
#include <unistd.h>

#include <cstdlib>
#include <iostream>

#ifdef COHORT_WITH_OPENCV
#include <opencv2/core.hpp>
#endif

#include "cohort/data/data_iterator.h"
#include "cohort/error.h"
#include "cohort/runtime/environment.h"
#include "cohort/runtime/worker_info.h"
#include "cohort/timeouts.h"
#include "data/task_runner.h"
#include "data/wire.h"
#include "data/wire_messages.h"

namespace cohort::data {

namespace {

void serve(const Dataset& dataset, const std::string& address, const comm::JobSecret& secret) {
  torch::set_num_threads(1);  // one CPU per worker: the pool, not each worker, spreads the work
#ifdef COHORT_WITH_OPENCV
  cv::setNumThreads(1);
#endif
  const bool local = address.rfind("unix:", 0) == 0;
  const int fd = wire::connect_to(address, secret, kDefaultDataMessageTimeout);
  wire::send(fd, Json{{"type", "hello"},
                      {"pipeline", dataset.fingerprint()},
                      {"pid", ::getpid()},
                      {"host", runtime::host_name()},
                      {"local", local}});
  const auto& plan = dataset.plan();
  while (true) {
    Json message;
    int ignored = -1;
    if (!wire::receive(fd, message, ignored, kDefaultDataMessageTimeout)) break;
    if (ignored >= 0) ::close(ignored);  // a consumer passes no descriptors
    wire::ConsumerMessage m;
    try {
      m = wire::read_consumer_message(message);
    } catch (const UsageError& e) {
      throw RuntimeError("the consumer at " + address + " sent a malformed message (" + e.what() +
                         "): is it a cohort program of the same version?");
    }
    if (m.type == "stop") break;
    if (m.type == "refuse") throw UsageError("the consumer refused this worker: " + m.reason);
    if (m.type != "task") continue;
    TaskResult result = run_task(plan, m.index, m.rows, m.epoch);
    Json reply{{"type", "result"},
               {"index", m.index},
               {"epoch", m.epoch},
               {"skipped_rows", result.skipped_rows},
               {"skipped_batches", result.skipped_batches}};
    if (!result.error.empty()) {
      reply["error"] = result.error;
      wire::send(fd, reply);
      continue;
    }
    size_t bytes = 0;
    reply["columns"] = wire::describe_block(result.block, bytes);
    reply["payload_bytes"] = bytes;
    if (local) {
      const int payload = wire::write_block_memfd(result.block, reply["columns"], bytes);
      wire::send(fd, reply, payload);
      ::close(payload);
    } else {
      wire::send(fd, reply);
      wire::write_block_inline(fd, result.block);
    }
  }
  ::close(fd);
}

}  // namespace

bool serve_data_consumer(const Dataset& dataset, const std::string& address,
                         const comm::JobSecret& secret, std::string* why) {
  try {
    serve(dataset, address, secret);
    return true;
  } catch (const wire::PeerGone& e) {
    if (why != nullptr) *why = e.what();
    return false;
  }
}

void serve_if_data_worker(const Dataset& dataset) {
  if (runtime::spawned_role() != kDataRole) return;
  const std::string wanted = runtime::env_string(runtime::kDataPipelineVar);
  if (!wanted.empty() && dataset.fingerprint() != wanted) return;
  const std::string address = runtime::env_string(runtime::kDataAddressVar);
  int code = 0;
  if (address.empty()) {
    std::cerr << "cohort data worker: " << runtime::kDataAddressVar
              << " is not set: it names the consumer to connect to "
              << "(host:port of the training process's ExecutionOptions::listen_address)"
              << std::endl;
    code = 2;
  } else {
    try {
      serve(dataset, address, runtime::job_secret_from_env().value_or(comm::JobSecret()));
    } catch (const wire::PeerGone&) {
      // The consumer finished (or ended) before this worker was of use: nothing to report.
    } catch (const std::exception& e) {
      std::cerr << "cohort data worker " << ::getpid() << ": " << e.what() << std::endl;
      code = 1;
    }
  }
  std::cout.flush();
  std::cerr.flush();
  ::_exit(code);
}

}  // namespace cohort::data

#include "support/local_group.h"

#include <thread>

namespace cohort::testing {

void run_ranks(int world, const std::function<void(comm::ProcessGroup&)>& fn,
               comm::ProcessGroupOptions options) {
  auto server = comm::Store::connect({.is_server = true, .timeout = std::chrono::seconds(20)});
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(world);
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        auto store =
            comm::Store::connect({.port = server.port(), .timeout = std::chrono::seconds(20)});
        auto group = comm::ProcessGroup::create(store, rank, world, options);
        fn(group);
      } catch (...) {
        errors[rank] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace cohort::testing

// The control plane's figures (issue 19):
//   rendezvous  the store serving a rendezvous (every rank connects and publishes an address,
//               reading all the others') plus one barrier, for 64, 256 and 1,024 simulated ranks
//               (threads, each its own client on loopback, each proving the job secret as
//               every connection does); seconds, goal < 5 s for 1,024.
//   growth      keys and bytes the run's store holds after N steps of 2 ranks reading through
//               get_dataset_shard (a report every 100 steps): with the batch agreement cohort
//               uses (an all-reduce, report keys deleted when done), and with the per-batch store
//               barrier get_dataset_shard used before, replayed here through the same store.
// Usage: control_plane [--part rendezvous|growth|all] [--ranks 64,256,1024] [--steps 10000]
#include <sys/resource.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <iostream>
#include <thread>

#include "cohort/cohort.h"
#include "train/worker_session.h"

namespace {

using Clock = std::chrono::steady_clock;

double rendezvous_seconds(int ranks) {
  const auto secret = cohort::comm::JobSecret::generate();
  auto server = cohort::comm::Store::connect({.is_server = true,
                                              .timeout = std::chrono::seconds(120),
                                              .job_id = "bench",
                                              .secret = secret});
  std::vector<std::thread> threads;
  std::vector<std::string> errors(static_cast<size_t>(ranks));
  const auto start = Clock::now();
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto client = cohort::comm::Store::connect({.port = server.port(),
                                                    .timeout = std::chrono::seconds(120),
                                                    .job_id = "bench",
                                                    .secret = secret});
        const auto addresses =
            client.arrive_and_wait("rdzv/", r, ranks, "127.0.0.1:" + std::to_string(20000 + r),
                                   "join the rendezvous", std::chrono::seconds(120));
        if (addresses.size() != static_cast<size_t>(ranks)) throw std::runtime_error("short");
        client.arrive_and_wait("barrier/", r, ranks, "1", "reach the barrier",
                               std::chrono::seconds(120));
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  for (size_t r = 0; r < errors.size(); ++r) {
    if (!errors[r].empty()) {
      throw cohort::RuntimeError("rank " + std::to_string(r) + ": " + errors[r]);
    }
  }
  return seconds;
}

// The agreement get_dataset_shard made before: a store barrier per batch, keys never deleted.
void use_store_barrier_agreement(cohort::data::DataIterator& it) {
  auto* session = cohort::train::current_session();
  const int rank = session->context.world_rank;
  const int world = session->context.world_size;
  const std::string prefix = "data/" + session->run_token + "/train#1/";
  it.set_batch_agreement([session, prefix, rank, world](int64_t epoch, int64_t batch, bool have) {
    const auto values = session->store.arrive_and_wait(
        prefix + std::to_string(epoch) + "/" + std::to_string(batch) + "/", rank, world,
        have ? "1" : "0", "reach the batch", session->collective_timeout);
    return std::all_of(values.begin(), values.end(), [](const std::string& v) { return v == "1"; });
  });
}

void growth_loop(const cohort::Json& c) {
  auto it = cohort::train::get_dataset_shard("train");
  if (c["agreement"] == "store") use_store_barrier_agreement(it);
  int64_t step = 0;
  for (auto& batch : it.iter_batches({.batch_size = 1})) {
    (void)batch;
    if (++step % 100 == 0) cohort::train::report({{"step", step}});
  }
  if (cohort::train::get_context().get_world_rank() == 0) {
    const auto stats = cohort::train::current_session()->store.stats();
    cohort::train::report({{"step", step}, {"keys", stats.keys}, {"bytes", stats.bytes}});
  } else {
    cohort::train::report({{"step", step}});
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"cohort control-plane figures"};
  std::string part = "all";
  std::vector<int> ranks{64, 256, 1024};
  int64_t steps = 10'000;
  app.add_option("--part", part)->check(CLI::IsMember({"rendezvous", "growth", "all"}));
  app.add_option("--ranks", ranks)->delimiter(',');
  app.add_option("--steps", steps);
  CLI11_PARSE(app, argc, argv);

  // 2 workers x `steps` rows: each rank reads `steps` batches of one row.
  const auto rows = torch::arange(2 * steps, torch::kFloat).unsqueeze(1);
  std::map<std::string, cohort::data::Dataset> datasets{
      {"train", cohort::data::Dataset::from_tensors({{"x", rows}})}};
  if (cohort::runtime::is_spawned_worker()) {
    cohort::Trainer(growth_loop, {.num_workers = 2}, {}, {}, datasets).fit();
  }

  if (part == "rendezvous" || part == "all") {
    // Each simulated rank holds a client socket and the server its end of it.
    rlimit files{};
    ::getrlimit(RLIMIT_NOFILE, &files);
    files.rlim_cur = files.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &files);
    std::printf("%-8s %14s\n", "ranks", "rendezvous+barrier_s");
    for (int n : ranks) std::printf("%-8d %14.3f\n", n, rendezvous_seconds(n));
    std::fflush(stdout);
  }
  if (part == "growth" || part == "all") {
    std::printf("%-34s %8s %10s %10s\n", "agreement", "steps", "keys", "bytes");
    for (const std::string agreement : {"store", "collective"}) {
      const auto dir = std::filesystem::temp_directory_path() / "cohort_control_plane";
      std::filesystem::remove_all(dir);
      cohort::Trainer trainer(growth_loop, {.num_workers = 2},
                              {.name = agreement, .storage_path = dir, .verbose = 0},
                              {{"agreement", agreement}}, datasets);
      const auto result = trainer.fit();
      std::filesystem::remove_all(dir);
      if (!result.ok()) {
        std::cerr << "error: " << *result.error << std::endl;
        return 1;
      }
      std::printf("%-34s %8lld %10lld %10lld\n",
                  agreement == "store" ? "before: a store barrier per batch"
                                       : "after: all-reduce, keys deleted",
                  static_cast<long long>(result.metrics["step"].get<int64_t>()),
                  static_cast<long long>(result.metrics["keys"].get<int64_t>()),
                  static_cast<long long>(result.metrics["bytes"].get<int64_t>()));
      std::fflush(stdout);
    }
  }
  return 0;
}

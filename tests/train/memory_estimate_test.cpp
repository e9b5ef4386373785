#include "cohort/train/memory_estimate.h"

#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>
#include <malloc.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include "cohort/error.h"
#include "cohort/parallel/fully_shard.h"
#include "cohort/runtime/heap.h"

namespace cohort::train {
namespace {

// Four units of 1000 x 1000 + 1000 elements each: P = 4,004,000 fp32 parameters.
constexpr int64_t kUnit = 1000 * 1000 + 1000;
constexpr int64_t kP = 4 * kUnit;

ModelSpec four_units() {
  torch::nn::Sequential net;
  for (int i = 0; i < 4; ++i) net->push_back(parallel::FullyShard(torch::nn::Linear(1000, 1000)));
  return {.module = net.ptr(),
          .forward = [net](const at::Tensor& x) mutable { return net->forward(x); },
          .layers = net};
}

std::map<std::string, int64_t> items_of(const MemoryEstimate& e) {
  std::map<std::string, int64_t> out;
  for (const auto& item : e.items) out[item.name] = item.bytes;
  return out;
}

// The ZeRO paper's forms for fp32 Adam on 4 workers (16, 8 + 8/N, 4 + 12/N, 16/N bytes per
// parameter), with what the engines add: ZeRO-1's whole gradient beside its shard, ZeRO-2's two
// buckets in flight, ZeRO-3's largest unit gathered and the next one prefetched (and the buffers
// their all-gathers send from).
TEST(MemoryEstimate, EachStageHoldsThePapersFormsPlusWhatItsEngineAdds) {
  const auto spec = four_units();
  const MemoryEstimateOptions options{.world_size = 4, .optimizer_states = 2};
  const auto at = [&](int stage, int shard_group_size = 0, int64_t prefetch_bucket = kUnit) {
    Plan plan;
    plan.zero.stage = stage;
    plan.zero.shard_group_size = shard_group_size;
    plan.zero.reduce_bucket_size = kUnit;
    plan.zero.param_persistence_threshold = 0;
    plan.zero.prefetch_bucket_size = prefetch_bucket;
    return items_of(estimate_memory(spec, plan, options));
  };
  auto ddp = at(0);
  EXPECT_EQ(ddp["parameters"], 4 * kP);
  EXPECT_EQ(ddp["gradients"], 4 * kP);
  EXPECT_EQ(ddp["optimizer state"], 8 * kP);
  auto one = at(1);
  EXPECT_EQ(one["parameters"], 4 * kP);
  EXPECT_EQ(one["gradients"], 4 * kP + kP);
  EXPECT_EQ(one["optimizer state"], 2 * kP);
  auto two = at(2);
  EXPECT_EQ(two["gradients"], kP);
  EXPECT_EQ(two["gradient buckets"], 2 * kUnit * 4 * 2);
  EXPECT_EQ(two["optimizer state"], 2 * kP);
  auto three = at(3);
  EXPECT_EQ(three["parameters"], kP);
  EXPECT_EQ(three["gathered units"], 2 * kUnit * 4);      // the running unit and the next
  EXPECT_EQ(three["all-gather buffers"], 2 * kUnit * 4);  // their sends' buffers on Gloo
  EXPECT_EQ(two.count("all-gather buffers"), 0u);
  // The next unit is gathered ahead even with a bucket smaller than it; none with a bucket of 0.
  EXPECT_EQ(at(3, 0, kUnit / 2)["gathered units"], 2 * kUnit * 4);
  EXPECT_EQ(at(3, 0, 0)["gathered units"], kUnit * 4);
  // Whole units ahead, as many as fit the bucket: two in a bucket of two and a half (the
  // estimate once counted the bucket's elements, half a unit more than the engine gathers), the
  // three there are in a larger one; none past max_live_parameters.
  EXPECT_EQ(at(3, 0, 5 * kUnit / 2)["gathered units"], 3 * kUnit * 4);
  EXPECT_EQ(at(3, 0, 10 * kUnit)["gathered units"], 4 * kUnit * 4);
  {
    Plan plan;
    plan.zero.stage = 3;
    plan.zero.param_persistence_threshold = 0;
    plan.zero.prefetch_bucket_size = 10 * kUnit;
    plan.zero.max_live_parameters = 5 * kUnit / 2;
    EXPECT_EQ(items_of(estimate_memory(spec, plan, options))["gathered units"], 2 * kUnit * 4);
  }
  EXPECT_EQ(three["optimizer state"], 2 * kP);
  // Sharding groups of 2: half the state, not a quarter.
  auto hsdp = at(2, 2);
  EXPECT_EQ(hsdp["optimizer state"], 4 * kP);
  EXPECT_EQ(hsdp["gradients"], 2 * kP);
  // Asynchronous checkpoints keep their files' buffers: the whole model, and the optimizer state
  // the worker holds (all of it under DDP, its shard under ZeRO).
  for (const auto& [stage, bytes] :
       {std::pair{0, 4 * kP + 8 * kP}, std::pair{1, 4 * kP + 2 * kP}}) {
    Plan plan;
    plan.zero.stage = stage;
    EXPECT_EQ(items_of(estimate_memory(spec, plan,
                                       {.world_size = 4,
                                        .optimizer_states = 2,
                                        .async_checkpoint = true}))["checkpoint buffers"],
              bytes)
        << stage;
  }
  EXPECT_EQ(ddp.count("checkpoint buffers"), 0u);
  EXPECT_EQ(ddp.count("snapshots (memory-backed storage)"), 0u);
  // Snapshots: the same buffers, and on the node's tmpfs the newest two of the worker's files
  // and two buddy copies of another's.
  {
    auto kept = items_of(
        estimate_memory(spec, Plan{}, {.world_size = 4, .optimizer_states = 2, .snapshots = true}));
    EXPECT_EQ(kept["checkpoint buffers"], 4 * kP + 8 * kP);
    EXPECT_EQ(kept["snapshots (memory-backed storage)"], 4 * (4 * kP + 8 * kP));
  }
  // A flat optimizer under DDP keeps its own gradient buffer.
  Plan ddp_plan;
  EXPECT_EQ(items_of(estimate_memory(
                spec, ddp_plan,
                {.world_size = 4, .optimizer_states = 2, .flat_optimizer = true}))["gradients"],
            8 * kP);
}

TEST(MemoryEstimate, APipelineHoldsItsHeaviestStageTheWholeModelAndItsMicroBatchesInFlight) {
  const auto spec = four_units();
  Plan plan{.pp = 2, .schedule = parallel::pipeline::ScheduleKind::kGPipe, .micro_batches = 8};
  const MemoryEstimateOptions options{
      .world_size = 2, .optimizer_states = 1, .activation_bytes = 1000};
  auto gpipe = items_of(estimate_memory(spec, plan, options));
  EXPECT_EQ(gpipe["parameters"], 4 * 2 * kUnit);
  EXPECT_EQ(gpipe["optimizer state"], 4 * 2 * kUnit);
  EXPECT_EQ(gpipe["activations"], 1000 / 2 * 8);  // half the model, all 8 micro-batches
  // The whole model stays on every worker (for evaluation and checkpoints): the other stage too.
  EXPECT_EQ(gpipe["the model's other stages"], 4 * 2 * kUnit);
  EXPECT_EQ(gpipe.count("the dense model"), 0u);
  plan.schedule = parallel::pipeline::ScheduleKind::kOneFOneB;
  EXPECT_EQ(items_of(estimate_memory(spec, plan, options))["activations"], 1000 / 2 * 2);
  // Tensor parallelism: this worker's slices of every stage, and the dense model beside them.
  auto sliced = items_of(estimate_memory(spec, Plan{.pp = 2, .tp = 2}, {.world_size = 4}));
  EXPECT_EQ(sliced["parameters"], 4 * kUnit);
  EXPECT_EQ(sliced["the model's other stages"], 4 * kUnit);
  EXPECT_EQ(sliced["the dense model"], 4 * kP);
  EXPECT_EQ(
      items_of(estimate_memory(spec, Plan{}, {.world_size = 4})).count("the model's other stages"),
      0u);
  // ZeRO 2 and 3 over a pipeline's dp group of 2: the stage's gradient shard, and its whole
  // gradient, which the step's micro-batches add up in until its last backward reduce-scatters
  // it; stage 3 the parameters' shards between steps. Without a pipeline, gradient accumulation
  // holds the whole gradient as well, a single micro-batch does not.
  for (const int stage : {2, 3}) {
    Plan zero{.pp = 2};
    zero.zero.stage = stage;
    zero.zero.param_persistence_threshold = 0;
    auto sharded = items_of(estimate_memory(spec, zero, {.world_size = 4}));
    EXPECT_EQ(sharded["gradients"], 4 * 2 * kUnit / 2 + 4 * 2 * kUnit) << stage;
    EXPECT_EQ(sharded["parameters"], stage == 3 ? 4 * kUnit : 4 * 2 * kUnit) << stage;
    // Stage 2's one bucket (the stage's whole gradient of two units), staged and received; stage
    // 3's units, a bucket each, two in flight, each staged and received.
    EXPECT_EQ(sharded["gradient buckets"], stage == 2 ? 2 * (4 * 2 * kUnit) : 2 * 2 * (4 * kUnit))
        << stage;
    // What shrinks them: stage 2's bucket size; at stage 3 the units, not the bucket size.
    for (const auto& item : estimate_memory(spec, zero, {.world_size = 4}).items) {
      if (item.name != "gradient buckets") continue;
      EXPECT_NE(item.shrink.find(stage == 2 ? "a smaller reduce_bucket_size"
                                            : "each unit is a bucket of its own"),
                std::string::npos)
          << item.shrink;
    }
    Plan accumulating{.gradient_accumulation_steps = 2};
    accumulating.zero.stage = stage;
    EXPECT_EQ(items_of(estimate_memory(spec, accumulating, {.world_size = 4}))["gradients"],
              kP + 4 * kP)
        << stage;
    accumulating.gradient_accumulation_steps = 1;
    EXPECT_EQ(items_of(estimate_memory(spec, accumulating, {.world_size = 4}))["gradients"], kP)
        << stage;
  }
}

TEST(MemoryEstimate, ABudgetItDoesNotFitNamesTheLargestItemAndTheFix) {
  const auto estimate =
      estimate_memory(four_units(), Plan{}, {.world_size = 2, .runtime_bytes = 500'000'000});
  EXPECT_EQ(estimate.total(), 16 * kP + 500'000'000);
  EXPECT_EQ(estimate.largest().name, "optimizer state");  // the runtime is larger, and no option
  estimate.check_budget(estimate.total());                // fits exactly
  try {
    estimate.check_budget(100'000'000);
    FAIL() << "over budget, taken";
  } catch (const UsageError& e) {
    EXPECT_EQ(std::string(e.what()),
              "the plan needs about 564.1 MB per worker, over --memory-budget 100.0 MB; the "
              "largest item is optimizer state (32.0 MB): --zero-stage 1 shards it over the "
              "workers, or --offload-optimizer disk:PATH streams it from files");
  }
  EXPECT_THROW(estimate_memory(four_units(), Plan{.zero = {.stage = 2, .shard_group_size = 3}},
                               {.world_size = 4}),
               UsageError);
}

// Snapshots that tip a plan over its budget are named, with what the plan needs without them: the
// largest item is not what to shrink then.
TEST(MemoryEstimate, SnapshotsThatTipAPlanOverItsBudgetAreNamedFirst) {
  const MemoryEstimateOptions plain{.world_size = 2, .runtime_bytes = 500'000'000};
  // One model for the three estimates: a test after this one measures the process's memory.
  const auto spec = four_units();
  const auto without = estimate_memory(spec, Plan{}, plain);
  auto options = plain;
  options.snapshots = true;
  const auto with = estimate_memory(spec, Plan{}, options);
  // The buffers (the parameters and Adam's two states, 12 bytes a parameter) and four copies.
  ASSERT_EQ(with.total() - without.total(), 5 * 12 * kP);
  try {
    with.check_budget(without.total());  // fits without the snapshots, exactly
    FAIL() << "over budget, taken";
  } catch (const UsageError& e) {
    EXPECT_EQ(std::string(e.what()),
              "the plan needs about 804.3 MB per worker, over --memory-budget 564.1 MB; in-memory "
              "snapshots (--snapshot-every-steps) hold 240.2 MB of it (checkpoint buffers and "
              "snapshots (memory-backed storage)), and without them it needs 564.1 MB: a larger "
              "--snapshot-every-steps does not shrink it; leave snapshots out, or shard the state "
              "with --zero-stage");
  }
  // Over the budget even without them: the largest item, as without snapshots.
  try {
    with.check_budget(without.total() - 1);
    FAIL() << "over budget, taken";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("the largest item is snapshots (memory-backed storage)"),
              std::string::npos)
        << e.what();
  }
  // With asynchronous checkpoints too, their buffers stay without the snapshots.
  options.async_checkpoint = true;
  try {
    estimate_memory(spec, Plan{}, options).check_budget(without.total() + 13 * kP);
    FAIL() << "over budget, taken";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("in-memory snapshots (--snapshot-every-steps) hold 192.2 "
                                         "MB of it (snapshots (memory-backed storage))"),
              std::string::npos)
        << e.what();
  }
}

// The table's figures stand in one column, after the longest item's name (ZeRO-3's "all-gather
// buffers" is longer than the 18 characters the short names take).
TEST(MemoryEstimate, TheTablesFiguresStandInOneColumn) {
  Plan plan;
  plan.zero.stage = 3;
  plan.zero.param_persistence_threshold = 0;
  const auto table = estimate_memory(four_units(), plan, {.world_size = 4}).table();
  std::istringstream lines(table);
  std::set<size_t> columns;
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("  (", 0) == 0) continue;
    const auto colon = line.find(':');
    ASSERT_NE(colon, std::string::npos) << line;
    const auto figure = line.find_first_not_of(' ', colon + 1);
    EXPECT_GT(figure, colon + 1) << "no space before the figure: " << line;
    columns.insert(figure);
  }
  EXPECT_EQ(columns.size(), 1u) << table;
  EXPECT_NE(table.find("  all-gather buffers: "), std::string::npos) << table;
}

// With the parameters on a GPU, --offload-optimizer cpu moves the optimizer state, float32
// masters and a gradient copy to the host, beside the total (the GPU's); on a CPU run it changes
// nothing. With disk:PATH on a GPU the host holds a chunk of the state, the masters and the copy.
TEST(MemoryEstimate, StateOnTheHostLeavesTheGpu) {
  Plan plan;
  const auto in_memory = estimate_memory(four_units(), plan, {.optimizer_states = 2, .gpu = true});
  plan.offload_optimizer = parse_optimizer_offload("cpu");
  const auto on_cpu = estimate_memory(four_units(), plan, {.optimizer_states = 2});
  EXPECT_EQ(on_cpu.total(), in_memory.total());
  EXPECT_EQ(on_cpu.host_bytes, 0);
  const auto host = estimate_memory(four_units(), plan, {.optimizer_states = 2, .gpu = true});
  EXPECT_EQ(items_of(host).count("optimizer state"), 0u) << host.table();
  EXPECT_EQ(host.total(), in_memory.total() - 8 * kP);
  EXPECT_EQ(host.host_bytes, 16 * kP);
  EXPECT_NE(host.table().find("in host memory, beside the total: the optimizer state, float32 "
                              "masters and a gradient copy, 64.1 MB"),
            std::string::npos)
      << host.table();
  // ZeRO over 4 workers: a quarter of it each.
  plan.zero.stage = 2;
  EXPECT_EQ(
      estimate_memory(four_units(), plan, {.world_size = 4, .optimizer_states = 2, .gpu = true})
          .host_bytes,
      4 * kP);
  plan.zero.stage = 0;
  plan.offload_optimizer =
      parse_optimizer_offload("disk:" + std::filesystem::temp_directory_path().string());
  const auto disk = estimate_memory(four_units(), plan, {.optimizer_states = 2, .gpu = true});
  EXPECT_EQ(disk.disk_bytes, 8 * kP);
  EXPECT_EQ(disk.host_bytes, 8 * kP + 2 * 2 * (int64_t{1} << 20));
}

// With the state on disk, memory holds a chunk of it; the folder is checked for room first.
TEST(MemoryEstimate, StateOnDiskLeavesMemoryAndNeedsRoomThere) {
  Plan plan;
  plan.offload_optimizer =
      parse_optimizer_offload("disk:" + std::filesystem::temp_directory_path().string());
  const auto estimate = estimate_memory(four_units(), plan, {.optimizer_states = 2});
  EXPECT_EQ(estimate.disk_bytes, 8 * kP);
  EXPECT_EQ(items_of(estimate)["optimizer state"], 2 * 2 * (int64_t{1} << 20));
  EXPECT_NE(estimate.table().find("on disk, beside the total: the optimizer state, 32.0 MB"),
            std::string::npos)
      << estimate.table();
  check_offload_room(plan.offload_optimizer, estimate.disk_bytes);  // room for 32 MB
  try {
    check_offload_room(plan.offload_optimizer, int64_t{1} << 60);
    FAIL() << "an exabyte fitted";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("the optimizer state needs 1152921504606.8 MB there"),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("free: choose a folder on a disk with room"),
              std::string::npos);
  }
  EXPECT_THROW(check_offload_room(parse_optimizer_offload("disk:/nonexistent-cohort"), 1),
               UsageError);
}

// Bytes of the distinct storages behind `tensors`.
int64_t storage_bytes(const std::vector<at::Tensor>& tensors) {
  std::set<const void*> seen;
  int64_t bytes = 0;
  for (const auto& t : tensors) {
    if (t.defined() && seen.insert(t.storage().unsafeGetStorageImpl()).second)
      bytes += static_cast<int64_t>(t.storage().nbytes());
  }
  return bytes;
}

// Blocks freed between live ones stay in glibc's heap, resident, until release_free_memory gives
// them back: 2,000 tensors of 96 KiB (below glibc's threshold for a mapping of their own), nine in
// ten freed, are about 170 MB the process holds without using.
TEST(MemoryEstimate, ReleaseFreeMemoryGivesTheHeapsFreeBlocksBack) {
  if (resident_bytes() == 0) GTEST_SKIP() << "no /proc/self/status: not Linux";
#ifdef __SANITIZE_ADDRESS__
  GTEST_SKIP() << "built with AddressSanitizer, whose allocator replaces glibc's heap";
#endif
  release_free_memory();
  std::vector<at::Tensor> kept;
  {
    std::vector<at::Tensor> all;
    for (int i = 0; i < 2000; ++i) all.push_back(torch::ones({96 * 1024 / 4}));
    for (size_t i = 0; i < all.size(); i += 10) kept.push_back(all[i]);
  }
  const int64_t released = release_free_memory();
  EXPECT_GT(released, int64_t{100} << 20) << "resident memory fell by " << released << " bytes";
  EXPECT_LT(release_free_memory(), int64_t{16} << 20) << "nothing more to give back";
  for (const auto& t : kept) ASSERT_EQ(t.sum().item<float>(), 96 * 1024 / 4);
}

// A process's peak counts what it touched and freed since, and a process it starts has a peak of
// its own, not this one's (which getrusage's ru_maxrss would give the child at its start).
TEST(MemoryEstimate, PeakResidentBytesIsEachProcessesOwn) {
  if (resident_bytes() == 0) GTEST_SKIP() << "no /proc/self/status: not Linux";
  constexpr size_t kTouched = size_t{128} << 20;
  // A mapping of its own, not the heap: whether the heap gives freed memory back depends on what
  // ran before.
  const auto touch = [] {
    void* block =
        mmap(nullptr, kTouched, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (block == MAP_FAILED) return static_cast<char*>(nullptr);
    std::memset(block, 1, kTouched);
    return static_cast<char*>(block);
  };
  const int64_t before = resident_bytes();
  char* block = touch();
  ASSERT_NE(block, nullptr);
  munmap(block, kTouched);
  const int64_t peak = peak_resident_bytes();
  EXPECT_GE(peak, before + static_cast<int64_t>(kTouched) * 9 / 10);
  EXPECT_LT(resident_bytes(), peak - static_cast<int64_t>(kTouched) / 2) << "given back";

  block = touch();  // this process holds it while the child starts
  ASSERT_NE(block, nullptr);
  pid_t child = 0;
  char sleep_path[] = "/bin/sleep", seconds[] = "30";
  char* argv[] = {sleep_path, seconds, nullptr};
  ASSERT_EQ(posix_spawn(&child, sleep_path, nullptr, nullptr, argv, environ), 0);
  // Until it runs sleep (its /proc comm names it), it is a copy of this process.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  std::string name;
  while (name != "sleep" && std::chrono::steady_clock::now() < deadline) {
    std::ifstream comm("/proc/" + std::to_string(child) + "/comm");
    std::getline(comm, name);
    if (name != "sleep") std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(name, "sleep");
  const int64_t child_peak = peak_resident_bytes(child);
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  EXPECT_GT(child_peak, 0);
  EXPECT_LT(child_peak, static_cast<int64_t>(kTouched) / 4) << "sleep's own, not this process's";
  munmap(block, kTouched);
}

// Runs `expectations` and ends the process: with 0 where they held, else with 1 after writing their
// failures to stderr, which a death test shows.
[[noreturn]] void exit_with_the_failures_of(void (*expectations)()) {
  ::testing::TestPartResultArray failures;
  {
    const ::testing::ScopedFakeTestPartResultReporter collect(
        ::testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &failures);
    expectations();
  }
  for (int i = 0; i < failures.size(); ++i) std::cerr << failures.GetTestPartResult(i);
  std::exit(failures.size() == 0 ? 0 : 1);
}

// The body of TheFormsMatchWhatTheProcessHoldsAfterAStep, run in a process of its own.
void expect_the_forms_match_what_the_process_holds_after_a_step() {
  // Every tensor of 64 KiB or more gets its own mapping, given back when it is freed: without a
  // fixed threshold glibc raises it as tensors are freed and keeps the optimizer's temporaries in
  // per-thread heaps, more of them the more threads the machine has.
  ASSERT_EQ(mallopt(M_MMAP_THRESHOLD, 64 * 1024), 1);
  // A first step on another net pages in the code of libtorch's kernels, which resident memory
  // counts too (how much depends on how the binary happens to be laid out): then the step
  // measured holds what the forms count.
  {
    auto warm = four_units();
    torch::optim::Adam adam(warm.module->parameters(), torch::optim::AdamOptions(1e-3));
    warm.forward(torch::randn({8, 1000})).sum().backward();
    adam.step();
  }
  malloc_trim(0);  // what was freed into the heaps before, as resident pages, is given back
  const int64_t before = resident_bytes();
  auto spec = four_units();
  auto* net = spec.module.get();
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-3));
  const auto x = torch::randn({8, 1000});
  const int64_t activations = measure_step_memory(*net, [&] { spec.forward(x).sum().backward(); });
  adam.step();
  const int64_t held = resident_bytes() - before;
  const auto items = items_of(estimate_memory(spec, Plan{}, {.optimizer_states = 2}));
  std::vector<at::Tensor> parameters, gradients, state;
  for (const auto& p : net->parameters()) {
    parameters.push_back(p);
    gradients.push_back(p.grad());
  }
  for (const auto& item : adam.state()) {
    const auto& s = static_cast<const torch::optim::AdamParamState&>(*item.second);
    state.push_back(s.exp_avg());
    state.push_back(s.exp_avg_sq());
  }
  EXPECT_EQ(items.at("parameters"), storage_bytes(parameters));
  EXPECT_EQ(items.at("gradients"), storage_bytes(gradients));
  EXPECT_EQ(items.at("optimizer state"), storage_bytes(state));
  ASSERT_GT(activations, 0);
  const auto estimate =
      estimate_memory(spec, Plan{}, {.optimizer_states = 2, .activation_bytes = activations});
  EXPECT_NEAR(static_cast<double>(held), static_cast<double>(estimate.total()),
              0.1 * static_cast<double>(estimate.total()))
      << "held " << held << " bytes, estimated " << estimate.total();
  // A step that allocates 64 MiB and frees it peaks about that far above its start.
  const int64_t peak = measure_step_memory(*net, [] {
    auto big = torch::ones({16 * 1024 * 1024});
    ASSERT_EQ(big.sum().item<double>(), 16.0 * 1024 * 1024);
  });
  EXPECT_GE(peak, 60 * 1024 * 1024);
  EXPECT_LT(peak, 80 * 1024 * 1024);
}

// What the estimate counts is what the process then holds: exactly the live parameters, gradients
// and Adam state of a model of 4 M parameters after a step; and the resident memory the process
// grew by, from before the model to after the step, within 10% of the whole estimate (which counts
// the step's activations, freed by the time it is measured).
TEST(MemoryEstimate, TheFormsMatchWhatTheProcessHoldsAfterAStep) {
  if (resident_bytes() == 0) GTEST_SKIP() << "no /proc/self/status: not Linux";
#ifdef __SANITIZE_ADDRESS__
  GTEST_SKIP() << "built with AddressSanitizer, whose allocator replaces glibc's: no mallopt, and "
                  "resident memory holds its shadow and quarantine";
#endif
  // A worker measures its steps in a process of its own, and so does this test: in a process that
  // ran the other tests of this file first, the step grew resident memory by 8 MB more than alone
  // (anonymous memory, not code), or not, with how many ran before. The threadsafe style runs this
  // binary again for this test alone, and prints the failures it collects there.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(exit_with_the_failures_of(expect_the_forms_match_what_the_process_holds_after_a_step),
              ::testing::ExitedWithCode(0), "");
}

// A probe in a process that has run before counts the step's tensors, also where they reuse
// memory the process already holds (which the resident high-water mark does not see): here 32 MiB
// of small tensors, in a heap that keeps the 32 MiB just freed from the same sizes.
TEST(MemoryEstimate, AStepIsMeasuredWhereItReusesMemoryTheProcessHolds) {
  if (resident_bytes() == 0) GTEST_SKIP() << "no /proc/self/status: not Linux";
  auto net = torch::nn::Linear(4, 4);
  const auto small_tensors = [] {
    std::vector<at::Tensor> held;
    for (int i = 0; i < 512; ++i) held.push_back(torch::ones({64 * 1024 / 4}));  // 64 KiB each
    return held;
  };
  // The same sizes allocated and freed just before, below a tensor that stays: resident in the
  // heap, where the step's tensors find them.
  at::Tensor stays;
  {
    const auto before = small_tensors();
    stays = torch::ones({16});
  }
  const int64_t peak = measure_step_memory(*net, [&] {
    const auto held = small_tensors();
    ASSERT_EQ(held.size(), 512u);
  });
  ASSERT_EQ(stays.sum().item<float>(), 16);
  EXPECT_GE(peak, int64_t{32} << 20);
  EXPECT_LT(peak, int64_t{48} << 20);
}

// The same where a worker's steps take their tensors from the tensor cache
// (runtime::heap_for_steps): the blocks the last step freed are resident, and the probe counts the
// step's tensors as the cache tells libtorch's profiler of them.
TEST(MemoryEstimate, AStepIsMeasuredWhereItReusesTheTensorCachesBlocks) {
  if (resident_bytes() == 0) GTEST_SKIP() << "no /proc/self/status: not Linux";
  if (!runtime::heap_is_cohorts()) GTEST_SKIP() << "this process's heap is not left to cohort";
  runtime::install_tensor_cache();
  auto net = torch::nn::Linear(4, 4);
  const auto activations = [] {
    std::vector<at::Tensor> held;
    for (int i = 0; i < 32; ++i) held.push_back(torch::ones({(1 << 20) / 4}));  // 1 MiB each
    return held;
  };
  (void)activations();  // the last step's, kept by the cache
  ASSERT_GE(runtime::tensor_cache_stats().cached_bytes, int64_t{32} << 20);
  const int64_t peak = measure_step_memory(*net, [&] {
    const auto held = activations();
    ASSERT_EQ(held.size(), 32u);
  });
  EXPECT_GE(peak, int64_t{32} << 20);
  EXPECT_LT(peak, int64_t{48} << 20);
}

}  // namespace
}  // namespace cohort::train

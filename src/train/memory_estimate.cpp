#include "cohort/train/memory_estimate.h"

#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <variant>

#include "cohort/error.h"
#include "cohort/parallel/fully_shard.h"
#include "cohort/parallel/pipeline/pipeline.h"
#include "cohort/parallel/pipeline/schedule.h"
#include "cohort/runtime/heap.h"

namespace cohort::train {
namespace {

namespace pipeline = parallel::pipeline;

// The parameters and buffers of one worker's part of the model.
struct Part {
  int64_t trainable = 0;       // elements of the parameters that train
  int64_t frozen_bytes = 0;    // parameters that do not
  int64_t buffer_bytes = 0;    // BatchNorm's statistics and the like
  int64_t element_size = 4;    // of the trainable parameters
  std::vector<int64_t> units;  // trainable elements of each FullyShard unit
};

Part part_of(const std::vector<std::shared_ptr<torch::nn::Module>>& modules) {
  Part part;
  std::set<const c10::TensorImpl*> seen;
  bool sized = false;
  for (const auto& m : modules) {
    for (const auto& p : m->parameters()) {
      if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
      if (p.requires_grad()) {
        part.trainable += p.numel();
        if (!sized) part.element_size = static_cast<int64_t>(p.element_size());
        sized = true;
      } else {
        part.frozen_bytes += p.numel() * static_cast<int64_t>(p.element_size());
      }
    }
    for (const auto& b : m->buffers()) {
      if (seen.insert(b.unsafeGetTensorImpl()).second)
        part.buffer_bytes += b.numel() * static_cast<int64_t>(b.element_size());
    }
    std::vector<std::shared_ptr<torch::nn::Module>> all{m};
    for (const auto& child : m->modules(/*include_self=*/false)) all.push_back(child);
    for (const auto& child : all) {
      if (auto unit = std::dynamic_pointer_cast<parallel::FullyShardImpl>(child)) {
        int64_t n = 0;
        for (const auto& p : unit->parameters())
          if (p.requires_grad()) n += p.numel();
        part.units.push_back(n);
      }
    }
  }
  return part;
}

// The part of the worker that holds the most: the whole model, or the heaviest pipeline rank's
// stages.
Part heaviest_part(const ModelSpec& model, const Plan& plan) {
  if (plan.pp == 1) return part_of({model.module});
  const pipeline::PipelineLayout layout{.ranks = plan.pp, .virtual_stages = plan.virtual_stages()};
  const int layers = static_cast<int>(model.layers->size());
  const auto stages =
      pipeline::split_sequential(model.layers, pipeline::even_split(layers, layout.stages()));
  Part heaviest;
  for (int rank = 0; rank < plan.pp; ++rank) {
    std::vector<std::shared_ptr<torch::nn::Module>> modules;
    for (int s : layout.stages_of(rank)) modules.push_back(stages[static_cast<size_t>(s)].ptr());
    auto part = part_of(modules);
    if (part.trainable >= heaviest.trainable) heaviest = std::move(part);
  }
  return heaviest;
}

// The most elements ZeRO-3 holds gathered at once over `units` (in the model's order): a unit and
// those it gathers ahead of it, after it going forward and before it going backward, as
// ZeroOptimizer's prefetch takes them: the next unit always, more while the units ahead stay
// within `bucket` elements (none with a bucket of 0), none past `max_live` in all.
int64_t gathered_at_most(const std::vector<int64_t>& units, int64_t bucket, int64_t max_live) {
  const auto n = static_cast<int64_t>(units.size());
  int64_t most = 0;
  for (const int64_t direction : {1, -1}) {
    for (int64_t i = 0; i < n; ++i) {
      int64_t live = units[static_cast<size_t>(i)], ahead = 0;
      for (int64_t k = i + direction; bucket > 0 && k >= 0 && k < n; k += direction) {
        const int64_t unit = units[static_cast<size_t>(k)];
        if (ahead > 0 && ahead + unit > bucket) break;
        ahead += unit;
        if (live + unit > max_live) break;
        live += unit;
      }
      most = std::max(most, live);
    }
  }
  return most;
}

std::string megabytes(int64_t bytes) {
  std::ostringstream out;
  out.setf(std::ios::fixed);
  out.precision(1);
  out << static_cast<double>(bytes) / 1e6 << " MB";
  return out.str();
}

// A "<name>: N kB" field of /proc/<pid>/status (0: this process), in bytes; 0 where it is not.
int64_t status_field(const std::string& name, int pid = 0) {
  std::ifstream status(pid == 0 ? std::string("/proc/self/status")
                                : "/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(name + ":", 0) == 0) return std::stoll(line.substr(name.size() + 1)) * 1024;
  }
  return 0;
}

}  // namespace

int64_t MemoryEstimate::total() const {
  int64_t sum = 0;
  for (const auto& item : items) sum += item.bytes;
  return sum;
}

const MemoryItem& MemoryEstimate::largest() const {
  const MemoryItem* best = nullptr;
  for (const auto& item : items) {
    if (item.name == "runtime") continue;
    if (best == nullptr || item.bytes > best->bytes) best = &item;
  }
  if (best == nullptr) throw std::logic_error("MemoryEstimate::largest: no items");
  return *best;
}

std::string MemoryEstimate::table() const {
  // One column of figures: after the longest name, and at least 18 characters in.
  size_t width = 18;
  for (const auto& item : items) width = std::max(width, item.name.size() + 2);
  const auto row = [width](const std::string& name, int64_t bytes) {
    std::string label = name + ":";
    label.resize(width, ' ');
    return "  " + label + megabytes(bytes) + "\n";
  };
  std::ostringstream out;
  for (const auto& item : items) out << row(item.name, item.bytes);
  out << row("total", total());
  if (disk_bytes > 0)
    out << "  (on disk, beside the total: the optimizer state, " << megabytes(disk_bytes) << ")\n";
  if (host_bytes > 0) {
    out << "  (in host memory, beside the total: the optimizer state, float32 masters and a "
        << "gradient copy, " << megabytes(host_bytes) << ")\n";
  }
  return out.str();
}

void MemoryEstimate::check_budget(int64_t budget_bytes) const {
  if (budget_bytes <= 0 || total() <= budget_bytes) return;
  const std::string over = "the plan needs about " + megabytes(total()) +
                           " per worker, over --memory-budget " + megabytes(budget_bytes);
  // An option that alone tips the plan over is the fix to name first: the plan fits without it.
  std::map<std::string, std::vector<const MemoryItem*>> by_option;
  for (const auto& item : items)
    if (!item.added_by.empty()) by_option[item.added_by].push_back(&item);
  for (const auto& [option, added] : by_option) {
    int64_t bytes = 0;
    std::string names;
    for (const auto* item : added) {
      bytes += item->bytes;
      names += (names.empty() ? "" : " and ") + item->name;
    }
    if (total() - bytes > budget_bytes) continue;
    throw UsageError(over + "; " + option + " hold " + megabytes(bytes) + " of it (" + names +
                     "), and without them it needs " + megabytes(total() - bytes) + ": " +
                     added.back()->shrink);
  }
  const auto& big = largest();
  throw UsageError(over + "; the largest item is " + big.name + " (" + megabytes(big.bytes) +
                   "): " + big.shrink);
}

MemoryEstimate estimate_memory(const ModelSpec& model, const Plan& plan,
                               const MemoryEstimateOptions& options) {
  if (!model.module) throw UsageError("estimate_memory: ModelSpec::module is null");
  if (plan.pp > 1 && !model.layers)
    throw UsageError("estimate_memory: a pipeline needs ModelSpec::layers");
  if (options.world_size < 1 || options.optimizer_states < 0 || options.activation_bytes < 0 ||
      options.runtime_bytes < 0) {
    throw UsageError("estimate_memory: world_size must be >= 1 and the other options >= 0");
  }
  plan.validate(options.world_size);
  const Part part = heaviest_part(model, plan);
  const int64_t e = part.element_size;
  const int64_t p = part.trainable / plan.tp;
  const int dp = std::max(1, options.world_size / (plan.pp * plan.tp));
  const int64_t shards = plan.zero.shard_group_size > 0 ? plan.zero.shard_group_size : dp;
  const int stage = plan.zero.stage;
  const int64_t k = options.optimizer_states;
  const auto shard = [&](int64_t elements) { return (elements + shards - 1) / shards; };

  MemoryEstimate estimate;
  const auto add = [&](std::string name, int64_t bytes, std::string shrink,
                       std::string added_by = {}) {
    if (bytes > 0) {
      estimate.items.push_back({std::move(name), bytes, std::move(shrink), std::move(added_by)});
    }
  };
  const std::string more_workers = "more --workers (ZeRO shards it over them)";
  // Parameters.
  int64_t parameters = p;
  int64_t gathered = 0;
  int64_t largest = 0;  // ZeRO-3: the largest unit's elements (a bucket of its own)
  int64_t bucket = std::min(plan.zero.reduce_bucket_size, std::max<int64_t>(p, 1));
  if (stage == 3) {
    std::vector<int64_t> sharded_units;
    int64_t sharded = 0;
    for (int64_t unit : part.units) {
      if (unit < plan.zero.param_persistence_threshold) continue;
      sharded_units.push_back(unit / plan.tp);
      sharded += unit / plan.tp;
      largest = std::max(largest, unit / plan.tp);
    }
    parameters = shard(sharded) + (p - sharded);
    gathered = gathered_at_most(sharded_units, plan.zero.prefetch_bucket_size,
                                plan.zero.max_live_parameters);
    // Each unit is a bucket of its own; the parameters that stay whole are bucketed as at stage 2.
    bucket = std::max(largest, std::min(plan.zero.reduce_bucket_size, p - sharded));
  }
  add("parameters", parameters * e + part.frozen_bytes / plan.tp + part.buffer_bytes,
      stage < 3 ? "--zero-stage 3 shards them over the workers" : "more --workers or --pp");
  // A mesh's worker holds the whole model for evaluation and checkpoints: beside its stages the
  // other stages' parameters (their slices with tensor parallelism) and buffers, and with
  // tensor parallelism the dense model too.
  const Part whole = part_of({model.module});
  const auto bytes_of = [](const Part& part, int tp) {
    return part.trainable * part.element_size / tp + part.frozen_bytes / tp + part.buffer_bytes;
  };
  if (plan.has_mesh()) {
    add("the model's other stages", bytes_of(whole, plan.tp) - bytes_of(part, plan.tp),
        "nothing: a mesh's workers hold the whole model for evaluation and checkpoints");
    if (plan.tp > 1) {
      add("the dense model", bytes_of(whole, 1),
          "nothing: a tensor-parallel worker keeps the dense model that checkpoints hold");
    }
  }
  const std::string fewer_gathered =
      "a smaller stage3_prefetch_bucket_size or stage3_max_live_parameters (--deepspeed)";
  add("gathered units", gathered * e, fewer_gathered);
  // Each all-gather in flight sends from a buffer of the unit's size on Gloo (1.13 has no
  // all-gather into one tensor: an all-to-all of N copies of the shard), pooled for the next:
  // counted always, an upper bound with NCCL.
  add("all-gather buffers", gathered * e, fewer_gathered);
  // Gradients: DDP's bucket views (and a flat optimizer's own buffer); ZeRO-1 the whole gradient
  // and its shard; ZeRO-2 and 3 the shard, and where a step accumulates several micro-batches (a
  // pipeline's, --gradient-accumulation-steps) the whole gradient they add up in until the step's
  // last backward reduce-scatters it.
  int64_t gradients = p;
  if (stage == 0 && options.flat_optimizer) gradients += p;
  if (stage == 1) gradients = p + shard(p);
  if (stage >= 2) gradients = shard(p) + (plan.micro_batches_per_step() > 1 ? p : 0);
  add("gradients", gradients * e,
      stage < 2 ? "--zero-stage 2 shards them over the workers" : more_workers);
  if (stage >= 2) {
    // At most two buckets in flight (one where the whole gradient is one bucket), each staged in
    // a buffer kept from step to step and with a receive buffer of its size on Gloo (1.13's
    // reduce-scatter is an all-to-all): counted always, an upper bound with NCCL.
    const int64_t in_flight = stage == 2 && p <= bucket ? 1 : 2;
    add("gradient buckets", in_flight * bucket * e * 2,
        stage == 3 && bucket == largest
            ? "units of fewer parameters: at ZeRO stage 3 each unit is a bucket of its own"
            : "a smaller reduce_bucket_size (--deepspeed)");
  }
  const int64_t stepped = stage >= 1 ? shard(p) : p;  // the elements this worker updates
  const int64_t state = k * stepped * e;
  const bool on_host =
      options.gpu && plan.offload_optimizer.device != OptimizerOffload::Device::kNone;
  if (on_host) {
    // The update on the host: its state (in files there with disk:PATH), float32 masters and the
    // gradients copied from the GPU; the GPU keeps the parameters and their gradients.
    estimate.host_bytes = stepped * 4 * 2;
    if (plan.offload_optimizer.device == OptimizerOffload::Device::kDisk) {
      estimate.disk_bytes = state;
      estimate.host_bytes += std::min<int64_t>(state, k * 2 * (int64_t{1} << 20));
    } else {
      estimate.host_bytes += state;
    }
  } else if (plan.offload_optimizer.device == OptimizerOffload::Device::kDisk) {
    // In files; in memory a chunk of each state buffer at a time (1 MiB, and the next read ahead).
    estimate.disk_bytes = state;
    add("optimizer state", std::min<int64_t>(state, k * 2 * (int64_t{1} << 20)),
        "nothing: it streams from disk a chunk at a time");
  } else {
    const std::string to_disk = ", or --offload-optimizer disk:PATH streams it from files";
    add("optimizer state", state,
        (stage == 0                       ? "--zero-stage 1 shards it over the workers"
         : plan.zero.shard_group_size > 0 ? "a larger --shard-group-size"
                                          : more_workers) +
            to_disk);
  }
  // Local SGD and DiLoCo keep the parameters of the last synchronisation; DiLoCo its outer
  // momentum too.
  int64_t copies = 0;
  if (std::holds_alternative<parallel::LocalSgd>(plan.sync)) copies = p;
  if (std::holds_alternative<parallel::DiLoCo>(plan.sync)) copies = 2 * p;
  add("replica copies", copies * e, "--sync ddp keeps none");
  // An asynchronous checkpoint's buffers, on the worker that writes the most: the whole model's
  // parameters and buffers (the first rank writes them), beside its optimizer state.
  const int64_t checkpoint_bytes = bytes_of(whole, 1) + state;
  const std::string snapshots_option = "in-memory snapshots (--snapshot-every-steps)";
  if (options.async_checkpoint || options.snapshots) {
    // Added by one option alone, or by both (then leaving one out keeps them).
    std::string added_by;
    if (!options.async_checkpoint) added_by = snapshots_option;
    if (!options.snapshots) added_by = "asynchronous checkpoints (--async-checkpoint)";
    add("checkpoint buffers", checkpoint_bytes,
        "a synchronous save (no --async-checkpoint, no --snapshot-every-steps) keeps none",
        added_by);
  }
  // Snapshots: in the node's memory-backed storage (tmpfs), not the process's, but memory all
  // the same; the two newest of the worker's own files and two copies of its ward's.
  if (options.snapshots) {
    add("snapshots (memory-backed storage)", 4 * checkpoint_bytes,
        "a larger --snapshot-every-steps does not shrink it; leave snapshots out, or shard the "
        "state with --zero-stage",
        snapshots_option);
  }
  // Activations: a pipeline stage holds about 1/pp of a micro-batch's, for the micro-batches in
  // flight at once (GPipe all of a step's; 1F1B, interleaved and zero-bubble at most pp).
  int64_t activations = options.activation_bytes;
  if (plan.pp > 1) {
    const int64_t m = plan.micro_batches_per_step();
    const int64_t in_flight =
        plan.schedule == pipeline::ScheduleKind::kGPipe ? m : std::min<int64_t>(m, plan.pp);
    activations = options.activation_bytes / plan.pp * in_flight;
  }
  add("activations", activations,
      plan.activation_checkpointing.enabled()
          ? "a smaller --batch-size with more --gradient-accumulation-steps"
          : "--activation-checkpointing every:1 recomputes them in backward");
  add("runtime", options.runtime_bytes, "nothing: it is libtorch and the process itself");
  return estimate;
}

void check_offload_room(const OptimizerOffload& offload, int64_t bytes) {
  if (offload.device != OptimizerOffload::Device::kDisk) return;
  const std::string flag = "--offload-optimizer " + to_string(offload);
  std::error_code error;
  if (!std::filesystem::is_directory(offload.path, error))
    throw UsageError(flag + ": " + offload.path.string() + " is not a folder: create it");
  if (::access(offload.path.c_str(), W_OK) != 0) {
    throw UsageError(flag + ": " + offload.path.string() +
                     " is not writable: choose a folder this user may write");
  }
  const auto space = std::filesystem::space(offload.path, error);
  if (!error && static_cast<int64_t>(space.available) < bytes) {
    throw UsageError(flag + ": the optimizer state needs " + megabytes(bytes) + " there, and " +
                     offload.path.string() + " has " +
                     megabytes(static_cast<int64_t>(space.available)) +
                     " free: choose a folder on a disk with room");
  }
}

int64_t resident_bytes(int pid) { return status_field("VmRSS", pid); }

int64_t peak_resident_bytes(int pid) { return status_field("VmHWM", pid); }

int64_t release_free_memory() {
  const int64_t before = resident_bytes();
  if (!runtime::trim_heap()) return 0;
  return std::max<int64_t>(0, before - resident_bytes());
}

namespace {

// The third parameter of MemoryReportingInfoBase::reportMemoryUsage: int64_t in libtorch 1.13,
// size_t in 2.x.
template <class>
struct TotalBytes;
template <class C, class R, class A, class B, class T, class U, class D>
struct TotalBytes<R (C::*)(A, B, T, U, D)> {
  using type = T;
};
using ReportedTotal = TotalBytes<decltype(&c10::MemoryReportingInfoBase::reportMemoryUsage)>::type;

// Told of every CPU tensor allocation and free while it is the thread's memory reporter (as the
// profiler's memory profiling is): the peak of the bytes allocated since it was installed.
// Frees of tensors from before are not reported by libtorch's CPU allocator.
class TensorBytesPeak : public c10::MemoryReportingInfoBase {
 public:
  void reportMemoryUsage(void*, int64_t bytes, ReportedTotal, ReportedTotal,
                         c10::Device device) override {
    if (!device.is_cpu()) return;
    std::lock_guard lock(mutex_);
    now_ += bytes;
    peak_ = std::max(peak_, now_);
  }
  bool memoryProfilingEnabled() const override { return true; }
  int64_t peak() const {
    std::lock_guard lock(mutex_);
    return peak_;
  }

 private:
  mutable std::mutex mutex_;
  int64_t now_ = 0;
  int64_t peak_ = 0;
};

}  // namespace

int64_t measure_step_memory(torch::nn::Module& module, const std::function<void()>& step) {
  {
    torch::NoGradGuard no_grad;
    for (auto& p : module.parameters()) {
      if (p.requires_grad() && !p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
    }
  }
  const int64_t before = resident_bytes();
  // Writing 5 to clear_refs resets the high-water mark to the resident memory now.
  {
    std::ofstream clear("/proc/self/clear_refs");
    if (!clear) return 0;
    clear << "5";
  }
  auto tensors = std::make_shared<TensorBytesPeak>();
  {
    c10::DebugInfoGuard reporting(c10::DebugInfoKind::PROFILER_STATE, tensors);
    step();
  }
  // The resident growth counts the heap's own overhead, but not what the step got from memory
  // this process had freed before (a probe after other work); the tensors' peak counts that.
  return std::max(std::max<int64_t>(0, peak_resident_bytes() - before), tensors->peak());
}

}  // namespace cohort::train

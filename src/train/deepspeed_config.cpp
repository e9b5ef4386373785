#include "cohort/train/deepspeed_config.h"

#include <cmath>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>

#include "cohort/error.h"

namespace cohort::train {
namespace {

// Reads typed values out of one config, naming the source and the key's path on any error.
class Reader {
 public:
  explicit Reader(std::string source) : source_(std::move(source)) {}

  [[noreturn]] void fail(const std::string& key, const std::string& problem) const {
    throw UsageError(source_ + ": " + key + " " + problem);
  }

  const Json* find(const Json& object, const std::string& key) const {
    auto it = object.find(key);
    return it == object.end() || it->is_null() ? nullptr : &*it;
  }

  const Json* object(const Json& parent, const std::string& key, const std::string& path) const {
    const Json* v = find(parent, key);
    if (v != nullptr && !v->is_object()) fail(path, "must be an object, got " + v->dump());
    return v;
  }

  std::optional<double> number(const Json& parent, const std::string& key,
                               const std::string& path) const {
    const Json* v = find(parent, key);
    if (v == nullptr) return std::nullopt;
    if (!v->is_number()) fail(path, "must be a number, got " + v->dump());
    const double x = v->get<double>();
    if (!std::isfinite(x)) fail(path, "must be finite, got " + v->dump());
    return x;
  }

  // Integers may be written as 5e8, as DeepSpeed's examples do.
  std::optional<int64_t> integer(const Json& parent, const std::string& key,
                                 const std::string& path) const {
    const Json* v = find(parent, key);
    if (v == nullptr) return std::nullopt;
    if (v->is_number_integer()) return v->get<int64_t>();
    if (v->is_number_float()) {
      const double x = v->get<double>();
      if (std::isfinite(x) && x == std::floor(x) && std::abs(x) < 9.0e18)
        return static_cast<int64_t>(x);
    }
    fail(path, "must be an integer, got " + v->dump());
  }

  std::optional<bool> boolean(const Json& parent, const std::string& key,
                              const std::string& path) const {
    const Json* v = find(parent, key);
    if (v == nullptr) return std::nullopt;
    if (!v->is_boolean()) fail(path, "must be true or false, got " + v->dump());
    return v->get<bool>();
  }

  std::optional<std::string> string(const Json& parent, const std::string& key,
                                    const std::string& path) const {
    const Json* v = find(parent, key);
    if (v == nullptr) return std::nullopt;
    if (!v->is_string()) fail(path, "must be a string, got " + v->dump());
    return v->get<std::string>();
  }

  // Keys of `object` not in `known`, as "prefix.key".
  void collect_unknown(const Json& object, const std::set<std::string>& known,
                       const std::string& prefix, std::vector<std::string>& unknown) const {
    for (auto it = object.begin(); it != object.end(); ++it)
      if (!known.count(it.key())) unknown.push_back(prefix + it.key());
  }

 private:
  std::string source_;
};

// Batch numbers: at least 1, and small enough that their product with the world size cannot
// overflow.
int64_t positive(const Reader& r, int64_t value, const std::string& key) {
  constexpr int64_t kMost = int64_t{1} << 31;
  if (value < 1) r.fail(key, "must be >= 1, got " + std::to_string(value));
  if (value > kMost)
    r.fail(key, "must be at most " + std::to_string(kMost) + ", got " + std::to_string(value));
  return value;
}

// train_batch_size == micro x accumulation x world; any two determine the third.
void resolve_batch(const Reader& r, DeepSpeedConfig& c, std::optional<int64_t> batch,
                   std::optional<int64_t> micro, std::optional<int64_t> accumulation, int world) {
  if (batch) positive(r, *batch, "train_batch_size");
  if (micro) positive(r, *micro, "train_micro_batch_size_per_gpu");
  if (accumulation) positive(r, *accumulation, "gradient_accumulation_steps");
  const auto mismatch = [&](int64_t b, int64_t m, int64_t a) {
    r.fail("train_batch_size", std::to_string(b) + " is not train_micro_batch_size_per_gpu " +
                                   std::to_string(m) + " x gradient_accumulation_steps " +
                                   std::to_string(a) + " x world size " + std::to_string(world) +
                                   " (= " + std::to_string(m * a * world) +
                                   "): change one of them so that they multiply out");
  };
  if (batch && micro && accumulation) {
    if (*batch != *micro * *accumulation * world) mismatch(*batch, *micro, *accumulation);
  } else if (batch && micro) {
    if (*batch % (*micro * world) != 0) mismatch(*batch, *micro, *batch / (*micro * world));
    accumulation = *batch / (*micro * world);
    if (*accumulation < 1) mismatch(*batch, *micro, 1);
  } else if (batch && accumulation) {
    if (*batch % (*accumulation * world) != 0)
      mismatch(*batch, *batch / (*accumulation * world), *accumulation);
    micro = *batch / (*accumulation * world);
    if (*micro < 1) mismatch(*batch, 1, *accumulation);
  } else if (micro) {
    accumulation = accumulation.value_or(1);
    batch = *micro * *accumulation * world;
  } else if (batch) {
    accumulation = 1;
    if (*batch % world != 0) mismatch(*batch, *batch / world, 1);
    micro = *batch / world;
    if (*micro < 1) mismatch(*batch, 1, 1);
  } else {
    r.fail("train_batch_size",
           "is missing, and so is train_micro_batch_size_per_gpu: give at least one");
  }
  c.train_batch_size = *batch;
  c.micro_batch_size = *micro;
  c.gradient_accumulation_steps = *accumulation;
}

void read_optimizer(const Reader& r, const Json& root, DeepSpeedConfig& c,
                    std::vector<std::string>& unknown) {
  const Json* o = r.object(root, "optimizer", "optimizer");
  if (o == nullptr) return;
  r.collect_unknown(*o, {"type", "params"}, "optimizer.", unknown);
  const auto type = r.string(*o, "type", "optimizer.type");
  if (!type) r.fail("optimizer.type", "is missing: give Adam, AdamW or SGD");
  std::string lower;
  for (char ch : *type) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (lower != "adam" && lower != "adamw" && lower != "sgd")
    r.fail("optimizer.type", "'" + *type + "' is not one of Adam, AdamW, SGD");
  c.optimizer = lower;
  const Json* p = r.object(*o, "params", "optimizer.params");
  if (p == nullptr) return;
  r.collect_unknown(*p,
                    {"lr", "betas", "eps", "weight_decay", "momentum", "nesterov", "adam_w_mode",
                     "torch_adam", "bias_correction", "amsgrad", "dampening"},
                    "optimizer.params.", unknown);
  c.lr = r.number(*p, "lr", "optimizer.params.lr");
  if (c.lr && *c.lr < 0) r.fail("optimizer.params.lr", "must be >= 0, got " + format_number(*c.lr));
  if (const Json* b = r.find(*p, "betas")) {
    if (!b->is_array() || b->size() != 2 || !(*b)[0].is_number() || !(*b)[1].is_number())
      r.fail("optimizer.params.betas", "must be two numbers, got " + b->dump());
    c.betas = std::make_pair((*b)[0].get<double>(), (*b)[1].get<double>());
  }
  c.eps = r.number(*p, "eps", "optimizer.params.eps");
  c.weight_decay = r.number(*p, "weight_decay", "optimizer.params.weight_decay");
  c.momentum = r.number(*p, "momentum", "optimizer.params.momentum");
  c.nesterov = r.boolean(*p, "nesterov", "optimizer.params.nesterov").value_or(false);
  if (lower == "adam" &&
      r.boolean(*p, "adam_w_mode", "optimizer.params.adam_w_mode").value_or(false))
    c.optimizer = "adamw";
  if (r.boolean(*p, "amsgrad", "optimizer.params.amsgrad").value_or(false))
    r.fail("optimizer.params.amsgrad", "true is not supported by the CLI's optimizers");
}

void read_scheduler(const Reader& r, const Json& root, DeepSpeedConfig& c,
                    std::vector<std::string>& unknown) {
  const Json* s = r.object(root, "scheduler", "scheduler");
  if (s == nullptr) return;
  r.collect_unknown(*s, {"type", "params"}, "scheduler.", unknown);
  const auto type = r.string(*s, "type", "scheduler.type");
  if (type != "WarmupLR" && type != "WarmupDecayLR")
    r.fail("scheduler.type", "'" + type.value_or("") + "' is not one of WarmupLR, WarmupDecayLR");
  static const Json kEmpty = Json::object();
  const Json* p = r.object(*s, "params", "scheduler.params");
  if (p == nullptr) p = &kEmpty;
  r.collect_unknown(*p,
                    {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                     "total_num_steps", "last_batch_iteration"},
                    "scheduler.params.", unknown);
  // DeepSpeed's defaults.
  const double min_lr = r.number(*p, "warmup_min_lr", "scheduler.params.warmup_min_lr").value_or(0);
  const double max_lr =
      r.number(*p, "warmup_max_lr", "scheduler.params.warmup_max_lr").value_or(0.001);
  if (!(max_lr > 0))
    r.fail("scheduler.params.warmup_max_lr", "must be > 0, got " + format_number(max_lr));
  if (min_lr < 0 || min_lr > max_lr)
    r.fail("scheduler.params.warmup_min_lr",
           format_number(min_lr) + " must be in [0, warmup_max_lr " + format_number(max_lr) + "]");
  optim::LrScheduleOptions schedule;
  schedule.warmup_steps =
      r.integer(*p, "warmup_num_steps", "scheduler.params.warmup_num_steps").value_or(1000);
  if (schedule.warmup_steps < 0)
    r.fail("scheduler.params.warmup_num_steps",
           "must be >= 0, got " + std::to_string(schedule.warmup_steps));
  schedule.warmup_type =
      r.string(*p, "warmup_type", "scheduler.params.warmup_type").value_or("log");
  if (schedule.warmup_type != "log" && schedule.warmup_type != "linear")
    r.fail("scheduler.params.warmup_type", "'" + schedule.warmup_type + "' is not log or linear");
  schedule.warmup_start_ratio = min_lr / max_lr;
  if (type == "WarmupDecayLR") {
    const auto total = r.integer(*p, "total_num_steps", "scheduler.params.total_num_steps");
    if (!total) r.fail("scheduler.params.total_num_steps", "is missing: WarmupDecayLR needs it");
    if (*total <= schedule.warmup_steps)
      r.fail("scheduler.params.total_num_steps", std::to_string(*total) +
                                                     " must be greater than warmup_num_steps " +
                                                     std::to_string(schedule.warmup_steps));
    schedule.decay = "linear";
    schedule.total_steps = *total;
  }
  c.lr = max_lr;
  c.schedule = schedule;
}

void read_precision(const Reader& r, const Json& root, DeepSpeedConfig& c,
                    std::vector<std::string>& unknown) {
  const Json* fp16 = r.object(root, "fp16", "fp16");
  const Json* bf16 = r.object(root, "bf16", "bf16");
  if (bf16 != nullptr) {
    r.collect_unknown(*bf16, {"enabled"}, "bf16.", unknown);
    if (r.boolean(*bf16, "enabled", "bf16.enabled").value_or(false)) c.precision = "bf16";
  }
  if (fp16 == nullptr) return;
  r.collect_unknown(*fp16,
                    {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window",
                     "hysteresis", "min_loss_scale", "auto_cast", "consecutive_hysteresis"},
                    "fp16.", unknown);
  if (!r.boolean(*fp16, "enabled", "fp16.enabled").value_or(false)) return;
  if (c.precision == "bf16") r.fail("fp16.enabled", "and bf16.enabled are both true: pick one");
  c.precision = "fp16";
  auto& s = c.loss_scaler;
  const double power = static_cast<double>(
      r.integer(*fp16, "initial_scale_power", "fp16.initial_scale_power").value_or(16));
  if (power < 0 || power > 64)
    r.fail("fp16.initial_scale_power", "must be in [0, 64], got " + format_number(power));
  s.initial_scale = std::pow(2.0, power);
  s.growth_interval =
      r.integer(*fp16, "loss_scale_window", "fp16.loss_scale_window").value_or(1000);
  // Range-checked before it narrows to an int (4294967298 would have become 2).
  const int64_t hysteresis = r.integer(*fp16, "hysteresis", "fp16.hysteresis").value_or(2);
  if (hysteresis < 1 || hysteresis > 1'000'000)
    r.fail("fp16.hysteresis", "must be in [1, 1000000], got " + std::to_string(hysteresis));
  s.hysteresis = static_cast<int>(hysteresis);
  s.min_scale = r.number(*fp16, "min_loss_scale", "fp16.min_loss_scale").value_or(1.0);
  const double fixed = r.number(*fp16, "loss_scale", "fp16.loss_scale").value_or(0);
  if (fixed < 0)
    r.fail("fp16.loss_scale", "must be >= 0 (0: dynamic), got " + format_number(fixed));
  if (fixed > 0) {
    // A static scale: it never grows, and never backs off below itself.
    s.initial_scale = fixed;
    s.min_scale = fixed;
    s.growth_interval = std::numeric_limits<int64_t>::max();
  }
  try {
    s.validate();
  } catch (const UsageError& e) {
    r.fail("fp16", std::string("gives an invalid loss scaler: ") + e.what());
  }
}

void read_zero(const Reader& r, const Json& root, DeepSpeedConfig& c,
               std::vector<std::string>& unknown) {
  const Json* z = r.object(root, "zero_optimization", "zero_optimization");
  if (z == nullptr) return;
  r.collect_unknown(*z,
                    {"stage", "reduce_bucket_size", "allgather_bucket_size", "overlap_comm",
                     "contiguous_gradients", "reduce_scatter", "allgather_partitions",
                     "stage3_prefetch_bucket_size", "stage3_max_live_parameters",
                     "stage3_param_persistence_threshold", "stage3_max_reuse_distance",
                     "stage3_gather_16bit_weights_on_model_save", "round_robin_gradients",
                     "mics_shard_size", "offload_optimizer", "cpu_offload"},
                    "zero_optimization.", unknown);
  auto& zero = c.zero;
  // Range-checked before it narrows to an int ("stage": 4294967298 became stage 2).
  const int64_t stage = r.integer(*z, "stage", "zero_optimization.stage").value_or(0);
  if (stage < 0 || stage > 3)
    r.fail("zero_optimization.stage", std::to_string(stage) + " is not one of 0, 1, 2, 3");
  zero.stage = static_cast<int>(stage);
  // A bucket size: DeepSpeed's default when absent, else > 0.
  const auto bucket = [&](const char* key, int64_t fallback) {
    const std::string path = std::string("zero_optimization.") + key;
    const int64_t value = r.integer(*z, key, path).value_or(fallback);
    if (value <= 0) r.fail(path, "must be > 0, got " + std::to_string(value));
    return value;
  };
  zero.reduce_bucket_size = bucket("reduce_bucket_size", zero.reduce_bucket_size);
  zero.allgather_bucket_size = bucket("allgather_bucket_size", zero.allgather_bucket_size);
  zero.overlap_comm =
      r.boolean(*z, "overlap_comm", "zero_optimization.overlap_comm").value_or(zero.overlap_comm);
  for (const char* key :
       {"contiguous_gradients", "reduce_scatter", "allgather_partitions", "round_robin_gradients"})
    r.boolean(*z, key, std::string("zero_optimization.") + key);
  // Stage 3's limits: DeepSpeed's defaults when absent, else >= 0. stage3_max_reuse_distance
  // (when to keep a parameter gathered for a reuse soon after) is checked; units are freed at
  // their end here.
  const auto limit = [&](const char* key, int64_t fallback) {
    const std::string path = std::string("zero_optimization.") + key;
    const int64_t value = r.integer(*z, key, path).value_or(fallback);
    if (value < 0) r.fail(path, "must be >= 0, got " + std::to_string(value));
    return value;
  };
  zero.prefetch_bucket_size = limit("stage3_prefetch_bucket_size", zero.prefetch_bucket_size);
  zero.max_live_parameters = limit("stage3_max_live_parameters", zero.max_live_parameters);
  zero.param_persistence_threshold =
      limit("stage3_param_persistence_threshold", zero.param_persistence_threshold);
  limit("stage3_max_reuse_distance", 0);
  // MiCS (DeepSpeed's sharding groups): shard inside groups of this many ranks, replicate across;
  // -1, its default, shards over all of them.
  const int64_t mics =
      r.integer(*z, "mics_shard_size", "zero_optimization.mics_shard_size").value_or(-1);
  if (mics == 0 || mics < -1 || mics > (int64_t{1} << 20)) {
    r.fail("zero_optimization.mics_shard_size",
           "must be -1 (shard over every rank) or a group size >= 1, got " + std::to_string(mics));
  }
  zero.shard_group_size = mics == -1 ? 0 : static_cast<int>(mics);
  // Where the optimizer state lives: the older cpu_offload, or offload_optimizer's device.
  if (r.boolean(*z, "cpu_offload", "zero_optimization.cpu_offload").value_or(false))
    c.offload_optimizer = "cpu";
  const std::string prefix = "zero_optimization.offload_optimizer";
  if (const Json* offload = r.object(*z, "offload_optimizer", prefix)) {
    r.collect_unknown(*offload,
                      {"device", "nvme_path", "pin_memory", "buffer_count", "buffer_size",
                       "fast_init", "ratio", "pipeline_read", "pipeline_write"},
                      prefix + ".", unknown);
    const std::string device = r.string(*offload, "device", prefix + ".device").value_or("none");
    if (device == "cpu") {
      c.offload_optimizer = "cpu";
    } else if (device == "nvme") {
      const auto path = r.string(*offload, "nvme_path", prefix + ".nvme_path");
      if (!path || path->empty())
        r.fail(prefix + ".nvme_path", "is missing: device nvme keeps the state in that folder");
      c.offload_optimizer = "disk:" + *path;
    } else if (device != "none") {
      r.fail(prefix + ".device", "'" + device + "' is not one of none, cpu, nvme");
    }
    // How DeepSpeed's own offload engine buffers and pipelines: not done here.
    for (const char* key :
         {"buffer_count", "buffer_size", "fast_init", "ratio", "pipeline_read", "pipeline_write"}) {
      if (offload->contains(key)) unknown.push_back(prefix + "." + key + " (not honoured)");
    }
    r.boolean(*offload, "pin_memory", prefix + ".pin_memory");
  }
  zero.validate();
}

// DeepSpeed checkpoints what the model's code wraps in deepspeed.checkpointing.checkpoint, in
// practice each transformer layer: here every unit. What the block tunes beyond that (partitioning
// the kept inputs over the tensor-parallel group, keeping them in host memory, one contiguous
// buffer, synchronising and timing at the boundaries) is not done here: named when asked for.
void read_activation_checkpointing(const Reader& r, const Json& root, DeepSpeedConfig& c,
                                   std::vector<std::string>& unknown) {
  const Json* a = r.object(root, "activation_checkpointing", "activation_checkpointing");
  if (a == nullptr) return;
  const std::string prefix = "activation_checkpointing.";
  r.collect_unknown(*a,
                    {"partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
                     "number_checkpoints", "synchronize_checkpoint_boundary", "profile"},
                    prefix, unknown);
  for (const char* key :
       {"partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
        "synchronize_checkpoint_boundary", "profile"}) {
    if (r.boolean(*a, key, prefix + key).value_or(false))
      unknown.push_back(prefix + key + " (not honoured)");
  }
  if (const auto n = r.integer(*a, "number_checkpoints", prefix + "number_checkpoints")) {
    if (*n < 1) r.fail(prefix + "number_checkpoints", "must be >= 1, got " + std::to_string(*n));
    unknown.push_back(prefix + "number_checkpoints (not honoured)");
  }
  c.activation_checkpointing.every = 1;
}

}  // namespace

DeepSpeedConfig DeepSpeedConfig::from_json(const Json& config, int world_size,
                                           const std::string& source) {
  const Reader r(source);
  if (!config.is_object()) r.fail("the top level", "must be a JSON object");
  if (world_size < 1) r.fail("world size", std::to_string(world_size) + " must be >= 1");
  DeepSpeedConfig c;
  std::vector<std::string> unknown;
  // Keys that tune DeepSpeed's own logging and machinery: nothing to do here.
  r.collect_unknown(
      config,
      {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
       "optimizer", "scheduler", "fp16", "bf16", "gradient_clipping", "zero_optimization",
       "activation_checkpointing", "steps_per_print", "wall_clock_breakdown", "dump_state",
       "zero_allow_untested_optimizer"},
      "", unknown);
  resolve_batch(
      r, c, r.integer(config, "train_batch_size", "train_batch_size"),
      r.integer(config, "train_micro_batch_size_per_gpu", "train_micro_batch_size_per_gpu"),
      r.integer(config, "gradient_accumulation_steps", "gradient_accumulation_steps"), world_size);
  read_optimizer(r, config, c, unknown);
  read_scheduler(r, config, c, unknown);
  read_precision(r, config, c, unknown);
  c.gradient_clipping = r.number(config, "gradient_clipping", "gradient_clipping").value_or(0);
  if (c.gradient_clipping < 0)
    r.fail("gradient_clipping",
           "must be >= 0 (0: no clipping), got " + format_number(c.gradient_clipping));
  read_zero(r, config, c, unknown);
  read_activation_checkpointing(r, config, c, unknown);
  c.unknown_keys = std::move(unknown);
  return c;
}

DeepSpeedConfig DeepSpeedConfig::load(const std::filesystem::path& file, int world_size) {
  std::ifstream in(file);
  if (!in) throw UsageError("deepspeed config " + file.string() + " cannot be read: no such file");
  std::stringstream text;
  text << in.rdbuf();
  Json config;
  try {
    config = Json::parse(text.str());
  } catch (const Json::exception& e) {  // a syntax error, or a number past a double (10e7011)
    throw UsageError("deepspeed config " + file.string() + " is not valid JSON: " + e.what());
  }
  return from_json(config, world_size, file.string());
}

}  // namespace cohort::train

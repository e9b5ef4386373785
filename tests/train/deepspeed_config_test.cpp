#include "cohort/train/deepspeed_config.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "cohort/error.h"
#include "support/expect.h"
#include "support/tiny_mnist.h"

namespace cohort::train {
namespace {

using cohort::testing::expect_error;

// Seed 001's config, as written.
Json seed001() {
  return Json::parse(R"({
    "train_batch_size": 32,
    "train_micro_batch_size_per_gpu": 8,
    "optimizer": {"type": "Adam", "params": {"lr": 0.001}},
    "fp16": {"enabled": true},
    "zero_optimization": {"stage": 2}
  })");
}

TEST(DeepSpeedConfig, Seed001ResolvesItsBatchArithmeticPerWorldSize) {
  const auto two = DeepSpeedConfig::from_json(seed001(), 2);
  EXPECT_EQ(two.train_batch_size, 32);
  EXPECT_EQ(two.micro_batch_size, 8);
  EXPECT_EQ(two.gradient_accumulation_steps, 2);
  EXPECT_EQ(two.optimizer, "adam");
  EXPECT_EQ(two.lr, 0.001);
  EXPECT_EQ(two.precision, "fp16");
  EXPECT_EQ(two.loss_scaler.initial_scale, 65536.0);
  EXPECT_EQ(two.zero.stage, 2);
  EXPECT_EQ(two.zero.reduce_bucket_size, 500'000'000);
  EXPECT_TRUE(two.unknown_keys.empty());
  EXPECT_EQ(DeepSpeedConfig::from_json(seed001(), 4).gradient_accumulation_steps, 1);
  expect_error<UsageError>(
      [] { DeepSpeedConfig::from_json(seed001(), 3); },
      "train_batch_size 32 is not train_micro_batch_size_per_gpu 8 x gradient_accumulation_steps "
      "1 x world size 3 (= 24)");
}

TEST(DeepSpeedConfig, AnyTwoBatchNumbersGiveTheThird) {
  auto resolve = [](Json j) { return DeepSpeedConfig::from_json(j, 2); };
  auto c = resolve({{"train_batch_size", 48}, {"gradient_accumulation_steps", 3}});
  EXPECT_EQ(c.micro_batch_size, 8);
  c = resolve({{"train_micro_batch_size_per_gpu", 4}, {"gradient_accumulation_steps", 5}});
  EXPECT_EQ(c.train_batch_size, 40);
  c = resolve({{"train_batch_size", 16}});
  EXPECT_EQ(c.micro_batch_size, 8);
  EXPECT_EQ(c.gradient_accumulation_steps, 1);
  c = resolve({{"train_batch_size", 24},
               {"train_micro_batch_size_per_gpu", 4},
               {"gradient_accumulation_steps", 3}});
  EXPECT_EQ(c.gradient_accumulation_steps, 3);
  expect_error<UsageError>(
      [&] {
        resolve({{"train_batch_size", 24},
                 {"train_micro_batch_size_per_gpu", 4},
                 {"gradient_accumulation_steps", 2}});
      },
      "train_batch_size 24 is not train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps "
      "2 x world size 2 (= 16)");
  expect_error<UsageError>([&] { resolve(Json::object()); },
                           "train_batch_size is missing, and so is train_micro_batch_size_per_gpu");
  expect_error<UsageError>(
      [&] {
        resolve({{"train_micro_batch_size_per_gpu", 0}});
      },
      "train_micro_batch_size_per_gpu must be >= 1, got 0");
}

TEST(DeepSpeedConfig, EveryBlockMapsOntoCohortsOptions) {
  const auto c = DeepSpeedConfig::from_json(Json::parse(R"({
    "train_micro_batch_size_per_gpu": 16,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.8, 0.99], "eps": 1e-7,
                                               "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupDecayLR",
                  "params": {"warmup_min_lr": 1e-5, "warmup_max_lr": 2e-4,
                             "warmup_num_steps": 10, "total_num_steps": 100}},
    "fp16": {"enabled": true, "initial_scale_power": 12, "loss_scale_window": 50,
             "hysteresis": 3, "min_loss_scale": 4},
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e7, "allgather_bucket_size": 2e8,
                          "overlap_comm": false, "contiguous_gradients": true},
    "steps_per_print": 100
  })"),
                                            2, "ds.json");
  EXPECT_EQ(c.optimizer, "adamw");
  EXPECT_EQ(c.betas, std::make_pair(0.8, 0.99));
  EXPECT_EQ(c.eps, 1e-7);
  EXPECT_EQ(c.weight_decay, 0.1);
  // The scheduler's maximum is the lr; the warmup starts at min / max of it.
  EXPECT_EQ(c.lr, 2e-4);
  ASSERT_TRUE(c.schedule.has_value());
  EXPECT_EQ(c.schedule->warmup_steps, 10);
  EXPECT_EQ(c.schedule->warmup_type, "log");
  EXPECT_DOUBLE_EQ(c.schedule->warmup_start_ratio, 0.05);
  EXPECT_EQ(c.schedule->decay, "linear");
  EXPECT_EQ(c.schedule->total_steps, 100);
  EXPECT_DOUBLE_EQ(c.schedule->factor(9), 1.0);
  EXPECT_DOUBLE_EQ(c.schedule->factor(55), 0.5);
  EXPECT_EQ(c.precision, "fp16");
  EXPECT_EQ(c.loss_scaler.initial_scale, 4096.0);
  EXPECT_EQ(c.loss_scaler.growth_interval, 50);
  EXPECT_EQ(c.loss_scaler.hysteresis, 3);
  EXPECT_EQ(c.loss_scaler.min_scale, 4.0);
  EXPECT_EQ(c.gradient_clipping, 1.0);
  EXPECT_EQ(c.zero.stage, 1);
  EXPECT_EQ(c.zero.reduce_bucket_size, 50'000'000);
  EXPECT_EQ(c.zero.allgather_bucket_size, 200'000'000);
  EXPECT_FALSE(c.zero.overlap_comm);
  EXPECT_TRUE(c.unknown_keys.empty());

  // A static loss scale never moves.
  const auto fixed = DeepSpeedConfig::from_json(
      {{"train_batch_size", 8}, {"fp16", {{"enabled", true}, {"loss_scale", 128}}}}, 1);
  EXPECT_EQ(fixed.loss_scaler.initial_scale, 128.0);
  EXPECT_EQ(fixed.loss_scaler.min_scale, 128.0);
  // "bf16" and Adam's adam_w_mode.
  const auto bf16 = DeepSpeedConfig::from_json(
      {{"train_batch_size", 8},
       {"bf16", {{"enabled", true}}},
       {"optimizer", {{"type", "Adam"}, {"params", {{"adam_w_mode", true}}}}}},
      1);
  EXPECT_EQ(bf16.precision, "bf16");
  EXPECT_EQ(bf16.optimizer, "adamw");
}

TEST(DeepSpeedConfig, StageThreeKeysSetItsLimits) {
  const auto c = DeepSpeedConfig::from_json(
      Json::parse(R"({"train_batch_size": 8, "zero_optimization": {"stage": 3,
                      "stage3_prefetch_bucket_size": 1000, "stage3_max_live_parameters": 5000,
                      "stage3_param_persistence_threshold": 10, "stage3_max_reuse_distance": 0}})"),
      1);
  EXPECT_EQ(c.zero.stage, 3);
  EXPECT_EQ(c.zero.prefetch_bucket_size, 1000);
  EXPECT_EQ(c.zero.max_live_parameters, 5000);
  EXPECT_EQ(c.zero.param_persistence_threshold, 10);
  // Absent: DeepSpeed's defaults.
  const auto defaults = DeepSpeedConfig::from_json(
      Json::parse(R"({"train_batch_size": 8, "zero_optimization": {"stage": 3}})"), 1);
  EXPECT_EQ(defaults.zero.prefetch_bucket_size, 50'000'000);
  EXPECT_EQ(defaults.zero.max_live_parameters, 1'000'000'000);
  EXPECT_EQ(defaults.zero.param_persistence_threshold, 100'000);
  EXPECT_EQ(defaults.zero.shard_group_size, 0);
  // MiCS: sharding groups (HSDP); its -1 shards over every rank.
  for (const auto& [mics, size] : {std::pair{2, 2}, {-1, 0}}) {
    EXPECT_EQ(DeepSpeedConfig::from_json(
                  Json::parse(R"({"train_batch_size": 8, "zero_optimization": {"stage": 3,
                                  "mics_shard_size": )" +
                              std::to_string(mics) + "}}"),
                  1)
                  .zero.shard_group_size,
              size);
  }
}

// Where the optimizer state lives: offload_optimizer's device (nvme: files in nvme_path), or the
// older cpu_offload; what DeepSpeed's own offload engine tunes is named for the warning.
TEST(DeepSpeedConfig, OffloadOptimizerMapsOntoTheOffloadOption) {
  const auto parse = [](const std::string& zero) {
    return DeepSpeedConfig::from_json(
        Json::parse(R"({"train_batch_size": 8, "zero_optimization": )" + zero + "}"), 1, "ds.json");
  };
  EXPECT_EQ(parse(R"({"stage": 2})").offload_optimizer, "none");
  EXPECT_EQ(parse(R"({"stage": 2, "cpu_offload": true})").offload_optimizer, "cpu");
  EXPECT_EQ(parse(R"({"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": true}})")
                .offload_optimizer,
            "cpu");
  const auto nvme = parse(R"({"stage": 3, "offload_optimizer": {"device": "nvme",
                             "nvme_path": "/local_nvme", "buffer_count": 4}})");
  EXPECT_EQ(nvme.offload_optimizer, "disk:/local_nvme");
  EXPECT_EQ(nvme.unknown_keys,
            (std::vector<std::string>{"zero_optimization.offload_optimizer.buffer_count (not "
                                      "honoured)"}));
  expect_error<UsageError>([&] { parse(R"({"offload_optimizer": {"device": "nvme"}})"); },
                           "ds.json: zero_optimization.offload_optimizer.nvme_path is missing");
  expect_error<UsageError>([&] { parse(R"({"offload_optimizer": {"device": "tape"}})"); },
                           "offload_optimizer.device 'tape' is not one of none, cpu, nvme");
}

// Megatron's example configs' block: every unit checkpointed; what cohort does not do beyond that
// is listed for the one warning, with what it does not know.
TEST(DeepSpeedConfig, ActivationCheckpointingChecksEveryUnitAndNamesWhatItCannotHonour) {
  EXPECT_FALSE(DeepSpeedConfig::from_json(Json::parse(R"({"train_batch_size": 8})"), 1)
                   .activation_checkpointing.enabled());
  const auto plain = DeepSpeedConfig::from_json(
      Json::parse(R"({"train_batch_size": 8, "activation_checkpointing": {
                      "partition_activations": false, "contiguous_memory_optimization": false}})"),
      1);
  EXPECT_EQ(plain.activation_checkpointing.every, 1);
  EXPECT_TRUE(plain.unknown_keys.empty());
  const auto megatron = DeepSpeedConfig::from_json(
      Json::parse(R"({"train_batch_size": 8, "activation_checkpointing": {
                      "partition_activations": true, "cpu_checkpointing": false,
                      "contiguous_memory_optimization": true, "number_checkpoints": 4,
                      "synchronize_checkpoint_boundary": false, "profile": true, "tiles": 2}})"),
      1);
  EXPECT_EQ(parallel::to_string(megatron.activation_checkpointing), "every:1");
  EXPECT_EQ(megatron.unknown_keys,
            (std::vector<std::string>{
                "activation_checkpointing.tiles",
                "activation_checkpointing.partition_activations (not honoured)",
                "activation_checkpointing.contiguous_memory_optimization (not honoured)",
                "activation_checkpointing.profile (not honoured)",
                "activation_checkpointing.number_checkpoints (not honoured)"}));
}

TEST(DeepSpeedConfig, UnknownKeysAreListedAndBadValuesNameTheirKey) {
  const auto c = DeepSpeedConfig::from_json(
      Json::parse(R"({"train_batch_size": 8, "flops_profiler": {"enabled": true},
                      "zero_optimization": {"stage": 1, "offload_param": {}},
                      "optimizer": {"type": "SGD", "params": {"lr": 0.1, "foo": 1}}})"),
      1);
  EXPECT_EQ(c.unknown_keys, (std::vector<std::string>{"flops_profiler", "optimizer.params.foo",
                                                      "zero_optimization.offload_param"}));
  const std::vector<std::pair<std::string, std::string>> bad{
      {R"({"train_batch_size": 8, "zero_optimization": {"stage": "two"}})",
       "ds.json: zero_optimization.stage must be an integer, got \"two\""},
      {R"({"train_batch_size": 8, "zero_optimization": {"stage": 4}})",
       "zero_optimization.stage 4 is not one of 0, 1, 2, 3"},
      // Numbers past an int are refused, not narrowed (this stage was read as 2).
      {R"({"train_batch_size": 8, "zero_optimization": {"stage": 4294967298}})",
       "zero_optimization.stage 4294967298 is not one of 0, 1, 2, 3"},
      {R"({"train_batch_size": 8, "fp16": {"enabled": true, "hysteresis": 4294967298}})",
       "fp16.hysteresis must be in [1, 1000000], got 4294967298"},
      {R"({"train_batch_size": 4611686018427387904, "train_micro_batch_size_per_gpu": 2})",
       "train_batch_size must be at most 2147483648, got 4611686018427387904"},
      {R"({"train_batch_size": 8, "zero_optimization": {"stage": 3,
           "stage3_param_persistence_threshold": -1}})",
       "zero_optimization.stage3_param_persistence_threshold must be >= 0, got -1"},
      {R"({"train_batch_size": 8, "zero_optimization": {"stage": 2, "allgather_bucket_size": -1}})",
       "zero_optimization.allgather_bucket_size must be > 0, got -1"},
      {R"({"train_batch_size": 8, "optimizer": {"type": "Lamb"}})",
       "optimizer.type 'Lamb' is not one of Adam, AdamW, SGD"},
      {R"({"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"betas": [0.9]}}})",
       "optimizer.params.betas must be two numbers"},
      {R"({"train_batch_size": 8, "scheduler": {"type": "OneCycle"}})",
       "scheduler.type 'OneCycle' is not one of WarmupLR, WarmupDecayLR"},
      {R"({"train_batch_size": 8, "scheduler": {"type": "WarmupDecayLR", "params": {}}})",
       "scheduler.params.total_num_steps is missing"},
      {R"({"train_batch_size": 8, "fp16": {"enabled": "yes"}})",
       "fp16.enabled must be true or false, got \"yes\""},
      {R"({"train_batch_size": 8, "fp16": {"enabled": true}, "bf16": {"enabled": true}})",
       "fp16.enabled and bf16.enabled are both true"},
      {R"({"train_batch_size": 8, "gradient_clipping": -1})", "gradient_clipping must be >= 0"},
      {R"([1, 2])", "the top level must be a JSON object"},
      {R"({"train_batch_size": 8, "zero_optimization": {"stage": 2, "mics_shard_size": 0}})",
       "zero_optimization.mics_shard_size must be -1 (shard over every rank) or a group size >= "
       "1, got 0"},
      {R"({"train_batch_size": 8, "activation_checkpointing": {"number_checkpoints": 0}})",
       "activation_checkpointing.number_checkpoints must be >= 1, got 0"},
      {R"({"train_batch_size": 8, "activation_checkpointing": {"cpu_checkpointing": 1}})",
       "activation_checkpointing.cpu_checkpointing must be true or false, got 1"},
  };
  for (const auto& [text, message] : bad) {
    expect_error<UsageError>([&] { DeepSpeedConfig::from_json(Json::parse(text), 1, "ds.json"); },
                             message);
  }
  expect_error<UsageError>([] { DeepSpeedConfig::load("/nonexistent/ds.json", 1); },
                           "deepspeed config /nonexistent/ds.json cannot be read");
}

// Found by the fuzz target tests/fuzz/deepspeed_config: a number too large for a double ended the
// program with the JSON library's out_of_range, not a UsageError naming the file.
TEST(DeepSpeedConfig, AFileThatIsNotJsonIsNamed) {
  const auto dir = cohort::testing::temp_dir("deepspeed_config");
  const auto file = dir / "ds.json";
  for (const std::string text :
       {R"({"train_batch_size": 10e7011})", R"({"train_batch_size": 8,)"}) {
    std::ofstream(file) << text;
    expect_error<UsageError>([&] { DeepSpeedConfig::load(file, 1); },
                             "deepspeed config " + file.string() + " is not valid JSON");
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace cohort::train

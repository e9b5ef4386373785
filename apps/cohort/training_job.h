// The training job that `cohort train` runs and `cohort tune` searches over: a model of the zoo
// on an MNIST-format data set, its options, and the loop every worker runs.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include <CLI/CLI.hpp>

#include "cohort/data/dataset.h"
#include "cohort/json.h"
#include "cohort/optim/lr_scheduler.h"
#include "cohort/parallel/local_sgd.h"
#include "cohort/parallel/zero_optimizer.h"
#include "cohort/train/config.h"

namespace cohort::cli {

struct TrainOptions {
  std::string model = "cnn";
  std::string dataset = "fashion-mnist";
  std::string data_dir;
  int workers = 2;
  int min_workers = 0;  // elastic: the fewest workers a restarted group may have; 0: fixed size
  int threads = 1;
  bool use_gpu = false;
  int gpus_per_worker = 0;  // with use_gpu, 0 means 1
  std::string backend = "auto";
  int epochs = 5;
  int64_t batch_size = 64;
  std::string optimizer = "sgd";
  double lr = 0;  // 0: the optimizer's default
  double momentum = 0.9;
  std::optional<double> weight_decay;  // unset: the optimizer's default (0; adamw 0.01)
  bool flat_optimizer = true;          // cohort's flat optimizers, else libtorch's torch::optim
  double gradient_clipping = 0;        // the gradients' global norm at most this; 0: no clipping
  int64_t warmup_steps = 0;
  std::string lr_decay = "none";  // after the warmup: none, cosine or linear (to 0 at the end)
  std::string precision = "fp32";
  uint64_t seed = 0;
  int64_t max_steps = 0;                    // 0: no limit
  int64_t train_examples = 0;               // the first N training examples only; 0: all
  int64_t test_examples = 0;                // evaluate on the first N test examples only; 0: all
  int64_t gradient_accumulation_steps = 1;  // micro-batches per optimizer step
  parallel::ZeroOptions zero;               // stage 0: DDP
  // ddp, local-sgd:H, diloco:H or async-ps:K (parallel::parse_sync_mode); DiLoCo's outer
  // optimizer, unset: parallel::DiLoCo's defaults.
  std::string sync = "ddp";
  int parameter_servers = 0;  // with async-ps: servers in the first workers; 0: one
  std::optional<double> outer_lr;
  std::optional<double> outer_momentum;
  bool nesterov = true;
  // A DeepSpeed JSON config (apply_deepspeed_config reads it into the fields here).
  std::string deepspeed;
  // From a DeepSpeed config only: Adam's betas and eps, the lr schedule, the fp16 loss scaler.
  std::optional<std::pair<double, double>> betas;
  std::optional<double> eps;
  std::optional<optim::LrScheduleOptions> schedule;
  optim::LossScalerOptions loss_scaler;
  int data_workers = 0;  // preprocessing processes per worker; 0: its prefetch thread
  std::string storage_path = "./cohort_results";
  std::string name;
  bool resume = true;
  int max_failures = 0;
  // FailureConfig.heartbeat_timeout, in seconds.
  double heartbeat_timeout_s =
      std::chrono::duration<double>(cohort::kDefaultHeartbeatTimeout).count();
  int num_to_keep = 2;  // checkpoints kept besides the latest, by test accuracy
  bool quiet = false;
};

// The flags of a training job, on `cmd`.
void add_training_options(CLI::App* cmd, TrainOptions& options);

// With --deepspeed: reads the file (for the job's world size) into the options, printing one
// warning that lists the keys it does not know. UsageError naming the key on bad input.
void apply_deepspeed_config(TrainOptions& options);

// Checks the options and the data before any worker starts; UsageError on bad input.
void validate(const TrainOptions& options);

// The Trainer datasets of a job: "train", normalised by its preprocessing workers.
std::map<std::string, data::Dataset> datasets_of(const TrainOptions& options);

// The sync mode of --sync with DiLoCo's outer options; UsageError naming a bad value.
parallel::SyncMode sync_of(const TrainOptions& options);

// The train_loop_config of a job: what every worker reads.
Json to_json(const TrainOptions& options);

// The workers and the run of a job.
ScalingConfig scaling_of(const TrainOptions& options);
RunConfig run_config_of(const TrainOptions& options);

// The loop each worker runs: trains, evaluates on the test set and reports (with a checkpoint)
// once per epoch.
void train_loop(const Json& config);

}  // namespace cohort::cli

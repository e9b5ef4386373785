// The training job that `cohort train` runs and `cohort tune` searches over: a model of the zoo
// on an MNIST-format data set, its options, and the loop every worker runs.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>

#include "cohort/cli/data_options.h"
#include "cohort/cli/loop_options.h"
#include "cohort/cli/plan_options.h"
#include "cohort/cli/run_options.h"
#include "cohort/cli/scaling_options.h"
#include "cohort/data/data_loader.h"
#include "cohort/data/dataset.h"
#include "cohort/data/tensor_dataset.h"
#include "cohort/json.h"
#include "cohort/models/zoo.h"
#include "cohort/optim/lr_scheduler.h"
#include "cohort/optim/optimizer_options.h"
#include "cohort/parallel/local_sgd.h"
#include "cohort/parallel/zero_optimizer.h"
#include "cohort/train/checkpoint.h"
#include "cohort/train/config.h"
#include "cohort/train/memory_estimate.h"
#include "cohort/train/parallel_model.h"
#include "cohort/train/plan.h"

namespace cohort::cli {

struct TrainOptions {
  std::string model = "cnn";
  // The data: --data (the user's own: images:DIR, csv:FILE, text:FILE, random-tokens:ROWS), or
  // the MNIST-format --dataset and --data-dir; --label ... --data-workers.
  DataOptions data;
  // The transformers' sizes (vit, gpt): models::ModelOptions' depth, width, heads; the GPT's
  // context (also the tokens per row of text data) and whether its head is the embedding's weight.
  int64_t layers = models::ModelOptions{}.depth;
  int64_t width = models::ModelOptions{}.width;
  int64_t heads = models::ModelOptions{}.heads;
  int64_t context = models::ModelOptions{}.context;
  bool untie_embeddings = false;
  // models::ModelOptions::deferred_init: the workers build each unit's parameters only when the
  // plan places them (ZeRO stage 3: this rank's shards, one unit at a time).
  bool deferred_init = false;
  // The workers: --workers (2 by default), --min-workers, --threads, --use-gpu,
  // --gpus-per-worker, --backend, --parameter-servers.
  ScalingOptions scaling{.workers = 2};
  // --epochs, --batch-size, --max-steps, --seed, --warmup-steps, --lr-decay (and a DeepSpeed
  // config's scheduler).
  LoopOptions loop;
  // --optimizer, --lr, --momentum, --sgd-nesterov, --weight-decay, --flat-optimizer (and a
  // DeepSpeed config's optimizer section).
  optim::OptimizerOptions optimizer;
  double memory_budget_gb = 0;  // --memory-budget: refuse a plan estimated over it (0: none)
  // A DeepSpeed JSON config (apply_deepspeed_config reads it into the fields here).
  std::string deepspeed;
  // The plan: degrees, ZeRO, sync mode, precision and loss scaling, accumulation, clipping,
  // capture.
  PlanOptions plan;
  // The run's folder, checkpoints, snapshots, recovery and output (--storage-path ...
  // --profile-steps).
  RunOptions run;
  std::string config_file;  // --config: a JSON or TOML file of these options
};

// The flags of a training job, on `cmd`.
void add_training_options(CLI::App* cmd, TrainOptions& options);

// With --deepspeed: reads the file (for the job's world size) into the options, printing one
// warning that lists the keys it does not know. UsageError naming the key on bad input.
void apply_deepspeed_config(TrainOptions& options);

// Checks the options and the data before any worker starts; UsageError on bad input.
void validate(const TrainOptions& options);

// The memory each worker needs for the job (train::estimate_memory): the model built here as the
// workers build it (its shapes from --data), its activations measured by one forward and backward
// of a micro-batch of random inputs, this process's resident memory before the model as the
// runtime. Needs neither the data set's files (MNIST-format) nor any worker.
train::MemoryEstimate estimate_of(const TrainOptions& options);

// --offload-optimizer disk:PATH: PATH is a writable folder with room for the optimizer state of
// this machine's workers (UsageError naming what is missing); nothing otherwise.
void check_offload_room(const TrainOptions& options);

// The Trainer datasets of a job: "train", normalised by its preprocessing workers.
std::map<std::string, data::Dataset> datasets_of(const TrainOptions& options);

// The train_loop_config of a job: what every worker reads.
Json to_json(const TrainOptions& options);

// The workers and the run of a job.
ScalingConfig scaling_of(const TrainOptions& options);
RunConfig run_config_of(const TrainOptions& options);

// The loop each worker runs: the zoo model made parallel by the job's plan (train::parallelize),
// trained, evaluated on the test set and reported (with a checkpoint) once per epoch.
void train_loop(const Json& config);
// The plan of a job's config (what every worker reads): its PlanOptions keys.
train::Plan plan_of(const Json& config);
// The mesh options' checks that depend on the zoo's model and the CLI's options, before any
// worker starts (the plan's own are train::Plan::validate's): UsageError naming the flag and the
// fix.
void validate_mesh(const TrainOptions& options);

// Parts of the loop.
// The zoo model's options for a job's data (MNIST's 1x28x28 and 10 classes, or what --data
// holds) and its transformer sizes: from a job's config, and from the command line.
models::ModelOptions model_options_of(const Json& config);
models::ModelOptions model_options_of(const TrainOptions& options);
// The model the workers build, its units deferred (models::ModelOptions::deferred_init): its
// shapes, units and layers without their weights, for the checks before any worker starts.
models::ZooModel model_shape_of(const TrainOptions& options);

}  // namespace cohort::cli

/// \file
/// cohort: distributed training for libtorch in C++. The umbrella header.
#pragma once

#include "cohort/error.h"
#include "cohort/json.h"
#include "cohort/limits.h"
#include "cohort/timeouts.h"
#include "cohort/trace.h"

#include "cohort/comm/address.h"
#include "cohort/comm/job_secret.h"
#include "cohort/comm/process_group.h"
#include "cohort/comm/store.h"

#include "cohort/runtime/blas.h"
#include "cohort/runtime/control_channel.h"
#include "cohort/runtime/coordinator.h"
#include "cohort/runtime/environment.h"
#include "cohort/runtime/gpus.h"
#include "cohort/runtime/heap.h"
#include "cohort/runtime/node_launcher.h"
#include "cohort/runtime/worker_group.h"
#include "cohort/runtime/worker_info.h"

#include "cohort/optim/flat_optimizer.h"
#include "cohort/optim/loss_scaler.h"
#include "cohort/optim/lr_scheduler.h"
#include "cohort/optim/precision.h"
#include "cohort/optim/random_state.h"
#include "cohort/optim/state_dict.h"

#include "cohort/parallel/activation_checkpointing.h"
#include "cohort/parallel/distributed_data_parallel.h"
#include "cohort/parallel/fully_shard.h"
#include "cohort/parallel/local_sgd.h"
#include "cohort/parallel/mesh.h"
#include "cohort/parallel/parameter_server.h"
#include "cohort/parallel/pipeline/pipeline.h"
#include "cohort/parallel/pipeline/schedule.h"
#include "cohort/parallel/pipeline/simulator.h"
#include "cohort/parallel/sync_mode.h"
#include "cohort/parallel/tensor_parallel.h"
#include "cohort/parallel/zero_optimizer.h"

#include "cohort/data/block.h"
#include "cohort/data/data_iterator.h"
#include "cohort/data/data_loader.h"
#include "cohort/data/dataset.h"
#include "cohort/data/distributed_sampler.h"
#include "cohort/data/idx.h"
#include "cohort/data/labelled_data.h"
#include "cohort/data/mnist.h"
#include "cohort/data/preprocessors.h"
#include "cohort/data/tensor_dataset.h"

#include "cohort/train/captured_step.h"
#include "cohort/train/checkpoint.h"
#include "cohort/train/config.h"
#include "cohort/train/context.h"
#include "cohort/train/dashboard.h"
#include "cohort/train/deepspeed_config.h"
#include "cohort/train/epoch_loop.h"
#include "cohort/train/memory_estimate.h"
#include "cohort/train/parallel_model.h"
#include "cohort/train/plan.h"
#include "cohort/train/prepare.h"
#include "cohort/train/report.h"
#include "cohort/train/result.h"
#include "cohort/train/summary_writer.h"
#include "cohort/train/throughput.h"
#include "cohort/train/trainer.h"

#include "cohort/tune/scheduler.h"
#include "cohort/tune/search_space.h"
#include "cohort/tune/tuner.h"

/// Distributed training for libtorch: the Trainer, its configs and results (Ray Train's names).
namespace cohort {
/// Rendezvous and collectives: the TCP store and the process groups (Gloo, NCCL).
namespace comm {}
/// Processes: launch modes, the worker group, the coordinator's heartbeats and verdicts, GPUs.
namespace runtime {}
/// Data: datasets and their pipelines (Ray Data's names), loaders, samplers, file formats.
namespace data {}
/// Optimizers and precision: flat fused optimizers, loss scaling, learning-rate schedules.
namespace optim {}
/// Parallelism engines: DDP, ZeRO, pipelines, tensor parallelism, meshes, local SGD, DiLoCo and
/// the parameter server.
namespace parallel {
/// Pipeline parallelism: stages, schedules (GPipe, 1F1B, interleaved, zero-bubble), a simulator.
namespace pipeline {}
}  // namespace parallel
/// The worker's side of a run (prepare_model, report, checkpoints, plans) and the driver's
/// (the Trainer, run directories, TensorBoard, the dashboard).
namespace train {}
/// Hyperparameter search: the Tuner, search spaces, schedulers (Ray Tune's names).
namespace tune {}
/// Command-line options a user's own program can add (the plan's flags, `cohort train`'s).
namespace cli {}
/// The model zoo: MLP, CNN, ResNet-18 and ViT image classifiers.
namespace models {}
/// Where a worker's step time goes: phases, spans and Chrome traces.
namespace trace {}
}  // namespace cohort

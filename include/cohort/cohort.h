// cohort: distributed training for libtorch in C++. The umbrella header.
#pragma once

#include "cohort/error.h"
#include "cohort/json.h"
#include "cohort/timeouts.h"

#include "cohort/comm/process_group.h"
#include "cohort/comm/store.h"

#include "cohort/runtime/control_channel.h"
#include "cohort/runtime/coordinator.h"
#include "cohort/runtime/gpus.h"
#include "cohort/runtime/node_launcher.h"
#include "cohort/runtime/worker_group.h"
#include "cohort/runtime/worker_info.h"

#include "cohort/optim/flat_optimizer.h"
#include "cohort/optim/loss_scaler.h"
#include "cohort/optim/lr_scheduler.h"
#include "cohort/optim/precision.h"

#include "cohort/parallel/distributed_data_parallel.h"
#include "cohort/parallel/local_sgd.h"
#include "cohort/parallel/parameter_server.h"
#include "cohort/parallel/sync_mode.h"
#include "cohort/parallel/zero_optimizer.h"

#include "cohort/data/block.h"
#include "cohort/data/data_iterator.h"
#include "cohort/data/data_loader.h"
#include "cohort/data/dataset.h"
#include "cohort/data/distributed_sampler.h"
#include "cohort/data/idx.h"
#include "cohort/data/mnist.h"
#include "cohort/data/preprocessors.h"
#include "cohort/data/tensor_dataset.h"

#include "cohort/train/checkpoint.h"
#include "cohort/train/config.h"
#include "cohort/train/context.h"
#include "cohort/train/deepspeed_config.h"
#include "cohort/train/prepare.h"
#include "cohort/train/report.h"
#include "cohort/train/result.h"
#include "cohort/train/trainer.h"

#include "cohort/tune/scheduler.h"
#include "cohort/tune/search_space.h"
#include "cohort/tune/tuner.h"

#pragma once
#include <memory>
#include <string>

#include <torch/nn/module.h>

#include "cohort/comm/process_group.h"

namespace cohort::parallel {

struct DdpOptions {
  // After each synchronised backward, rank 0's buffers (batch-norm statistics) are broadcast,
  // so every rank's next forward uses the same buffers, as PyTorch DDP's broadcast_buffers.
  bool broadcast_buffers = true;
  // Gradients travel in flat buckets of at most this size; the first one is smaller so that
  // communication starts early.
  double bucket_cap_mb = 25.0;
  double first_bucket_cap_mb = 1.0;
};

// Data parallelism for any torch::nn::Module: at construction, rank 0's parameters and buffers
// are broadcast to every rank (after a check that every rank holds the same shapes and dtypes);
// then after every backward the gradients are averaged across the group, before the user's
// optimizer step. The model stays the user's own module; nothing in the training loop changes.
class DistributedDataParallel {
 public:
  DistributedDataParallel(std::shared_ptr<torch::nn::Module> module, comm::ProcessGroup group,
                          DdpOptions options = {});
  ~DistributedDataParallel();
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  // While the guard lives, backward passes accumulate gradients locally without communication
  // (gradient accumulation); the first backward after it ends synchronises the sum.
  class NoSyncGuard {
   public:
    explicit NoSyncGuard(DistributedDataParallel& ddp);
    ~NoSyncGuard();
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    DistributedDataParallel& ddp_;
    bool previous_;
  };
  NoSyncGuard no_sync() { return NoSyncGuard(*this); }

  const std::shared_ptr<torch::nn::Module>& module() const;
  const comm::ProcessGroup& process_group() const;
  // Number of backward passes whose gradients were synchronised so far.
  int64_t synchronized_steps() const;

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

}  // namespace cohort::parallel

#include "cohort/parallel/local_sgd.h"

#include <torch/torch.h>

#include <chrono>
#include <type_traits>
#include <utility>

#include "cohort/error.h"
#include "replicas.h"

namespace cohort::parallel {
namespace {

// The outer optimizer of a mode: local SGD is DiLoCo with an outer SGD of lr 1, no momentum.
DiLoCo outer_of(const SyncMode& mode) {
  if (const auto* local = std::get_if<LocalSgd>(&mode)) {
    return {.inner_steps = local->every, .outer_lr = 1.0, .outer_momentum = 0.0, .nesterov = false};
  }
  if (const auto* diloco = std::get_if<DiLoCo>(&mode)) return *diloco;
  throw UsageError("LocalSgdOptimizer: the sync mode is " + to_string(mode) +
                   ", not local-sgd or diloco: prepare the model with that mode's engine");
}

}  // namespace

struct LocalSgdOptimizer::Flat {
  DiLoCo outer;  // the mode as DiLoCo: local SGD is an outer SGD of lr 1 without momentum
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  std::vector<int64_t> offsets;
  at::Tensor global;    // the parameters of the last synchronisation
  at::Tensor delta;     // the pseudo-gradient, all-reduced
  at::Tensor momentum;  // DiLoCo's outer momentum (undefined without)
  std::vector<at::Tensor> float_buffers;

  at::Tensor view(const at::Tensor& flat, size_t i) const {
    return flat.narrow(0, offsets[i], params[i].numel()).view(params[i].sizes());
  }
  std::map<std::string, at::Tensor> named(const at::Tensor& flat) const {
    std::map<std::string, at::Tensor> out;
    if (!flat.defined()) return out;
    for (size_t i = 0; i < params.size(); ++i) out[names[i]] = view(flat, i);
    return out;
  }
  void take_global_from_params() {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) view(global, i).copy_(params[i]);
  }
};

LocalSgdOptimizer::LocalSgdOptimizer(std::shared_ptr<torch::nn::Module> module,
                                     std::unique_ptr<torch::optim::Optimizer> inner,
                                     comm::ProcessGroup group, const SyncMode& mode)
    : torch::optim::Optimizer(detail::param_groups_of(inner.get(), "LocalSgdOptimizer"),
                              detail::defaults_of(inner.get(), "LocalSgdOptimizer")),
      module_(std::move(module)),
      inner_(std::move(inner)),
      group_(std::move(group)),
      mode_(mode),
      flat_(std::make_unique<Flat>()) {
  validate(mode_);
  flat_->outer = outer_of(mode_);
  if (!module_) throw UsageError("LocalSgdOptimizer: the module is null");
  std::vector<at::Tensor> theirs;
  for (const auto& g : inner_->param_groups())
    theirs.insert(theirs.end(), g.params().begin(), g.params().end());
  auto trainable = detail::trainable_parameters(*module_, theirs, "LocalSgdOptimizer");
  flat_->names = std::move(trainable.names);
  flat_->params = std::move(trainable.params);
  std::vector<at::Tensor> buffers;
  for (const auto& b : module_->buffers()) {
    buffers.push_back(b);
    if (b.is_floating_point()) flat_->float_buffers.push_back(b);
  }
  detail::start_replicas(group_, flat_->names, flat_->params, buffers, "LocalSgdOptimizer");
  int64_t total = 0;
  for (const auto& p : flat_->params) {
    flat_->offsets.push_back(total);
    total += p.numel();
  }
  const auto options = flat_->params.front().options().requires_grad(false);
  flat_->global = at::empty({total}, options);
  flat_->delta = at::empty({total}, options);
  if (flat_->outer.outer_momentum > 0) flat_->momentum = at::zeros({total}, options);
  flat_->take_global_from_params();
}

LocalSgdOptimizer::~LocalSgdOptimizer() = default;

int64_t LocalSgdOptimizer::period() const { return flat_->outer.inner_steps; }

void LocalSgdOptimizer::copy_options_to_inner() {
  auto& theirs = inner_->param_groups();
  if (theirs.size() != param_groups_.size()) {
    throw UsageError("LocalSgdOptimizer: " + std::to_string(param_groups_.size()) +
                     " param groups, the inner optimizer " + std::to_string(theirs.size()) +
                     ": add param groups to the inner optimizer before wrapping it");
  }
  for (size_t i = 0; i < theirs.size(); ++i)
    theirs[i].set_options(param_groups_[i].options().clone());
}

torch::Tensor LocalSgdOptimizer::step(LossClosure closure) {
  copy_options_to_inner();
  auto loss = inner_->step(std::move(closure));
  ++steps_since_sync_;
  ++stats_.inner_steps;
  if (steps_since_sync_ >= period()) sync();
  return loss;
}

void LocalSgdOptimizer::sync() {
  if (steps_since_sync_ == 0) return;
  const auto start = std::chrono::steady_clock::now();
  const auto& outer = flat_->outer;
  auto& f = *flat_;
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < f.params.size(); ++i) {
      auto out = f.view(f.delta, i);
      at::sub_out(out, f.view(f.global, i), f.params[i]);
    }
    if (group_.world_size() > 1) {
      std::vector<at::Tensor> delta{f.delta};
      group_.allreduce(delta, comm::ReduceOp::kAvg);
    }
    // Outer SGD on the global parameters, the averaged pseudo-gradient its gradient.
    at::Tensor update = f.delta;
    if (f.momentum.defined()) {
      f.momentum.mul_(outer.outer_momentum).add_(f.delta);
      if (outer.nesterov) {
        f.delta.add_(f.momentum, outer.outer_momentum);
      } else {
        update = f.momentum;
      }
    }
    f.global.sub_(update, outer.outer_lr);
    for (size_t i = 0; i < f.params.size(); ++i) f.params[i].copy_(f.view(f.global, i));
  }
  if (group_.world_size() > 1 && !f.float_buffers.empty())
    detail::average_across_ranks(group_, f.float_buffers);
  steps_since_sync_ = 0;
  ++stats_.outer_steps;
  stats_.sync_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void LocalSgdOptimizer::save(torch::serialize::OutputArchive& archive) const {
  inner_->save(archive);
}

void LocalSgdOptimizer::load(torch::serialize::InputArchive& archive) {
  // The loaded options (a scheduled lr among them) are this optimizer's from now on.
  detail::load_wrapped(*this, *inner_, archive);
}

std::map<std::string, at::Tensor> LocalSgdOptimizer::global_state() const {
  auto out = flat_->named(flat_->global);
  for (const auto& b : module_->named_buffers()) out[b.key()] = b.value();
  return out;
}

std::map<std::string, at::Tensor> LocalSgdOptimizer::outer_momentum() const {
  return flat_->named(flat_->momentum);
}

void LocalSgdOptimizer::restore(const std::map<std::string, at::Tensor>& momentum,
                                const std::map<std::string, at::Tensor>* local,
                                int64_t steps_since_sync, const LocalSgdStats& stats) {
  torch::NoGradGuard no_grad;
  auto& f = *flat_;
  f.take_global_from_params();
  auto take = [&](const std::map<std::string, at::Tensor>& from, const std::string& name,
                  at::Tensor target, const char* what) {
    auto it = from.find(name);
    if (it == from.end() || it->second.numel() != target.numel()) {
      throw UsageError(
          "LocalSgdOptimizer: the checkpoint's " + std::string(what) + " has " +
          (it == from.end() ? "no tensor '" + name + "'" : "another shape for '" + name + "'") +
          ": it was saved from a different model");
    }
    target.copy_(it->second.reshape(target.sizes()));
  };
  if (f.momentum.defined()) {
    f.momentum.zero_();
    if (!momentum.empty()) {
      for (size_t i = 0; i < f.params.size(); ++i)
        take(momentum, f.names[i], f.view(f.momentum, i), "outer momentum");
    }
  }
  steps_since_sync_ = 0;
  if (local != nullptr) {
    for (size_t i = 0; i < f.params.size(); ++i)
      take(*local, f.names[i], f.params[i], "local parameters");
    for (const auto& b : module_->named_buffers())
      take(*local, b.key(), b.value(), "local buffers");
    steps_since_sync_ = steps_since_sync;
  }
  stats_.inner_steps = stats.inner_steps;
  stats_.outer_steps = stats.outer_steps;
}

}  // namespace cohort::parallel

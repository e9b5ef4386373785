#include "cohort/parallel/local_sgd.h"

#include <torch/torch.h>

#include <chrono>
#include <map>
#include <string>
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
  stepped_before_failure_ = false;
  auto loss = inner_->step(std::move(closure));
  ++steps_since_sync_;
  ++stats_.inner_steps;
  if (steps_since_sync_ >= period()) {
    // A synchronisation that fails changes nothing (see sync()): the inner step stands, and the
    // next step synchronises.
    stepped_before_failure_ = true;
    sync();
    stepped_before_failure_ = false;
  }
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
    // The collectives first, into scratch (the pseudo-gradient, copies of the buffers): a peer's
    // failure in them leaves this rank's replica, global parameters and counters as they were.
    std::vector<at::Tensor> buffers;
    if (group_.world_size() > 1) {
      std::vector<at::Tensor> delta{f.delta};
      group_.allreduce(delta, comm::ReduceOp::kAvg);
      for (const auto& b : f.float_buffers) buffers.push_back(b.clone());
      if (!buffers.empty()) detail::average_across_ranks(group_, buffers);
    }
    for (size_t i = 0; i < buffers.size(); ++i) f.float_buffers[i].copy_(buffers[i]);
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

namespace {

// A local SGD checkpoint's tensors, by what they are (see optim::kReplicasPart).
constexpr const char* kReplica = optim::kReplicaTensors;    // a rank's parameters and buffers
constexpr const char* kInner = optim::kInnerTensors;        // its inner optimizer's state
constexpr const char* kMomentum = optim::kMomentumTensors;  // DiLoCo's outer momentum

// Rank `rank`'s piece, `values` (n elements, flattened), of a tensor over `world` ranks.
optim::StateTensor rank_piece(const at::Tensor& values, int rank, int world) {
  const int64_t n = values.numel();
  return {.values = values.reshape({-1}), .offset = rank * n, .numel = world * n};
}

}  // namespace

optim::OptimizerState LocalSgdOptimizer::inner_state() const {
  std::map<const c10::TensorImpl*, std::string> names;
  for (const auto& p : module_->named_parameters())
    names[p.value().unsafeGetTensorImpl()] = p.key();
  std::vector<std::string> in_order;
  for (const auto& g : inner_->param_groups()) {
    for (const auto& p : g.params()) {
      const auto found = names.find(p.unsafeGetTensorImpl());
      in_order.push_back(found == names.end() ? std::string() : found->second);
    }
  }
  try {
    return optim::OptimizerState(*inner_, std::move(in_order));
  } catch (const UsageError& e) {
    throw UsageError(std::string("LocalSgdOptimizer: a checkpoint keeps the inner optimizer's "
                                 "state by parameter name, for SGD, Adam or AdamW with one param "
                                 "group: ") +
                     e.what());
  }
}

optim::StateDict LocalSgdOptimizer::state_dict() const {
  return state_as(group_.rank(), group_.world_size(), group_.rank() == 0);
}

optim::StateDict LocalSgdOptimizer::replica_state_as(int rank, int world_size) const {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    throw UsageError("LocalSgdOptimizer::replica_state_as: rank " + std::to_string(rank) + " of " +
                     std::to_string(world_size) + ": a rank is in [0, world_size)");
  }
  return state_as(rank, world_size, true);
}

optim::StateDict LocalSgdOptimizer::state_as(int rank, int world, bool with_momentum) const {
  const auto& f = *flat_;
  optim::StateDict out;
  out.shard = rank;
  out.shards = world;
  for (size_t i = 0; i < f.params.size(); ++i)
    out.tensors[kReplica + f.names[i]] = rank_piece(f.params[i].detach(), rank, world);
  for (const auto& b : module_->named_buffers())
    out.tensors[kReplica + b.key()] = rank_piece(b.value().detach(), rank, world);
  auto inner = inner_state().state_dict();
  for (auto& [name, piece] : inner.tensors)
    out.tensors[kInner + name] = rank_piece(piece.values, rank, world);
  if (with_momentum && f.momentum.defined()) {
    for (size_t i = 0; i < f.params.size(); ++i)
      out.tensors[kMomentum + f.names[i]] = rank_piece(f.view(f.momentum, i), 0, 1);
  }
  out.values = std::move(inner.values);
  out.values["lr"] = param_groups_.front().options().get_lr();
  out.values["world_size"] = world;
  out.values["sync"] = to_string(mode_);
  out.values["momentum"] = f.momentum.defined();
  out.values["steps_since_sync"] = steps_since_sync_;
  out.values["inner_steps"] = stats_.inner_steps;
  out.values["outer_steps"] = stats_.outer_steps;
  return out;
}

void LocalSgdOptimizer::check_state(const Json& values) const { inner_state().check_state(values); }

optim::StateDict LocalSgdOptimizer::state_to_load(const Json& values) const {
  const auto inner = inner_state().state_dict();
  optim::StateDict out;
  auto room_for = [](const optim::StateTensor& piece) {
    return at::empty({piece.values.numel()}, piece.values.options());
  };
  if (!values.contains("world_size")) {
    // A whole optimizer's state: the inner optimizer's, by name.
    for (const auto& [name, piece] : inner.tensors)
      out.tensors[name] = {.values = room_for(piece), .offset = 0, .numel = piece.numel};
    return out;
  }
  const int written = values["world_size"].get<int>();
  const int rank = group_.rank();
  const int world = group_.world_size();
  // As many ranks: each its own replica, or the one live recovery gives it ("replica_from", see
  // train/live_recovery.h); another number: the state of rank (rank mod written).
  const int given = values.value("replica_from", rank);
  if (written == world && (given < 0 || given >= written)) {
    throw UsageError("LocalSgdOptimizer: the state to load gives rank " + std::to_string(rank) +
                     " the replica of rank " + std::to_string(given) + " of the " +
                     std::to_string(written) +
                     " that wrote it: it was altered or written by another program");
  }
  const int from = written == world ? given : rank % written;
  for (const auto& [name, piece] : inner.tensors)
    out.tensors[kInner + name] = rank_piece(room_for(piece), from, written);
  const auto& f = *flat_;
  if (written == world) {
    for (size_t i = 0; i < f.params.size(); ++i)
      out.tensors[kReplica + f.names[i]] = rank_piece(at::empty_like(f.params[i]), from, world);
    for (const auto& b : module_->named_buffers())
      out.tensors[kReplica + b.key()] = rank_piece(at::empty_like(b.value()), from, world);
  }
  if (f.momentum.defined() && values.value("momentum", false)) {
    for (size_t i = 0; i < f.params.size(); ++i)
      out.tensors[kMomentum + f.names[i]] = rank_piece(at::empty_like(f.params[i]), 0, 1);
  }
  return out;
}

void LocalSgdOptimizer::load_state_dict(const optim::StateDict& state) {
  torch::NoGradGuard no_grad;
  auto& f = *flat_;
  const bool own = state.values.contains("world_size");
  auto take = [&](const std::string& name, at::Tensor target) {
    const auto found = state.tensors.find(name);
    if (found == state.tensors.end() || found->second.values.numel() != target.numel()) {
      throw UsageError("LocalSgdOptimizer: the state to load has " +
                       (found == state.tensors.end() ? "no tensor '" + name + "'"
                                                     : "another size for '" + name + "'") +
                       ": it was written for a different model");
    }
    target.copy_(found->second.values.view(target.sizes()));
  };
  // The inner optimizer's state, steps and learning rate.
  auto inner = inner_state();
  auto wanted = inner.state_dict();
  for (auto& [name, piece] : wanted.tensors) {
    const auto found = state.tensors.find(own ? kInner + name : name);
    if (found == state.tensors.end()) {
      throw UsageError("LocalSgdOptimizer: the state to load holds no inner optimizer state '" +
                       name + "': it was written for a different model");
    }
    piece.values = found->second.values;
  }
  wanted.values = state.values;
  inner.load_state_dict(wanted);
  param_groups_.front().options().set_lr(
      state.values.value("lr", param_groups_.front().options().get_lr()));
  // The module's (loaded) parameters are the global ones; a replica continues from its own.
  f.take_global_from_params();
  if (f.momentum.defined()) {
    f.momentum.zero_();
    if (own && state.values.value("momentum", false)) {
      for (size_t i = 0; i < f.params.size(); ++i)
        take(kMomentum + f.names[i], f.view(f.momentum, i));
    }
  }
  steps_since_sync_ = 0;
  if (state.tensors.count(kReplica + f.names.front()) > 0) {
    for (size_t i = 0; i < f.params.size(); ++i) take(kReplica + f.names[i], f.params[i]);
    for (const auto& b : module_->named_buffers()) take(kReplica + b.key(), b.value());
    steps_since_sync_ = state.values.value("steps_since_sync", int64_t{0});
  }
  stats_.inner_steps = own ? state.values.value("inner_steps", int64_t{0}) : 0;
  stats_.outer_steps = own ? state.values.value("outer_steps", int64_t{0}) : 0;
}

}  // namespace cohort::parallel

#include "cohort/parallel/activation_checkpointing.h"

#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/version.h>

#include <algorithm>
#include <optional>
#include <set>
#include <type_traits>
#include <unordered_set>
#include <utility>

#include "cohort/error.h"
#include "cohort/optim/precision.h"
#include "cohort/optim/random_state.h"
#include "cohort/parallel/fully_shard.h"
#include "grad_accumulator.h"

namespace cohort::parallel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The generators set to a forward's states while it lives, then put back: the recomputation
// draws what the forward drew, and whatever runs after it draws what it would have without it.
class RandomStatesScope {
 public:
  explicit RandomStatesScope(const optim::GeneratorStates* states) {
    if (states == nullptr) return;
    std::vector<c10::Device> devices;
    for (const auto& entry : states->cuda) devices.push_back(entry.first);
    own_ = optim::GeneratorStates::capture(devices);
    states->restore();
    active_ = true;
  }
  ~RandomStatesScope() {
    if (active_) own_.restore();
  }
  RandomStatesScope(const RandomStatesScope&) = delete;
  RandomStatesScope& operator=(const RandomStatesScope&) = delete;

 private:
  optim::GeneratorStates own_;
  bool active_ = false;
};

// Buffers put back as they were when the scope began (BatchNorm's running statistics, updated
// by the recomputation a second time).
class BuffersScope {
 public:
  explicit BuffersScope(const std::vector<at::Tensor>& buffers) : buffers_(buffers) {
    at::NoGradGuard no_grad;
    for (const auto& b : buffers_) values_.push_back(b.defined() ? b.clone() : b);
  }
  ~BuffersScope() {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < buffers_.size(); ++i)
      if (buffers_[i].defined()) buffers_[i].copy_(values_[i]);
  }
  BuffersScope(const BuffersScope&) = delete;
  BuffersScope& operator=(const BuffersScope&) = delete;

 private:
  const std::vector<at::Tensor>& buffers_;
  std::vector<at::Tensor> values_;
};

// What backward needs to run the function again: held by the autograd node.
struct Recomputation : torch::CustomClassHolder {
  CheckpointedFunction fn;
  size_t num_inputs = 0;
  std::vector<at::Tensor> parameters;
  std::vector<at::Tensor> buffers;
  optim::AutocastState autocast;
  std::optional<optim::GeneratorStates> random;
};

// The leaves (parameters, inputs) that the recomputed graph from `roots` accumulates into and
// that are not in `known`: a parameter the caller did not list.
std::vector<at::Tensor> unlisted_leaves(const std::vector<at::Tensor>& roots,
                                        const std::unordered_set<const c10::TensorImpl*>& known) {
  std::vector<at::Tensor> out;
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> pending;
  for (const auto& r : roots)
    if (r.grad_fn()) pending.push_back(r.grad_fn().get());
  while (!pending.empty()) {
    auto* node = pending.back();
    pending.pop_back();
    if (!seen.insert(node).second) continue;
    if (auto* accumulate = dynamic_cast<torch::autograd::AccumulateGrad*>(node)) {
      const auto& leaf = accumulate->variable;
      if (leaf.defined() && known.count(leaf.unsafeGetTensorImpl()) == 0) out.push_back(leaf);
      continue;
    }
    for (const auto& edge : node->next_edges())
      if (edge.function) pending.push_back(edge.function.get());
  }
  return out;
}

// Whether anything but the engine's post-hooks listens to `p`'s gradient as it is accumulated:
// a tensor hook (register_hook), or in libtorch 2.x a post-accumulate hook. Those must see the
// gradient where the caller's backward accumulates it.
bool has_gradient_hooks(const at::Tensor& p) {
  if (!torch::autograd::impl::hooks(p).empty()) return true;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
  if (torch::autograd::impl::post_acc_grad_hooks(p) != nullptr) return true;
#endif
  return false;
}

// While it lives, the parameters' gradients accumulate through new accumulators, without the
// hooks on the parameters' own (DDP's, ZeRO's): the graph recorded meanwhile (the
// recomputation's) has edges to the new ones. The own ones are put back at its end, in reverse
// order, so that a parameter listed twice ends with its own.
class SubstituteAccumulators {
 public:
  explicit SubstituteAccumulators(const std::vector<at::Tensor>& params) : params_(params) {
    for (const auto& p : params_) {
      own_.push_back(torch::autograd::impl::grad_accumulator(p));
      substitutes_.push_back(detail::new_grad_accumulator(p));
      detail::set_grad_accumulator(p, substitutes_.back());
    }
  }
  ~SubstituteAccumulators() {
    for (size_t i = params_.size(); i-- > 0;) detail::set_grad_accumulator(params_[i], own_[i]);
  }
  SubstituteAccumulators(const SubstituteAccumulators&) = delete;
  SubstituteAccumulators& operator=(const SubstituteAccumulators&) = delete;

 private:
  std::vector<at::Tensor> params_;
  std::vector<detail::GradAccumulator> own_, substitutes_;
};

// A tensor's hooks (register_hook): read-only in libtorch 1.13, whose grad() does not run them.
using TensorHooks =
    std::remove_const_t<std::remove_reference_t<decltype(torch::autograd::impl::hooks(
        std::declval<const at::Tensor&>()))>>;

// Takes a tensor's hooks out of `hooks`, and puts them back, where libtorch lets them be moved
// (templates, so that only the branch of the installed libtorch is compiled).
template <class Hooks>
void take_hooks(Hooks& hooks, TensorHooks& taken) {
  if constexpr (!std::is_const_v<Hooks>) {
    taken = std::move(hooks);
    hooks.clear();
  }
}
template <class Hooks>
void put_back_hooks(Hooks& hooks, TensorHooks& taken) {
  if constexpr (!std::is_const_v<Hooks>) {
    for (auto& hook : hooks) taken.push_back(std::move(hook));  // registered meanwhile: after
    hooks = std::move(taken);
  }
}

// While it lives, the parameters' tensor hooks are set aside. libtorch 2.x runs them on the
// gradients grad() captures, and the caller's backward runs them again as it accumulates what
// the checkpoint returns: twice, where without checkpointing they run once.
class TensorHooksAside {
 public:
  explicit TensorHooksAside(const std::vector<at::Tensor>& params) {
    for (const auto& p : params) {
      TensorHooks hooks;
      take_hooks(torch::autograd::impl::hooks(p), hooks);
      if (!hooks.empty()) aside_.emplace_back(p, std::move(hooks));
    }
  }
  ~TensorHooksAside() {
    for (auto& [p, hooks] : aside_) put_back_hooks(torch::autograd::impl::hooks(p), hooks);
  }
  TensorHooksAside(const TensorHooksAside&) = delete;
  TensorHooksAside& operator=(const TensorHooksAside&) = delete;

 private:
  std::vector<std::pair<at::Tensor, TensorHooks>> aside_;
};

std::string shape_of(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  // `tensors`: the inputs, then the parameters (edges to their gradient accumulators).
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<Recomputation> r,
                               at::TensorList tensors) {
    std::vector<at::Tensor> inputs(tensors.begin(),
                                   tensors.begin() + static_cast<std::ptrdiff_t>(r->num_inputs));
    ctx->save_for_backward(inputs);
    ctx->saved_data["recomputation"] = at::IValue::make_capsule(r);
    return r->fn(inputs);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto r = c10::static_intrusive_pointer_cast<Recomputation>(
        ctx->saved_data["recomputation"].toCapsule());
    const bool create_graph = at::GradMode::is_enabled();
    std::vector<at::Tensor> inputs;
    for (const auto& saved : ctx->get_saved_variables()) {
      if (!saved.defined()) {
        inputs.push_back(saved);
        continue;
      }
      auto input = saved.detach();
      input.requires_grad_(saved.requires_grad());
      inputs.push_back(std::move(input));
    }
    // What to differentiate by: the inputs and parameters whose gradients the caller's backward
    // needs (a pipeline's input-only backward needs no parameter's).
    std::vector<size_t> needed_inputs, needed_params;
    for (size_t i = 0; i < inputs.size(); ++i)
      if (inputs[i].defined() && inputs[i].requires_grad() && ctx->needs_input_grad(i))
        needed_inputs.push_back(i);
    for (size_t j = 0; j < r->parameters.size(); ++j)
      if (ctx->needs_input_grad(r->num_inputs + j)) needed_params.push_back(j);
    std::vector<at::Tensor> params;
    for (size_t j : needed_params) params.push_back(r->parameters[j]);
    // In a backward that accumulates every leaf's gradient (loss.backward(), not grad() or
    // backward(inputs)), the recomputed backward adds each parameter's gradient to its .grad as
    // soon as it is made, through a substitute accumulator, and frees it. Returned instead, the
    // unit's parameter gradients are all live at once until this backward ends: ResNet-18's
    // last block held both its 9.4 MB weight gradients so, more than the activations it saves.
    // The parameters' own accumulators then run after this node with no gradient: their hooks
    // (DDP's, ZeRO's) fire once, in the caller's backward, and find .grad complete. A parameter
    // with hooks of its own (register_hook) has its gradient returned: they see it there.
    bool accumulate = !create_graph && !params.empty() &&
                      torch::autograd::Engine::get_default_engine().is_checkpoint_valid();
    for (const auto& p : params)
      if (has_gradient_hooks(p)) accumulate = false;
    std::optional<SubstituteAccumulators> substitutes;
    if (accumulate) substitutes.emplace(params);
    std::vector<at::Tensor> outputs;
    // Put back once the recomputed graph is differentiated: BatchNorm's backward reads the
    // running statistics it saved, at the version the recomputation left.
    BuffersScope buffers(r->buffers);
    {
      RandomStatesScope random(r->random ? &*r->random : nullptr);
      optim::AutocastStateGuard autocast(r->autocast);
      at::AutoGradMode grad(true);
      outputs = r->fn(inputs);
    }
    if (outputs.size() != grad_outputs.size()) {
      throw std::logic_error("parallel::checkpoint: the function returned " +
                             std::to_string(outputs.size()) + " tensors when run again, " +
                             std::to_string(grad_outputs.size()) +
                             " the first time: it must be deterministic in its outputs");
    }
    std::vector<at::Tensor> roots, root_grads;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].defined() && outputs[i].requires_grad() && grad_outputs[i].defined()) {
        roots.push_back(outputs[i]);
        root_grads.push_back(grad_outputs[i]);
      }
    }
    std::unordered_set<const c10::TensorImpl*> known;
    for (const auto& input : inputs)
      if (input.defined()) known.insert(input.unsafeGetTensorImpl());
    for (const auto& p : r->parameters) known.insert(p.unsafeGetTensorImpl());
    const auto unlisted = unlisted_leaves(roots, known);
    if (!unlisted.empty()) {
      throw UsageError("parallel::checkpoint: the function uses " +
                       std::to_string(unlisted.size()) +
                       " tensor(s) that require a gradient and are neither its inputs nor in "
                       "CheckpointOptions::parameters (the first of shape " +
                       shape_of(unlisted[0]) +
                       "): their gradients would be lost; list them, e.g. with "
                       "checkpoint_options_of(module)");
    }
    // The first gradient is the Recomputation's (not a tensor): none.
    variable_list grads(1 + r->num_inputs + r->parameters.size());
    if (roots.empty()) return grads;
    std::vector<at::Tensor> by;
    for (size_t i : needed_inputs) by.push_back(inputs[i]);
    by.insert(by.end(), params.begin(), params.end());
    if (by.empty()) return grads;
    if (accumulate) {
      // The inputs are leaves of the recomputed graph: their gradients accumulate as well.
      torch::autograd::backward(roots, root_grads, /*retain_graph=*/false,
                                /*create_graph=*/false, by);
      for (size_t i : needed_inputs) grads[1 + i] = inputs[i].grad();
      return grads;
    }
    std::vector<at::Tensor> g;
    {
      TensorHooksAside hooks_aside(params);
      g = torch::autograd::grad(roots, by, root_grads, /*retain_graph=*/create_graph, create_graph,
                                /*allow_unused=*/true);
    }
    for (size_t k = 0; k < needed_inputs.size(); ++k) grads[1 + needed_inputs[k]] = g[k];
    for (size_t k = 0; k < needed_params.size(); ++k)
      grads[1 + r->num_inputs + needed_params[k]] = g[needed_inputs.size() + k];
    return grads;
  }
};

void add_cuda_device(const at::Tensor& t, std::vector<c10::Device>& devices) {
  if (!t.defined() || !t.is_cuda()) return;
  if (std::find(devices.begin(), devices.end(), t.device()) == devices.end())
    devices.push_back(t.device());
}

// "cohort::models::(anonymous namespace)::BasicBlockImpl" -> "BasicBlock".
std::string short_type(std::string name) {
  const auto colon = name.rfind("::");
  if (colon != std::string::npos) name = name.substr(colon + 2);
  constexpr std::string_view kImpl = "Impl";
  if (name.size() > kImpl.size() &&
      name.compare(name.size() - kImpl.size(), kImpl.size(), kImpl) == 0)
    name.resize(name.size() - kImpl.size());
  return name;
}

struct Unit {
  CheckpointedUnit description;
  std::shared_ptr<FullyShardImpl> module;
};

std::vector<Unit> units_of(const torch::nn::Module& module) {
  std::vector<Unit> units;
  for (const auto& item : module.named_modules("", /*include_self=*/false)) {
    if (auto unit = std::dynamic_pointer_cast<FullyShardImpl>(item.value()))
      units.push_back({{item.key(), short_type(unit->module()->name())}, unit});
  }
  return units;
}

std::vector<Unit> chosen_units(const torch::nn::Module& module,
                               const ActivationCheckpointing& policy,
                               const UnitChoiceOptions& options, std::vector<Unit>& all) {
  policy.validate();
  all = units_of(module);
  const std::string flag = "--activation-checkpointing " + to_string(policy);
  if (!policy.enabled()) return {};
  if (all.empty()) {
    throw UsageError(flag + ": the model " + module.name() +
                     " has no units to checkpoint; wrap its layers in parallel::FullyShard");
  }
  std::string listing;
  for (const auto& u : all)
    listing += (listing.empty() ? "" : ", ") + u.description.name + " (" + u.description.type + ")";
  std::vector<Unit> chosen;
  if (policy.every > 0) {
    // Without a pipeline the last unit stays plain (UnitChoiceOptions::pipeline says why).
    const size_t counted = options.pipeline ? all.size() : all.size() - 1;
    for (size_t i = 0; i < counted; ++i)
      if ((i + 1) % static_cast<size_t>(policy.every) == 0) chosen.push_back(all[i]);
    if (!chosen.empty()) return chosen;
    const auto& last = all.back().description.name;
    if (counted == 0) {
      throw UsageError(flag + ": the model's one unit, " + last +
                       ", is recomputed in backward right after the forward, which saves no "
                       "memory; give layers:" +
                       last + " to checkpoint it anyway");
    }
    throw UsageError(flag + " chooses none of the model's " + std::to_string(all.size()) +
                     " units but the last (" + last +
                     "), which backward recomputes right after the forward, saving no memory: "
                     "use every:K with K <= " +
                     std::to_string(counted));
  }
  std::set<size_t> picked;
  for (const auto& wanted : policy.layers) {
    bool found = false;
    for (size_t i = 0; i < all.size(); ++i) {
      const auto& d = all[i].description;
      if (d.name == wanted || d.type == wanted || d.name.rfind(wanted + ".", 0) == 0) {
        picked.insert(i);
        found = true;
      }
    }
    if (!found) {
      throw UsageError(flag + ": the model has no unit named or of type '" + wanted +
                       "'; its units: " + listing);
    }
  }
  for (size_t i : picked) chosen.push_back(all[i]);
  return chosen;
}

}  // namespace

std::vector<at::Tensor> checkpoint(const CheckpointedFunction& fn,
                                   const std::vector<at::Tensor>& inputs,
                                   const CheckpointOptions& options) {
  if (!fn) throw UsageError("parallel::checkpoint: the function is empty");
  if (!at::GradMode::is_enabled()) return fn(inputs);
  auto r = c10::make_intrusive<Recomputation>();
  r->fn = fn;
  r->num_inputs = inputs.size();
  r->buffers = options.buffers;
  r->autocast = optim::AutocastState::current();
  std::vector<at::Tensor> tensors = inputs;
  std::vector<c10::Device> devices;
  for (const auto& t : inputs) add_cuda_device(t, devices);
  std::unordered_set<const c10::TensorImpl*> listed;
  for (const auto& p : options.parameters) {
    if (!p.defined() || !p.requires_grad()) continue;
    // Listed twice (a module shared by two parents), it would have its gradient returned twice.
    if (!listed.insert(p.unsafeGetTensorImpl()).second) continue;
    r->parameters.push_back(p);
    tensors.push_back(p);
    add_cuda_device(p, devices);
  }
  if (options.preserve_rng_state) r->random = optim::GeneratorStates::capture(devices);
  return CheckpointFunction::apply(r, at::TensorList(tensors));
}

CheckpointOptions checkpoint_options_of(const torch::nn::Module& module) {
  CheckpointOptions options;
  for (const auto& p : module.parameters())
    if (p.requires_grad()) options.parameters.push_back(p);
  for (const auto& b : module.buffers()) options.buffers.push_back(b);
  return options;
}

at::Tensor checkpoint(const torch::nn::Module& module,
                      const std::function<at::Tensor(const at::Tensor&)>& fn,
                      const at::Tensor& input) {
  // fn by value: backward runs it after the caller's has gone.
  return checkpoint([fn](const std::vector<at::Tensor>& in) { return std::vector{fn(in[0])}; },
                    {input}, checkpoint_options_of(module))[0];
}

std::vector<CheckpointedUnit> checkpointed_units(const torch::nn::Module& module,
                                                 const ActivationCheckpointing& policy,
                                                 const UnitChoiceOptions& options) {
  std::vector<Unit> all;
  std::vector<CheckpointedUnit> out;
  for (const auto& u : chosen_units(module, policy, options, all)) out.push_back(u.description);
  return out;
}

std::vector<CheckpointedUnit> apply_activation_checkpointing(torch::nn::Module& module,
                                                             const ActivationCheckpointing& policy,
                                                             const UnitChoiceOptions& options) {
  std::vector<Unit> all;
  const auto chosen = chosen_units(module, policy, options, all);
  for (const auto& u : all) u.module->set_activation_checkpointing(false);
  std::vector<CheckpointedUnit> out;
  for (const auto& u : chosen) {
    u.module->set_activation_checkpointing(true);
    out.push_back(u.description);
  }
  return out;
}

}  // namespace cohort::parallel

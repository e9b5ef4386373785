#include "train/zero_checkpoint.h"

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>

#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <type_traits>
#include <utility>
#include <vector>

#include "cohort/error.h"
#include "cohort/optim/flat_optimizer.h"
#include "cohort/train/checkpoint.h"
#include "train/model_file.h"
#include "train/run_files.h"

namespace cohort::train::detail {
namespace {

// A ZeRO optimizer's state, sharded: every rank writes its pieces of each parameter's state as
// "<parameter>/<state>/<first element>" into zero-rank<r>-of-<N>.safetensors, and rank 0 the
// manifest, which lists the files and what every piece needs to resume. A load at any world
// size reads, for each piece of its own shard, only the overlapping ranges.
constexpr const char* kZeroFormat = "cohort.zero.v1";

std::string zero_shard_file(int rank, int world_size) {
  return rank_file("zero", rank, world_size, ".safetensors");
}

// The shard files of a ZeRO checkpoint: its manifest, and what each file holds of every
// parameter's state.
class ZeroShards {
 public:
  explicit ZeroShards(std::filesystem::path dir) : dir_(std::move(dir)) {
    const auto manifest_file = dir_ / kZeroManifest;
    manifest_ = read_json(manifest_file);
    if (manifest_.value("format", "") != kZeroFormat) {
      throw UsageError("checkpoint " + dir_.string() + ": " + manifest_file.filename().string() +
                       " is not a ZeRO manifest of format " + kZeroFormat);
    }
    for (const auto& f : manifest_.at("files")) {
      const auto file = dir_ / f.get<std::string>();
      if (!std::filesystem::exists(file)) {
        throw UsageError("checkpoint " + dir_.string() + ": the shard file " +
                         file.filename().string() + " named by " + kZeroManifest + " is missing");
      }
      headers_.emplace_back(file, safetensors::read_header(file));
    }
    for (const auto& [file, header] : headers_) {
      for (const auto& [name, info] : header.tensors) {
        const auto slash = name.rfind('/');
        if (slash == std::string::npos || info.shape.size() != 1) continue;
        entries_[name.substr(0, slash)].push_back(
            {file, &header, name, std::stoll(name.substr(slash + 1)), info.shape[0]});
      }
    }
  }

  const Json& manifest() const { return manifest_; }
  // Whether the shards hold any of `parameter`'s state.
  bool holds(const std::string& parameter) const {
    const auto found = entries_.lower_bound(parameter + "/");
    return found != entries_.end() && found->first.rfind(parameter + "/", 0) == 0;
  }

  // Throws when the checkpoint holds another algorithm's state than `algorithm` with `names`.
  void check_algorithm(const std::string& algorithm, const std::vector<std::string>& names) const {
    if (manifest_.value("algorithm", "") != algorithm ||
        manifest_.value("state_names", Json::array()) != Json(names)) {
      throw UsageError("checkpoint " + dir_.string() + " holds " +
                       manifest_.value("algorithm", std::string("?")) + " state (" +
                       manifest_.value("state_names", Json::array()).dump() +
                       "); this optimizer is " + algorithm + " (" + Json(names).dump() +
                       "): resume with the optimizer that wrote it");
    }
  }

  // Elements [begin, begin + target.numel()) of state `state` of `parameter` into `target`;
  // throws naming the range when the shards do not cover it.
  void read(const std::string& parameter, const std::string& state, int64_t begin,
            at::Tensor target) const {
    const int64_t length = target.numel();
    int64_t covered = 0;
    const auto found = entries_.find(parameter + "/" + state);
    if (found != entries_.end()) {
      for (const auto& e : found->second) {
        const int64_t start = std::max(begin, e.begin);
        const int64_t end = std::min(begin + length, e.begin + e.length);
        if (start >= end) continue;
        auto part = target.narrow(0, start - begin, end - start);
        auto buffer = part.is_contiguous() && part.is_cpu() && part.scalar_type() == at::kFloat
                          ? part
                          : at::empty({end - start}, at::kFloat);
        safetensors::read_elements(e.file, *e.header, e.name, start - e.begin, buffer);
        if (!buffer.is_same(part)) part.copy_(buffer);
        covered += end - start;
      }
    }
    if (covered != length) {
      throw UsageError("checkpoint " + dir_.string() + ": its ZeRO shards cover " +
                       std::to_string(covered) + " of the " + std::to_string(length) +
                       " elements [" + std::to_string(begin) + ", " +
                       std::to_string(begin + length) + ") of " + state + " of parameter '" +
                       parameter + "': a shard file is missing or altered, or the model differs");
    }
  }

 private:
  struct Entry {
    std::filesystem::path file;
    const safetensors::Header* header;
    std::string name;
    int64_t begin, length;
  };
  std::filesystem::path dir_;
  Json manifest_;
  std::vector<std::pair<std::filesystem::path, safetensors::Header>> headers_;
  std::map<std::string, std::vector<Entry>> entries_;  // by "<parameter>/<state>"
};

// The one param group of a whole optimizer, and each of its parameters' names in `module`.
std::vector<std::string> parameter_names(const torch::optim::Optimizer& optimizer,
                                         const torch::nn::Module& module, const char* who) {
  if (optimizer.param_groups().size() != 1) {
    throw UsageError(std::string(who) + ": the optimizer has " +
                     std::to_string(optimizer.param_groups().size()) +
                     " param groups; ZeRO checkpoints move into and out of one");
  }
  std::map<const c10::TensorImpl*, std::string> names;
  for (const auto& p : module.named_parameters()) names[p.value().unsafeGetTensorImpl()] = p.key();
  std::vector<std::string> out;
  for (const auto& p : optimizer.param_groups()[0].params()) {
    const auto found = names.find(p.unsafeGetTensorImpl());
    if (found == names.end()) {
      throw UsageError(std::string(who) + ": the optimizer holds a parameter of shape " +
                       c10::str(p.sizes()) + " that is not the model's");
    }
    out.push_back(found->second);
  }
  return out;
}

// torch::optim's per-parameter state map is keyed by the parameter's TensorImpl: as a string in
// libtorch 1.13, as the pointer in 2.x.
using StateKey = std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>::key_type;
template <typename Key = StateKey>
Key state_key(const at::Tensor& p) {
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream key;  // as libtorch 1.13 writes it (c10::guts::to_string, gone in 2.x)
    key << p.unsafeGetTensorImpl();
    return key.str();
  } else {
    return p.unsafeGetTensorImpl();
  }
}

using ParameterState = optim::FlatOptimizer::ParameterState;

// Parameter `index` of a whole optimizer's one group: its steps and state buffers (flattened).
ParameterState state_of(torch::optim::Optimizer& optimizer, const std::string& algorithm,
                        size_t index) {
  if (auto* flat = dynamic_cast<optim::FlatOptimizer*>(&optimizer))
    return flat->parameter_state(0, index);
  const auto& p = optimizer.param_groups()[0].params()[index];
  const auto names = optim::state_names_of(algorithm, optimizer.param_groups()[0].options());
  ParameterState out;
  const auto found = optimizer.state().find(state_key(p));
  auto flat_copy = [&](const at::Tensor& t) {
    return t.defined() ? t.detach().reshape({-1}).to(at::kCPU, at::kFloat)
                       : at::zeros({p.numel()}, at::kFloat);
  };
  if (found == optimizer.state().end()) {  // never stepped
    for (size_t s = 0; s < names.size(); ++s) out.values.push_back(at::zeros({p.numel()}));
    return out;
  }
  const auto& state = *found->second;
  if (algorithm == "sgd") {
    if (!names.empty())
      out.values.push_back(
          flat_copy(static_cast<const torch::optim::SGDParamState&>(state).momentum_buffer()));
    return out;
  }
  auto adam = [&](const auto& s) {
    out.steps = s.step();
    out.values.push_back(flat_copy(s.exp_avg()));
    out.values.push_back(flat_copy(s.exp_avg_sq()));
    if (names.size() == 3) out.values.push_back(flat_copy(s.max_exp_avg_sq()));
  };
  if (algorithm == "adam") {
    adam(static_cast<const torch::optim::AdamParamState&>(state));
  } else {
    adam(static_cast<const torch::optim::AdamWParamState&>(state));
  }
  return out;
}

void set_state(torch::optim::Optimizer& optimizer, const std::string& algorithm, size_t index,
               const ParameterState& state) {
  if (auto* flat = dynamic_cast<optim::FlatOptimizer*>(&optimizer))
    return flat->set_parameter_state(0, index, state);
  const auto& p = optimizer.param_groups()[0].params()[index];
  auto shaped = [&](size_t s) { return state.values[s].reshape(p.sizes()).to(p.options()); };
  std::unique_ptr<torch::optim::OptimizerParamState> param_state;
  if (algorithm == "sgd") {
    if (state.values.empty()) return;  // no momentum: nothing to keep
    auto sgd = std::make_unique<torch::optim::SGDParamState>();
    sgd->momentum_buffer(shaped(0));
    param_state = std::move(sgd);
  } else {
    auto adam = [&](auto s) {
      s->step(state.steps);
      s->exp_avg(shaped(0));
      s->exp_avg_sq(shaped(1));
      if (state.values.size() == 3) s->max_exp_avg_sq(shaped(2));
      param_state = std::move(s);
    };
    if (algorithm == "adam") {
      adam(std::make_unique<torch::optim::AdamParamState>());
    } else {
      adam(std::make_unique<torch::optim::AdamWParamState>());
    }
  }
  optimizer.state()[state_key(p)] = std::move(param_state);
}

// A torch::optim optimizer of `algorithm` with `options` of its type over `params`.
std::unique_ptr<torch::optim::Optimizer> make_torch_optimizer(
    const std::string& algorithm, std::vector<at::Tensor> params,
    const torch::optim::OptimizerOptions& options) {
  if (algorithm == "sgd") {
    return std::make_unique<torch::optim::SGD>(
        params, static_cast<const torch::optim::SGDOptions&>(options));
  }
  if (algorithm == "adam") {
    return std::make_unique<torch::optim::Adam>(
        params, static_cast<const torch::optim::AdamOptions&>(options));
  }
  return std::make_unique<torch::optim::AdamW>(
      params, static_cast<const torch::optim::AdamWOptions&>(options));
}

// Optimizer state by parameter name, from one folder of save_optimizer_state: ZeRO's shards, or
// a whole optimizer's optimizer.pt read over stand-ins of its parameters (whose names and shapes,
// in the writer's order, the caller knows).
class StateSource {
 public:
  static StateSource shards(const std::filesystem::path& dir) {
    StateSource out;
    out.shards_.emplace(dir);
    out.steps_ = out.shards_->manifest().at("steps").get<int64_t>();
    out.lr_ = out.shards_->manifest().at("lr").get<double>();
    return out;
  }

  // `parameters`: the writer's, in its order, by name and shape.
  static StateSource file(
      const std::filesystem::path& file,
      const std::vector<std::pair<std::string, std::vector<int64_t>>>& parameters,
      const std::string& algorithm, const torch::optim::OptimizerOptions& options) {
    if (!std::filesystem::exists(file)) {
      throw UsageError("checkpoint " + file.parent_path().string() +
                       " holds neither ZeRO shards nor an optimizer.pt");
    }
    std::vector<at::Tensor> stand_ins;
    for (const auto& [name, shape] : parameters) stand_ins.push_back(at::zeros(shape, at::kFloat));
    torch::serialize::InputArchive archive;
    archive.load_from(file.string());
    torch::serialize::InputArchive probe;
    const bool flat = archive.try_read("cohort_flat_state", probe);
    std::unique_ptr<torch::optim::Optimizer> writer =
        flat ? std::unique_ptr<torch::optim::Optimizer>(optim::make_flat_optimizer(
                   {torch::optim::OptimizerParamGroup(stand_ins)}, algorithm, options))
             : make_torch_optimizer(algorithm, stand_ins, options);
    load_optimizer(*writer, file);
    StateSource out;
    for (size_t i = 0; i < parameters.size(); ++i) {
      auto state = state_of(*writer, algorithm, i);
      out.steps_ = std::max(out.steps_, state.steps);
      out.whole_[parameters[i].first] = std::move(state);
    }
    out.lr_ = writer->param_groups()[0].options().get_lr();
    return out;
  }

  bool holds(const std::string& parameter) const {
    return shards_ ? shards_->holds(parameter) : whole_.count(parameter) > 0;
  }
  // Throws when the shards hold another algorithm's state (a file is read as `algorithm`).
  void check_algorithm(const std::string& algorithm, const std::vector<std::string>& names) const {
    if (shards_) shards_->check_algorithm(algorithm, names);
  }
  // Elements [begin, begin + target.numel()) of state `names[s]` of `parameter` into `target`.
  void read(const std::string& parameter, const std::vector<std::string>& names, size_t s,
            int64_t begin, at::Tensor target) const {
    if (shards_) return shards_->read(parameter, names[s], begin, std::move(target));
    target.copy_(whole_.at(parameter).values.at(s).narrow(0, begin, target.numel()));
  }
  int64_t steps() const { return steps_; }
  double lr() const { return lr_; }

 private:
  std::optional<ZeroShards> shards_;
  std::map<std::string, ParameterState> whole_;  // a file's, by name
  int64_t steps_ = 0;
  double lr_ = 0;
};

using PartParameter = OptimizerPart::Parameter;

// Optimizer state from several sources (a pipeline's stages, tensor-parallel slices), found by a
// name common to all (the whole model's) that each source may call otherwise and hold a slice
// of.
class NamedState {
 public:
  // `parameters`: the source's, by the whole model's names and slices (none: every parameter
  // under its whole name, whole).
  void add(StateSource source, std::vector<PartParameter> parameters = {}, std::string what = {}) {
    Source out{std::move(source), {}, std::move(what)};
    for (auto& p : parameters) {
      std::string whole = p.whole_name;
      out.parameters.emplace(std::move(whole), std::move(p));
    }
    sources_.push_back(std::move(out));
  }
  void check_algorithm(const std::string& algorithm, const std::vector<std::string>& names) const {
    for (const auto& s : sources_) s.source.check_algorithm(algorithm, names);
  }
  // Elements [begin, begin + target.numel()) of state `names[s]` of the whole model's parameter
  // `whole`, as `layout` holds it (null: whole): straight from the source that holds it whole,
  // else from its whole state gathered from the slices and cut anew.
  void read(const std::string& whole, const std::vector<std::string>& names, size_t s,
            int64_t begin, at::Tensor target, const PartParameter* layout) const {
    std::vector<Holder> holders;
    for (const auto& source : sources_) {
      const auto found = source.parameters.find(whole);
      const PartParameter* p = found == source.parameters.end() ? nullptr : &found->second;
      std::string local = p != nullptr ? p->name : whole;
      if (source.source.holds(local)) holders.push_back({&source, std::move(local), p});
    }
    if (holders.empty()) {
      std::string where;
      for (const auto& source : sources_) where += (where.empty() ? "" : ", ") + source.what;
      throw UsageError("the checkpoint holds no optimizer state for parameter '" + whole + "'" +
                       (where.empty() ? "" : " (in " + where + ")") +
                       ": it was written for another model");
    }
    const bool sliced_here = layout != nullptr && layout->slices > 1;
    const bool sliced_there = holders[0].parameter != nullptr && holders[0].parameter->slices > 1;
    if (!sliced_here && !sliced_there) {
      const auto& h = holders[0];
      return h.source->source.read(h.local, names, s, begin, std::move(target));
    }
    const at::Tensor& region = recut(whole, names, s, holders, layout);
    if (begin + target.numel() > region.numel()) {
      throw UsageError("the checkpoint's optimizer state of parameter '" + whole + "' has " +
                       std::to_string(region.numel()) + " elements here, fewer than " +
                       std::to_string(begin + target.numel()) +
                       ": it was written for another model");
    }
    target.copy_(region.narrow(0, begin, target.numel()));
  }
  int64_t steps() const {
    int64_t steps = 0;
    for (const auto& s : sources_) steps = std::max(steps, s.source.steps());
    return steps;
  }
  double lr() const { return sources_.at(0).source.lr(); }

 private:
  struct Source {
    StateSource source;
    std::map<std::string, PartParameter> parameters;  // by whole name
    std::string what;
  };
  struct Holder {
    const Source* source;
    std::string local;
    const PartParameter* parameter;  // null: whole, under its whole name
  };

  // The state `names[s]` of `whole` as `layout` holds it, flat: the whole state read from one
  // source or gathered from every slice, then cut by `layout`. Kept for the next call (ZeRO reads
  // a parameter in pieces).
  const at::Tensor& recut(const std::string& whole, const std::vector<std::string>& names, size_t s,
                          const std::vector<Holder>& holders, const PartParameter* layout) const {
    const std::string key = whole + "/" + names[s];
    if (key == cached_key_) return cached_;
    const PartParameter* first = holders[0].parameter;
    at::Tensor state;
    if (first == nullptr || first->slices == 1) {
      auto shape = first != nullptr ? first->shape : layout->shape;
      if (first == nullptr) shape[static_cast<size_t>(layout->cut.dim)] *= layout->slices;
      state = at::empty(shape, at::kFloat);
      holders[0].source->source.read(holders[0].local, names, s, 0, state.view({-1}));
    } else {
      auto shape = first->shape;
      shape[static_cast<size_t>(first->cut.dim)] *= first->slices;
      state = at::empty(shape, at::kFloat);
      std::vector<bool> found(static_cast<size_t>(first->slices), false);
      for (const auto& h : holders) {
        if (h.parameter == nullptr || h.parameter->slices != first->slices) continue;
        at::Tensor slice = at::empty(h.parameter->shape, at::kFloat);
        h.source->source.read(h.local, names, s, 0, slice.view({-1}));
        parallel::set_tensor_parallel_slice(state, h.parameter->cut, h.parameter->slice,
                                            h.parameter->slices, slice);
        found[static_cast<size_t>(h.parameter->slice)] = true;
      }
      for (size_t i = 0; i < found.size(); ++i) {
        if (found[i]) continue;
        throw UsageError("the checkpoint holds no slice " + std::to_string(i) + " of " +
                         std::to_string(first->slices) + " of parameter '" + whole +
                         "': a tensor-parallel part of it is missing");
      }
    }
    if (layout != nullptr && layout->slices > 1)
      state = parallel::tensor_parallel_slice(state, layout->cut, layout->slice, layout->slices);
    cached_ = state.contiguous().view({-1});
    cached_key_ = key;
    return cached_;
  }

  std::vector<Source> sources_;
  mutable std::string cached_key_;
  mutable at::Tensor cached_;
};

// A loading rank's parameters by their names in its module (or the ZeRO engine's), each with the
// whole model's name and the slice held here; a name it lacks is the whole model's, whole.
class Layout {
 public:
  Layout() = default;  // every parameter whole, under the whole model's name
  explicit Layout(const std::vector<PartParameter>& parameters) {
    for (const auto& p : parameters) by_name_[p.name] = &p;
  }
  const PartParameter* described(const std::string& name) const {
    const auto found = by_name_.find(name);
    return found == by_name_.end() ? nullptr : found->second;
  }
  std::string whole(const std::string& name) const {
    const PartParameter* p = described(name);
    return p == nullptr ? name : p->whole_name;
  }

 private:
  std::map<std::string, const PartParameter*> by_name_;
};

// `state` into `optimizer`: a ZeroOptimizer's shard (its pieces' ranges), or a whole optimizer
// over `module`'s parameters (unused for ZeRO: its pieces are named), as `layout` names them.
void load_named_state(const NamedState& state, torch::optim::Optimizer& optimizer,
                      const torch::nn::Module* module, const Layout& layout) {
  torch::NoGradGuard no_grad;
  if (auto* zero = dynamic_cast<parallel::ZeroOptimizer*>(&optimizer)) {
    const auto names = zero->state_names();
    state.check_algorithm(zero->algorithm(), names);
    for (const auto& piece : zero->shard_pieces()) {
      auto buffers = zero->shard_state(piece.group);
      for (size_t s = 0; s < names.size(); ++s)
        state.read(layout.whole(piece.parameter), names, s, piece.begin,
                   buffers[s].narrow(0, piece.offset, piece.length),
                   layout.described(piece.parameter));
    }
    zero->set_steps(state.steps());
    for (auto& group : zero->param_groups()) group.options().set_lr(state.lr());
    return;
  }
  const auto algorithm = optim::algorithm_of(optimizer, "load_checkpoint",
                                             "ZeRO checkpoints load into SGD, Adam or AdamW");
  const auto names = optim::state_names_of(algorithm, optimizer.param_groups()[0].options());
  state.check_algorithm(algorithm, names);
  const auto parameters = parameter_names(optimizer, *module, "load_checkpoint");
  for (size_t i = 0; i < parameters.size(); ++i) {
    const int64_t numel = optimizer.param_groups()[0].params()[i].numel();
    ParameterState values{.steps = state.steps(), .values = {}};
    for (size_t s = 0; s < names.size(); ++s) {
      values.values.push_back(at::empty({numel}, at::kFloat));
      state.read(layout.whole(parameters[i]), names, s, 0, values.values.back(),
                 layout.described(parameters[i]));
    }
    set_state(optimizer, algorithm, i, values);
  }
  optimizer.param_groups()[0].options().set_lr(state.lr());
}

// Walks a model's tensors in name order (std::map's, which keeps each unit's together) and
// keeps the stage-3 unit that holds the current one gathered, releasing the one before: no more
// than the largest unit is whole at once. Every rank of the group walks the same names.
class UnitByUnit {
 public:
  UnitByUnit(const parallel::ZeroOptimizer& zero, bool write_back)
      : zero_(zero), units_(zero.unit_names()), write_back_(write_back) {}

  // Whether every tensor whose storage stage 3 emptied lies in a unit by name: false for a module
  // that names them otherwise than the engine's (e.g. a parent of it), which must gather whole.
  bool covers(const std::map<std::string, at::Tensor>& tensors) const {
    for (const auto& [name, tensor] : tensors) {
      if (tensor.numel() > 0 && tensor.storage().nbytes() == 0 && unit_of(name) < 0) return false;
    }
    return true;
  }

  void visit(const std::string& tensor) {
    const int64_t unit = unit_of(tensor);
    if (unit == current_) return;
    gathered_.reset();
    current_ = unit;
    if (unit >= 0) gathered_.emplace(zero_, static_cast<size_t>(unit), write_back_);
  }

 private:
  int64_t unit_of(const std::string& tensor) const {
    for (size_t u = 0; u < units_.size(); ++u)
      if (units_[u].empty() || tensor.rfind(units_[u] + ".", 0) == 0) return int64_t(u);
    return -1;
  }

  const parallel::ZeroOptimizer& zero_;
  std::vector<std::string> units_;
  bool write_back_;
  int64_t current_ = -1;
  std::optional<parallel::ZeroOptimizer::GatheredParameters> gathered_;
};

}  // namespace

std::string rank_file(const char* stem, int rank, int world_size, const char* extension) {
  return std::string(stem) + "-rank" + std::to_string(rank) + "-of-" + std::to_string(world_size) +
         extension;
}

void save_zero_shards(const parallel::ZeroOptimizer& zero, const std::filesystem::path& dir) {
  torch::NoGradGuard no_grad;
  const auto& group = zero.process_group();
  const auto names = zero.state_names();
  const auto pieces = zero.shard_pieces();
  std::map<std::string, at::Tensor> tensors;
  for (const auto& piece : pieces) {
    const auto state = zero.shard_state(piece.group);
    for (size_t s = 0; s < names.size(); ++s) {
      tensors[piece.parameter + "/" + names[s] + "/" + std::to_string(piece.begin)] =
          state[s].narrow(0, piece.offset, piece.length);
    }
  }
  safetensors::write(dir / zero_shard_file(group.rank(), group.world_size()), tensors,
                     {{"format", kZeroFormat}});
  if (group.rank() != 0) return;
  Json files = Json::array();
  for (int r = 0; r < group.world_size(); ++r)
    files.push_back(zero_shard_file(r, group.world_size()));
  const auto& options = zero.param_groups().front().options();
  write_atomically(dir / kZeroManifest, Json{{"format", kZeroFormat},
                                             {"world_size", group.world_size()},
                                             {"stage", zero.stage()},
                                             {"algorithm", zero.algorithm()},
                                             {"steps", zero.steps()},
                                             {"lr", options.get_lr()},
                                             {"state_names", names},
                                             {"files", files}}
                                                .dump(2) +
                                            "\n");
}

void load_zero_shards(torch::optim::Optimizer& optimizer, const torch::nn::Module& module,
                      const std::filesystem::path& dir) {
  NamedState state;
  state.add(StateSource::shards(dir));
  load_named_state(state, optimizer, &module, Layout());
}

void load_optimizer_file_into_zero(parallel::ZeroOptimizer& zero, const torch::nn::Module& module,
                                   const std::filesystem::path& file) {
  // The writer's optimizer was over the model's trainable parameters in their order (as a DDP
  // run builds it).
  std::vector<std::pair<std::string, std::vector<int64_t>>> parameters;
  for (const auto& p : module.named_parameters())
    if (p.value().requires_grad()) parameters.emplace_back(p.key(), p.value().sizes().vec());
  NamedState state;
  state.add(
      StateSource::file(file, parameters, zero.algorithm(), zero.param_groups().front().options()));
  load_named_state(state, zero, nullptr, Layout());
}

void save_model_by_unit(const parallel::ZeroOptimizer& zero, const torch::nn::Module& module,
                        const std::filesystem::path& file) {
  const auto tensors = model_tensors(module);
  UnitByUnit units(zero, /*write_back=*/false);
  if (!units.covers(tensors)) {
    parallel::ZeroOptimizer::GatheredParameters whole(zero);
    if (zero.process_group().rank() == 0) save_model(module, file);
    return;
  }
  if (zero.process_group().rank() != 0) {
    for (const auto& [name, tensor] : tensors) units.visit(name);  // rank 0's gathers
    return;
  }
  std::map<std::string, std::pair<at::ScalarType, std::vector<int64_t>>> layout;
  for (const auto& [name, tensor] : tensors)
    layout[name] = {tensor.scalar_type(), tensor.sizes().vec()};
  safetensors::write_streaming(file, layout, {{"format", "pt"}}, [&](const std::string& name) {
    units.visit(name);
    return tensors.at(name);
  });
}

void load_model_by_unit(const parallel::ZeroOptimizer& zero, torch::nn::Module& module,
                        const std::filesystem::path& file) {
  const auto header = safetensors::read_header(file);
  const auto tensors = model_tensors(module);
  // load_model's checks, before any gather: every rank reads the same header.
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& [name, info] : header.tensors) shapes[name] = info.shape;
  check_model_file(file, module, shapes);
  torch::NoGradGuard no_grad;
  UnitByUnit units(zero, /*write_back=*/true);
  if (!units.covers(tensors)) {
    parallel::ZeroOptimizer::GatheredParameters whole(zero, /*write_back=*/true);
    load_model(module, file);
    return;
  }
  for (const auto& [name, tensor] : tensors) {
    units.visit(name);
    const auto& info = header.tensors.at(name);
    at::Tensor staging = at::empty(info.shape, at::TensorOptions(info.dtype));
    safetensors::read_elements(file, header, name, 0, staging);
    at::Tensor target = tensor;
    target.copy_(staging);
  }
}

}  // namespace cohort::train::detail

namespace cohort::train {
namespace {

constexpr const char* kPartFile = "optimizer_part.json";
constexpr const char* kPartFormat = "cohort.optimizer-part.v1";

}  // namespace

void save_optimizer_part(const OptimizerPart& part) {
  Json parameters = Json::array();
  for (const auto& p : part.parameters) {
    Json parameter{{"name", p.name}, {"whole_name", p.whole_name}, {"shape", p.shape}};
    if (p.slices > 1) {
      parameter["slice"] = {
          {"index", p.slice}, {"count", p.slices}, {"dim", p.cut.dim}, {"blocks", p.cut.blocks}};
    }
    parameters.push_back(std::move(parameter));
  }
  std::filesystem::create_directories(part.dir);
  write_atomically(part.dir / kPartFile,
                   Json{{"format", kPartFormat}, {"parameters", parameters}}.dump(1) + "\n");
}

std::vector<OptimizerPart> find_optimizer_parts(const std::filesystem::path& checkpoint_dir) {
  std::vector<OptimizerPart> parts;
  if (!std::filesystem::is_directory(checkpoint_dir)) return parts;
  for (const auto& entry : std::filesystem::directory_iterator(checkpoint_dir)) {
    const auto file = entry.path() / kPartFile;
    if (!entry.is_directory() || !std::filesystem::exists(file)) continue;
    const Json json = read_json(file);
    if (json.value("format", "") != kPartFormat) {
      throw UsageError("checkpoint " + checkpoint_dir.string() + ": " + file.string() +
                       " is not an optimizer part of format " + kPartFormat);
    }
    OptimizerPart part{.dir = entry.path(), .parameters = {}};
    for (const auto& p : json.at("parameters")) {
      OptimizerPart::Parameter parameter{.name = p.at("name").get<std::string>(),
                                         .whole_name = p.at("whole_name").get<std::string>(),
                                         .shape = p.at("shape").get<std::vector<int64_t>>()};
      if (p.contains("slice")) {
        const auto& slice = p.at("slice");
        parameter.cut = {.dim = slice.at("dim").get<int64_t>(),
                         .blocks = slice.at("blocks").get<int64_t>()};
        parameter.slice = slice.at("index").get<int64_t>();
        parameter.slices = slice.at("count").get<int64_t>();
      }
      part.parameters.push_back(std::move(parameter));
    }
    parts.push_back(std::move(part));
  }
  std::sort(parts.begin(), parts.end(),
            [](const auto& a, const auto& b) { return a.dir.filename() < b.dir.filename(); });
  return parts;
}

void load_optimizer_parts(const std::vector<OptimizerPart>& parts,
                          torch::optim::Optimizer& optimizer, const torch::nn::Module& module,
                          const std::vector<OptimizerPart::Parameter>& layout) {
  if (parts.empty()) throw UsageError("load_optimizer_parts: no parts to load from");
  const detail::Layout names(layout);
  // The whole model's names this optimizer needs, and its algorithm (a file is read as one).
  auto* zero = dynamic_cast<parallel::ZeroOptimizer*>(&optimizer);
  std::set<std::string> needed;
  if (zero != nullptr) {
    for (const auto& piece : zero->shard_pieces()) needed.insert(names.whole(piece.parameter));
  } else {
    for (const auto& name : detail::parameter_names(optimizer, module, "load_optimizer_parts"))
      needed.insert(names.whole(name));
  }
  const std::string algorithm =
      zero != nullptr ? zero->algorithm()
                      : optim::algorithm_of(optimizer, "load_optimizer_parts",
                                            "optimizer parts load into SGD, Adam or AdamW");
  const auto& options = zero != nullptr ? zero->param_groups().front().options()
                                        : optimizer.param_groups().front().options();
  // Only the parts that hold some of them (the first at least, for the steps and the lr).
  std::vector<const OptimizerPart*> wanted;
  for (const auto& part : parts) {
    for (const auto& p : part.parameters) {
      if (needed.count(p.whole_name) == 0) continue;
      wanted.push_back(&part);
      break;
    }
  }
  if (wanted.empty()) wanted.push_back(&parts.front());
  detail::NamedState state;
  for (const OptimizerPart* part_pointer : wanted) {
    const auto& part = *part_pointer;
    std::vector<std::pair<std::string, std::vector<int64_t>>> in_order;
    for (const auto& p : part.parameters) in_order.emplace_back(p.name, p.shape);
    const auto what = part.dir.filename().string();
    if (std::filesystem::exists(part.dir / detail::kZeroManifest)) {
      state.add(detail::StateSource::shards(part.dir), part.parameters, what);
    } else {
      state.add(detail::StateSource::file(detail::whole_optimizer_file(part.dir), in_order,
                                          algorithm, options),
                part.parameters, what);
    }
  }
  detail::load_named_state(state, optimizer, &module, names);
}

}  // namespace cohort::train

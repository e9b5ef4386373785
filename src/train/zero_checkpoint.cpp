#include "train/zero_checkpoint.h"

#include <c10/util/accumulate.h>
#include <torch/serialize.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "cohort/error.h"
#include "cohort/optim/flat_optimizer.h"
#include "cohort/optim/state_dict.h"
#include "cohort/train/checkpoint.h"
#include "train/kept_tensors.h"
#include "train/model_file.h"
#include "train/run_files.h"
#include "train/state_files.h"

namespace cohort::train::detail {

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

namespace {

// The module's trainable parameters in order, by name and shape: what an inner optimizer or a
// DDP run's optimizer was built over.
std::vector<std::pair<std::string, std::vector<int64_t>>> trainable_shapes(
    const torch::nn::Module& module) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  for (const auto& p : module.named_parameters())
    if (p.value().requires_grad()) out.emplace_back(p.key(), p.value().sizes().vec());
  return out;
}

// An optimizer as a part with state: itself when it is one (an engine such as ZeRO, whose shard
// it is), else its whole state under `module`'s names (optim::OptimizerState).
class OptimizerAsPart {
 public:
  OptimizerAsPart(torch::optim::Optimizer& optimizer, const torch::nn::Module& module,
                  const char* who)
      : optimizer_(optimizer) {
    part_ = dynamic_cast<optim::Stateful*>(&optimizer);
    if (part_ != nullptr) return;
    whole_ =
        std::make_unique<optim::OptimizerState>(optimizer, parameter_names(optimizer, module, who));
    part_ = whole_.get();
  }

  optim::Stateful& part() const { return *part_; }
  // Its algorithm and its options: to read another program's archive as this optimizer's kind.
  std::string algorithm(const char* who) const {
    // An engine (a part itself) names its own: its optimizer may wrap another.
    if (!whole_) {
      if (auto named = part_->state_dict().values.value("algorithm", ""); !named.empty())
        return named;
    }
    return optim::algorithm_of(optimizer_, who, "its state moves between SGD, Adam or AdamW only");
  }
  const torch::optim::OptimizerOptions& options() const {
    return optimizer_.param_groups().front().options();
  }

 private:
  torch::optim::Optimizer& optimizer_;
  optim::Stateful* part_ = nullptr;
  std::unique_ptr<optim::OptimizerState> whole_;
};

// Optimizer state by "<parameter>/<state>", from one folder of save_optimizer_state: ZeRO's
// shards, or a whole optimizer's optimizer.pt read over stand-ins of its parameters (whose names
// and shapes, in the writer's order, the caller knows).
class StateSource {
 public:
  static StateSource shards(const std::filesystem::path& dir) {
    StateSource out;
    out.files_.emplace(dir, optim::kOptimizerShardsPart);
    out.values_ = out.files_->values();
    return out;
  }

  // Local SGD's replicas (optim::kReplicasPart): the first rank's inner optimizer state, whose
  // pieces begin at element 0 of their tensors over the ranks.
  static StateSource first_replica(const std::filesystem::path& dir) {
    StateSource out;
    out.files_.emplace(dir, optim::kReplicasPart);
    out.prefix_ = optim::kInnerTensors;
    // A whole optimizer's values: not the replicas' (world size, period), which would ask a
    // local SGD reader for them.
    const Json& all = out.files_->values();
    out.values_ = optim::optimizer_state_values(
        all.value("algorithm", ""), all.value("state_names", std::vector<std::string>{}),
        all.value("steps", int64_t{0}), all.value("lr", 0.0));
    return out;
  }

  // `parameters`: the writer's, in its order, by name and shape; `algorithm` and `options`: the
  // reader's (the file is read as its kind).
  static StateSource file(
      const std::filesystem::path& file,
      const std::vector<std::pair<std::string, std::vector<int64_t>>>& parameters,
      const std::string& algorithm, const torch::optim::OptimizerOptions& options) {
    if (!std::filesystem::exists(file)) {
      throw UsageError("checkpoint " + file.parent_path().string() +
                       " holds neither ZeRO shards nor an optimizer.pt");
    }
    std::vector<at::Tensor> stand_ins;
    std::vector<std::string> names;
    for (const auto& [name, shape] : parameters) {
      stand_ins.push_back(at::zeros(shape, at::kFloat));
      names.push_back(name);
    }
    torch::serialize::InputArchive archive;
    archive.load_from(file.string());
    torch::serialize::InputArchive probe;
    const bool flat = archive.try_read("cohort_flat_state", probe);
    std::unique_ptr<torch::optim::Optimizer> writer =
        flat ? std::unique_ptr<torch::optim::Optimizer>(optim::make_flat_optimizer(
                   {torch::optim::OptimizerParamGroup(stand_ins)}, algorithm, options))
             : optim::make_torch_optimizer(algorithm, stand_ins, options);
    load_optimizer(*writer, file);
    StateSource out;
    auto state = optim::OptimizerState(*writer, std::move(names)).state_dict();
    out.whole_ = std::move(state.tensors);
    out.values_ = std::move(state.values);
    return out;
  }

  // State held in memory: whole tensors by "<parameter>/<state>", and the writer's values.
  static StateSource whole(std::map<std::string, optim::StateTensor> tensors, Json values) {
    StateSource out;
    out.whole_ = std::move(tensors);
    out.values_ = std::move(values);
    return out;
  }

  bool holds(const std::string& parameter) const {
    if (files_) return files_->holds_prefix(prefix_ + parameter + "/");
    const auto found = whole_.lower_bound(parameter + "/");
    return found != whole_.end() && found->first.rfind(parameter + "/", 0) == 0;
  }
  // The writer's values (algorithm, state names, steps, lr).
  const Json& values() const { return values_; }
  // Elements [begin, begin + target.numel()) of state `state` of `parameter` into `target`.
  void read(const std::string& parameter, const std::string& state, int64_t begin,
            at::Tensor target) const {
    const auto key = parameter + "/" + state;
    if (files_) return files_->read(prefix_ + key, begin, std::move(target));
    const auto found = whole_.find(key);
    if (found == whole_.end()) {
      throw UsageError("the checkpoint holds no " + state + " of parameter '" + parameter +
                       "': it was written for another model");
    }
    target.copy_(found->second.values.narrow(0, begin, target.numel()));
  }

 private:
  std::optional<StateFiles> files_;
  std::string prefix_;                               // of the state's names in files_
  std::map<std::string, optim::StateTensor> whole_;  // a file's, by "<parameter>/<state>"
  Json values_;
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
  // The sources' values: the first's, with the most steps any took.
  Json values() const {
    Json out = sources_.at(0).source.values();
    int64_t steps = 0;
    for (const auto& s : sources_) steps = std::max(steps, s.source.values().value("steps", steps));
    out["steps"] = steps;
    return out;
  }
  // Throws when a source holds state that `part` cannot load (another algorithm).
  void check(const optim::Stateful& part) const {
    for (const auto& s : sources_) part.check_state(s.source.values());
  }
  // Elements [begin, begin + target.numel()) of state `state` of the whole model's parameter
  // `whole`, as `layout` holds it (null: whole): straight from the source that holds it whole,
  // else from its whole state gathered from the slices and cut anew.
  void read(const std::string& whole, const std::string& state, int64_t begin, at::Tensor target,
            const PartParameter* layout) const {
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
      return h.source->source.read(h.local, state, begin, std::move(target));
    }
    const at::Tensor& region = recut(whole, state, holders, layout);
    if (begin + target.numel() > region.numel()) {
      throw UsageError("the checkpoint's optimizer state of parameter '" + whole + "' has " +
                       std::to_string(region.numel()) + " elements here, fewer than " +
                       std::to_string(begin + target.numel()) +
                       ": it was written for another model");
    }
    target.copy_(region.narrow(0, begin, target.numel()));
  }

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

  // The state `state` of `whole` as `layout` holds it, flat: the whole state read from one
  // source or gathered from every slice, then cut by `layout`. Kept for the next call (ZeRO reads
  // a parameter in pieces).
  const at::Tensor& recut(const std::string& whole, const std::string& state_name,
                          const std::vector<Holder>& holders, const PartParameter* layout) const {
    const std::string key = whole + "/" + state_name;
    if (key == cached_key_) return cached_;
    const PartParameter* first = holders[0].parameter;
    at::Tensor state;
    if (first == nullptr || first->slices == 1) {
      auto shape = first != nullptr ? first->shape : layout->shape;
      if (first == nullptr) shape[static_cast<size_t>(layout->cut.dim)] *= layout->slices;
      state = at::empty(shape, at::kFloat);
      holders[0].source->source.read(holders[0].local, state_name, 0, state.view({-1}));
    } else {
      auto shape = first->shape;
      shape[static_cast<size_t>(first->cut.dim)] *= first->slices;
      state = at::empty(shape, at::kFloat);
      std::vector<bool> found(static_cast<size_t>(first->slices), false);
      for (const auto& h : holders) {
        if (h.parameter == nullptr || h.parameter->slices != first->slices) continue;
        at::Tensor slice = at::empty(h.parameter->shape, at::kFloat);
        h.source->source.read(h.local, state_name, 0, slice.view({-1}));
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

// An optimizer state tensor's name, "<parameter>/<state>", split in two.
std::pair<std::string, std::string> parameter_and_state(const std::string& tensor) {
  const auto slash = tensor.rfind('/');
  return {tensor.substr(0, slash), tensor.substr(slash + 1)};
}

// `state` into `part` (a ZeroOptimizer's shard, or a whole optimizer's state): every tensor of
// `wanted` (part.state_to_load(state.values()), what it holds), by its parameter's name in the
// whole model (`layout`).
void load_named_state(const NamedState& state, optim::Stateful& part, optim::StateDict wanted,
                      const Layout& layout) {
  torch::NoGradGuard no_grad;
  state.check(part);
  for (auto& [tensor, piece] : wanted.tensors) {
    const auto [parameter, state_name] = parameter_and_state(tensor);
    state.read(layout.whole(parameter), state_name, piece.offset, piece.values,
               layout.described(parameter));
    if (piece.release) piece.release();  // a state on disk streams
  }
  wanted.values = state.values();
  part.load_state_dict(wanted);
}

// Walks a model's tensors in name order (std::map's, which keeps each unit's together) and
// keeps the stage-3 unit that holds the current one gathered, releasing the one before: no more
// than the largest unit is whole at once. Every rank of the group walks the same names.
class UnitByUnit {
 public:
  UnitByUnit(const optim::ShardedState& sharded, bool write_back)
      : sharded_(sharded), units_(sharded.sharded_units()), write_back_(write_back) {}

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
    if (unit >= 0) gathered_ = sharded_.gather_parameters(unit, write_back_);
  }

 private:
  int64_t unit_of(const std::string& tensor) const {
    for (size_t u = 0; u < units_.size(); ++u)
      if (units_[u].empty() || tensor.rfind(units_[u] + ".", 0) == 0) return int64_t(u);
    return -1;
  }

  const optim::ShardedState& sharded_;
  std::vector<std::string> units_;
  bool write_back_;
  int64_t current_ = -1;
  std::unique_ptr<optim::ParameterGather> gathered_;
};

// The first format of a parameter-server checkpoint ("cohort.parameter_server.v1", of
// cohort 0.1.0): parameter_server.json, and each server's range of the flat parameters (the
// module's trainable ones in order, end to end) in ps-shard-rank<s>-of-<S>.safetensors
// ("state/<name>") with its range, steps, version and pushes in the .json beside it.
constexpr const char* kLegacyPsManifest = "parameter_server.json";
constexpr const char* kLegacyPsFormat = "cohort.parameter_server.v1";

// Its whole optimizer state by "<parameter>/<state>" over `module`'s trainable parameters, and
// values as `target` writes them (its algorithm: the files do not name one) with the files'
// steps, version and pushes and optimizer.pt's learning rate.
StateSource legacy_parameter_server_state(const std::filesystem::path& dir,
                                          const torch::nn::Module& module,
                                          const OptimizerAsPart& target) {
  const auto manifest = read_json(dir / kLegacyPsManifest);
  const int servers = manifest.value("servers", 0);
  if (manifest.value("format", "") != kLegacyPsFormat || servers < 1) {
    throw UsageError("checkpoint " + dir.string() + ": " + kLegacyPsManifest + " is not a " +
                     kLegacyPsFormat + " manifest: it was altered or written by another program");
  }
  const auto params = trainable_shapes(module);
  int64_t numel = 0;
  for (const auto& [name, shape] : params) numel += c10::multiply_integers(shape);
  if (manifest.value("numel", int64_t{-1}) != numel) {
    throw UsageError("checkpoint " + dir.string() + " holds " +
                     std::to_string(manifest.value("numel", int64_t{-1})) +
                     " parameters on its servers, the model " + std::to_string(numel) +
                     ": it was saved from a different model");
  }
  std::map<std::string, at::Tensor> flat;  // by state name, over every parameter
  Json first;
  int64_t covered = 0;
  for (int s = 0; s < servers; ++s) {
    const auto tensors_file = dir / rank_file("ps-shard", s, servers, ".safetensors");
    const auto info_file = dir / rank_file("ps-shard", s, servers, ".json");
    if (!std::filesystem::exists(tensors_file) || !std::filesystem::exists(info_file)) {
      throw UsageError("checkpoint " + dir.string() + " lacks server " + std::to_string(s) +
                       "'s shard (" + tensors_file.filename().string() + " and .json), which " +
                       kLegacyPsManifest + " lists: the checkpoint is incomplete");
    }
    const auto info = read_json(info_file);
    const int64_t begin = info.value("begin", int64_t{-1});
    const int64_t end = info.value("end", int64_t{-1});
    if (begin < 0 || end < begin || end > numel) {
      throw UsageError("checkpoint " + dir.string() + ": " + info_file.filename().string() +
                       " holds the range [" + std::to_string(begin) + ", " + std::to_string(end) +
                       ") of " + std::to_string(numel) + " parameters: it was altered");
    }
    if (s == 0) first = info;
    covered += end - begin;
    for (const auto& [name, tensor] : safetensors::read(tensors_file)) {
      if (name.rfind("state/", 0) != 0) continue;
      if (tensor.numel() != end - begin) {
        throw UsageError("checkpoint " + dir.string() + ": " + tensors_file.filename().string() +
                         " holds " + std::to_string(tensor.numel()) + " elements of " + name +
                         " for a range of " + std::to_string(end - begin) + ": it was altered");
      }
      auto& whole = flat[name.substr(6)];
      if (!whole.defined()) whole = at::zeros({numel}, at::kFloat);
      whole.narrow(0, begin, end - begin).copy_(tensor.reshape({-1}));
    }
  }
  if (covered != numel) {
    throw UsageError("checkpoint " + dir.string() + ": its servers' shards cover " +
                     std::to_string(covered) + " of " + std::to_string(numel) +
                     " parameters: it was altered");
  }
  std::map<std::string, optim::StateTensor> tensors;
  std::vector<std::string> names;
  for (const auto& [state, whole] : flat) names.push_back(state);
  int64_t offset = 0;
  for (const auto& [name, shape] : params) {
    const int64_t n = c10::multiply_integers(shape);
    for (const auto& [state, whole] : flat)
      tensors[name + "/" + state] = {.values = whole.narrow(0, offset, n), .offset = 0, .numel = n};
    offset += n;
  }
  // The writer's algorithm is the reader's when the state kept per element agrees.
  auto values = target.part().state_dict().values;
  const auto expected = values.value("state_names", std::vector<std::string>{});
  if (std::set<std::string>(expected.begin(), expected.end()) ==
      std::set<std::string>(names.begin(), names.end())) {
    names = expected;
  }
  values["state_names"] = names;
  values["steps"] = first.value("optimizer_steps", int64_t{0});
  values["version"] = first.value("version", int64_t{0});
  values["pushes_by_worker"] = first.value("pushes_by_worker", std::vector<int64_t>{});
  if (std::filesystem::exists(dir / "optimizer.pt")) {
    const auto options = StateSource::file(dir / "optimizer.pt", params,
                                           target.algorithm("load_checkpoint"), target.options());
    values["lr"] = options.values().value("lr", values.value("lr", 0.0));
  }
  return StateSource::whole(std::move(tensors), std::move(values));
}

}  // namespace

void load_zero_shards(torch::optim::Optimizer& optimizer, const torch::nn::Module& module,
                      const std::filesystem::path& dir) {
  NamedState state;
  state.add(StateSource::shards(dir));
  const OptimizerAsPart target(optimizer, module, "load_checkpoint");
  load_named_state(state, target.part(), target.part().state_to_load(state.values()), Layout());
}

bool save_optimizer_as_shards(const std::filesystem::path& dir,
                              const torch::optim::Optimizer& optimizer,
                              const torch::nn::Module& module) {
  std::optional<optim::StateDict> state;
  try {
    // Saving reads the state only (state_dict() is const); the part also serves loads.
    auto& reading = const_cast<torch::optim::Optimizer&>(optimizer);
    state = OptimizerAsPart(reading, module, "save_optimizer_as_shards").part().state_dict();
  } catch (const UsageError&) {
    return false;  // another algorithm than SGD, Adam or AdamW
  }
  save_state(dir, optim::kOptimizerShardsPart, *state);
  return true;
}

namespace {

// The first format of a local SGD checkpoint ("cohort.local_sgd.v1", of cohort 0.1.0): rank 0's
// model.safetensors (the global parameters), outer_momentum.safetensors and local_sgd.json; every
// rank's parameters and buffers in local-rank<r>-of-<N>.safetensors and its inner optimizer's
// archive in optimizer-rank<r>-of-<N>.pt.
constexpr const char* kLegacyLocalSgdManifest = "local_sgd.json";
constexpr const char* kLegacyLocalSgdFormat = "cohort.local_sgd.v1";
constexpr const char* kLegacyOuterMomentumFile = "outer_momentum.safetensors";

// Its manifest, checked; nullopt when `dir` has none.
std::optional<Json> read_legacy_local_sgd_manifest(const std::filesystem::path& dir) {
  if (!std::filesystem::exists(dir / kLegacyLocalSgdManifest)) return std::nullopt;
  auto manifest = read_json(dir / kLegacyLocalSgdManifest);
  if (manifest.value("format", "") != kLegacyLocalSgdFormat || !manifest.contains("world_size") ||
      !manifest["world_size"].is_number_integer() || manifest["world_size"].get<int>() < 1) {
    throw UsageError("checkpoint " + dir.string() + ": " + kLegacyLocalSgdManifest + " is not a " +
                     kLegacyLocalSgdFormat +
                     " manifest: it was altered or written by another program");
  }
  return manifest;
}

// Rank `rank`'s file "<stem>-rank<r>-of-<written><extension>" of a first-format local SGD
// checkpoint, which must exist.
std::filesystem::path legacy_local_sgd_file(const std::filesystem::path& dir, const char* stem,
                                            const char* extension, int rank, int written) {
  const auto file = dir / rank_file(stem, rank, written, extension);
  if (!std::filesystem::exists(file)) {
    throw UsageError("checkpoint " + dir.string() + " lacks " + file.filename().string() +
                     ", which its " + kLegacyLocalSgdManifest +
                     " lists: the checkpoint is incomplete");
  }
  return file;
}

}  // namespace

std::filesystem::path whole_optimizer_file(const std::filesystem::path& dir) {
  if (std::filesystem::exists(dir / "optimizer.pt")) return dir / "optimizer.pt";
  const auto manifest = read_legacy_local_sgd_manifest(dir);
  if (!manifest) return dir / "optimizer.pt";
  return legacy_local_sgd_file(dir, "optimizer", ".pt", 0, (*manifest)["world_size"].get<int>());
}

bool is_legacy_local_sgd_checkpoint(const std::filesystem::path& dir) {
  return read_legacy_local_sgd_manifest(dir).has_value();
}

void load_legacy_local_sgd(torch::optim::Optimizer& optimizer, const torch::nn::Module& module,
                           const std::filesystem::path& dir) {
  auto* replicas = dynamic_cast<optim::ShardedState*>(&optimizer);
  if (replicas == nullptr || !replicas->holds_replicas()) {
    throw UsageError("load_legacy_local_sgd: the optimizer holds no replicas");
  }
  const auto manifest = *read_legacy_local_sgd_manifest(dir);
  const int written = manifest["world_size"].get<int>();
  const OptimizerAsPart target(optimizer, module, "load_checkpoint");
  const auto parameters = trainable_shapes(module);
  std::map<int, StateSource> inner;  // by writer
  auto inner_of = [&](int rank) -> const StateSource& {
    if (auto found = inner.find(rank); found != inner.end()) return found->second;
    const auto file = legacy_local_sgd_file(dir, "optimizer", ".pt", rank, written);
    return inner
        .emplace(rank, StateSource::file(file, parameters, target.algorithm("load_checkpoint"),
                                         target.options()))
        .first->second;
  };
  std::map<int, std::map<std::string, at::Tensor>> own;  // by writer
  auto own_of = [&](int rank) -> const std::map<std::string, at::Tensor>& {
    if (auto found = own.find(rank); found != own.end()) return found->second;
    return own
        .emplace(rank, safetensors::read(
                           legacy_local_sgd_file(dir, "local", ".safetensors", rank, written)))
        .first->second;
  };
  // The values the current format keeps, the inner state's those of the writer this rank reads.
  Json values = manifest;
  values.erase("format");
  values["momentum"] = std::filesystem::exists(dir / kLegacyOuterMomentumFile);
  values.update(inner_of(replicas->checkpoint_rank() % written).values());
  replicas->check_state(values);
  auto wanted = replicas->state_to_load(values);
  std::map<std::string, at::Tensor> momentum;
  if (values["momentum"].get<bool>()) momentum = safetensors::read(dir / kLegacyOuterMomentumFile);
  torch::NoGradGuard no_grad;
  for (auto& [name, piece] : wanted.tensors) {
    const int64_t n = piece.values.numel();
    if (n == 0) continue;
    const int rank = static_cast<int>(piece.offset / n);
    auto take = [&](const std::map<std::string, at::Tensor>& from, const std::string& tensor,
                    const std::string& file) {
      const auto found = from.find(tensor);
      if (found == from.end() || found->second.numel() != n) {
        throw UsageError("checkpoint " + dir.string() + ": " + file + " holds " +
                         (found == from.end() ? "no tensor '" + tensor + "'"
                                              : "another size for '" + tensor + "'") +
                         ": it was saved from a different model");
      }
      piece.values.copy_(found->second.reshape({-1}));
    };
    if (name.rfind(optim::kInnerTensors, 0) == 0) {
      const auto [parameter, state] =
          parameter_and_state(name.substr(strlen(optim::kInnerTensors)));
      inner_of(rank).read(parameter, state, 0, piece.values);
    } else if (name.rfind(optim::kReplicaTensors, 0) == 0) {
      take(own_of(rank), name.substr(strlen(optim::kReplicaTensors)),
           rank_file("local", rank, written, ".safetensors"));
    } else if (name.rfind(optim::kMomentumTensors, 0) == 0) {
      take(momentum, name.substr(strlen(optim::kMomentumTensors)), kLegacyOuterMomentumFile);
    } else {
      throw UsageError("checkpoint " + dir.string() +
                       " is local SGD's first format, which holds no '" + name + "'");
    }
  }
  wanted.values = values;
  replicas->load_state_dict(wanted);
}

void load_replicas(torch::optim::Optimizer& optimizer, const torch::nn::Module& module,
                   const std::filesystem::path& dir) {
  if (auto* replicas = dynamic_cast<optim::ShardedState*>(&optimizer);
      replicas != nullptr && replicas->holds_replicas()) {
    // Local SGD's own: its replicas at as many ranks, a new period at another number.
    return load_state(dir, optim::kReplicasPart, *replicas);
  }
  const OptimizerAsPart target(optimizer, module, "load_checkpoint");
  NamedState state;
  state.add(StateSource::first_replica(dir));
  load_named_state(state, target.part(), target.part().state_to_load(state.values()), Layout());
}

bool is_legacy_parameter_server_checkpoint(const std::filesystem::path& dir) {
  return std::filesystem::exists(dir / kLegacyPsManifest);
}

void load_legacy_parameter_server(torch::optim::Optimizer& optimizer,
                                  const torch::nn::Module& module,
                                  const std::filesystem::path& dir) {
  const OptimizerAsPart target(optimizer, module, "load_checkpoint");
  NamedState state;
  state.add(legacy_parameter_server_state(dir, module, target));
  load_named_state(state, target.part(), target.part().state_to_load(state.values()), Layout());
}

void load_optimizer_file_into_part(torch::optim::Optimizer& optimizer,
                                   const torch::nn::Module& module,
                                   const std::filesystem::path& file) {
  // The writer's optimizer was over the model's trainable parameters in their order (as a DDP
  // run builds it).
  const OptimizerAsPart target(optimizer, module, "load_checkpoint");
  NamedState state;
  state.add(StateSource::file(file, trainable_shapes(module), target.algorithm("load_checkpoint"),
                              target.options()));
  load_named_state(state, target.part(), target.part().state_to_load(state.values()), Layout());
}

void save_model_by_unit(const optim::ShardedState& sharded, const torch::nn::Module& module,
                        const std::filesystem::path& file) {
  const auto tensors = model_tensors(module);
  UnitByUnit units(sharded, /*write_back=*/false);
  if (!units.covers(tensors)) {
    const auto whole = sharded.gather_parameters(-1, /*write_back=*/false);
    if (sharded.checkpoint_rank() == 0) save_model(module, file);
    return;
  }
  if (sharded.checkpoint_rank() != 0) {
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

void load_model_shards(const optim::ShardedState& sharded, torch::nn::Module& module,
                       const std::filesystem::path& file) {
  const auto header = tensor_file_header(file);
  const auto tensors = model_tensors(module);
  // load_model's checks, before anything is read: every rank reads the same header.
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& [name, info] : header.tensors) shapes[name] = info.shape;
  check_model_file(file, module, shapes);
  torch::NoGradGuard no_grad;
  const auto pieces = sharded.parameter_shards();
  // A module that names the sharded parameters otherwise than the engine's (a parent of it)
  // gathers them whole, and loads as any module.
  for (const auto& [name, tensor] : tensors) {
    if (tensor.numel() > 0 && tensor.storage().nbytes() == 0 && pieces.count(name) == 0) {
      const auto whole = sharded.gather_parameters(-1, /*write_back=*/true);
      load_model(module, file);
      return;
    }
  }
  for (const auto& [name, tensor] : tensors) {
    const auto piece = pieces.find(name);
    // This rank's range of a sharded parameter, or the whole tensor.
    const int64_t first = piece != pieces.end() ? piece->second.offset : 0;
    at::Tensor target = piece != pieces.end() ? piece->second.values : tensor;
    read_into(file, header, name, first, target);
  }
}

// The module's tensors as this rank's pieces: its ranges of the sharded parameters, the others
// whole (1-D views).
std::map<std::string, optim::StateTensor> model_pieces(const optim::ShardedState& sharded,
                                                       const torch::nn::Module& module) {
  const auto shards = sharded.parameter_shards();
  std::map<std::string, optim::StateTensor> out;
  for (const auto& [name, tensor] : model_tensors(module)) {
    const auto piece = shards.find(name);
    if (piece != shards.end()) {
      out[name] = {.values = piece->second.values.view({-1}),
                   .offset = piece->second.offset,
                   .numel = tensor.numel()};
    } else {
      out[name] = {.values = tensor.detach().reshape({-1}), .offset = 0, .numel = tensor.numel()};
    }
  }
  return out;
}

void save_model_pieces(const std::filesystem::path& dir, const optim::ShardedState& sharded,
                       const torch::nn::Module& module, int shard, int shards) {
  optim::StateDict state;
  state.tensors = model_pieces(sharded, module);
  state.shard = shard;
  state.shards = shards;
  save_own_piece(dir, kModelPiecesPart, state);
}

void load_model_pieces(const optim::ShardedState& sharded, torch::nn::Module& module,
                       const std::filesystem::path& dir) {
  const StateFiles files(dir, kModelPiecesPart);
  const auto shards = sharded.parameter_shards();
  torch::NoGradGuard no_grad;
  for (auto& [name, tensor] : model_tensors(module)) {
    if (const auto piece = shards.find(name); piece != shards.end()) {
      files.read(name, piece->second.offset, piece->second.values.view({-1}));
    } else if (tensor.is_contiguous()) {
      files.read(name, 0, tensor.view({-1}));
    } else {
      auto staging = at::empty({tensor.numel()}, tensor.options());
      files.read(name, 0, staging);
      tensor.copy_(staging.view(tensor.sizes()));
    }
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
  const detail::OptimizerAsPart target(optimizer, module, "load_optimizer_parts");
  // The whole model's names this optimizer needs, and its algorithm (a file is read as one).
  // What it fills from a whole optimizer's state (the parts'), asked once: a whole optimizer's is
  // a copy.
  auto held = target.part().state_to_load(Json::object());
  std::set<std::string> needed;
  for (const auto& [tensor, piece] : held.tensors)
    needed.insert(names.whole(detail::parameter_and_state(tensor).first));
  const std::string algorithm = target.algorithm("load_optimizer_parts");
  const auto& options = target.options();
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
    } else if (holds_state(part.dir, optim::kReplicasPart)) {
      // Local SGD's replicas: their first rank's inner state.
      state.add(detail::StateSource::first_replica(part.dir), part.parameters, what);
    } else {
      state.add(detail::StateSource::file(detail::whole_optimizer_file(part.dir), in_order,
                                          algorithm, options),
                part.parameters, what);
    }
  }
  detail::load_named_state(state, target.part(), std::move(held), names);
}

}  // namespace cohort::train

#include "train/zero_checkpoint.h"

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>

#include <map>
#include <optional>
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

void load_zero_shards(parallel::ZeroOptimizer& zero, const std::filesystem::path& dir) {
  torch::NoGradGuard no_grad;
  const ZeroShards shards(dir);
  const auto names = zero.state_names();
  shards.check_algorithm(zero.algorithm(), names);
  for (const auto& piece : zero.shard_pieces()) {
    auto state = zero.shard_state(piece.group);
    for (size_t s = 0; s < names.size(); ++s)
      shards.read(piece.parameter, names[s], piece.begin,
                  state[s].narrow(0, piece.offset, piece.length));
  }
  zero.set_steps(shards.manifest().at("steps").get<int64_t>());
  const double lr = shards.manifest().at("lr").get<double>();
  for (auto& group : zero.param_groups()) group.options().set_lr(lr);
}

void load_zero_shards_into(torch::optim::Optimizer& optimizer, const torch::nn::Module& module,
                           const std::filesystem::path& dir) {
  torch::NoGradGuard no_grad;
  const ZeroShards shards(dir);
  const auto algorithm = optim::algorithm_of(optimizer, "load_checkpoint",
                                             "ZeRO checkpoints load into SGD, Adam or AdamW");
  const auto names = optim::state_names_of(algorithm, optimizer.param_groups()[0].options());
  shards.check_algorithm(algorithm, names);
  const auto parameters = parameter_names(optimizer, module, "load_checkpoint");
  const int64_t steps = shards.manifest().at("steps").get<int64_t>();
  for (size_t i = 0; i < parameters.size(); ++i) {
    const int64_t numel = optimizer.param_groups()[0].params()[i].numel();
    ParameterState state{.steps = steps, .values = {}};
    for (const auto& name : names) {
      state.values.push_back(at::empty({numel}, at::kFloat));
      shards.read(parameters[i], name, 0, state.values.back());
    }
    set_state(optimizer, algorithm, i, state);
  }
  optimizer.param_groups()[0].options().set_lr(shards.manifest().at("lr").get<double>());
}

void load_optimizer_file_into_zero(parallel::ZeroOptimizer& zero, const torch::nn::Module& module,
                                   const std::filesystem::path& file) {
  torch::NoGradGuard no_grad;
  if (!std::filesystem::exists(file)) {
    throw UsageError("checkpoint " + file.parent_path().string() +
                     " holds neither ZeRO shards nor an optimizer.pt to start ZeRO's from");
  }
  // The writer's optimizer, over stand-ins of the model's trainable parameters in their order
  // (as a DDP run builds it): its state read whole, then this rank's pieces kept.
  const auto& options = zero.param_groups().front().options();
  std::vector<at::Tensor> stand_ins;
  std::vector<std::string> names;
  for (const auto& p : module.named_parameters()) {
    if (!p.value().requires_grad()) continue;
    stand_ins.push_back(at::zeros(p.value().sizes(), at::kFloat));
    names.push_back(p.key());
  }
  torch::serialize::InputArchive archive;
  archive.load_from(file.string());
  torch::serialize::InputArchive probe;
  const bool flat = archive.try_read("cohort_flat_state", probe);
  std::unique_ptr<torch::optim::Optimizer> writer =
      flat ? std::unique_ptr<torch::optim::Optimizer>(optim::make_flat_optimizer(
                 {torch::optim::OptimizerParamGroup(stand_ins)}, zero.algorithm(), options))
           : make_torch_optimizer(zero.algorithm(), stand_ins, options);
  load_optimizer(*writer, file);
  std::map<std::string, ParameterState> whole;
  for (size_t i = 0; i < names.size(); ++i)
    whole[names[i]] = state_of(*writer, zero.algorithm(), i);
  int64_t steps = 0;
  for (const auto& [name, state] : whole) steps = std::max(steps, state.steps);
  for (const auto& piece : zero.shard_pieces()) {
    const auto& state = whole.at(piece.parameter);
    auto buffers = zero.shard_state(piece.group);
    for (size_t s = 0; s < buffers.size(); ++s) {
      buffers[s]
          .narrow(0, piece.offset, piece.length)
          .copy_(state.values.at(s).narrow(0, piece.begin, piece.length));
    }
  }
  zero.set_steps(steps);
  const double lr = writer->param_groups()[0].options().get_lr();
  for (auto& group : zero.param_groups()) group.options().set_lr(lr);
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

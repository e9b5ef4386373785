#include "cohort/train/checkpoint.h"

#include <torch/serialize.h>
#include <zlib.h>

#include <algorithm>
#include <fstream>
#include <optional>
#include <set>

#include "cohort/error.h"
#include "cohort/limits.h"
#include "cohort/optim/flat_optimizer.h"
#include "cohort/optim/state_dict.h"
#include "cohort/parallel/pipeline/pipeline.h"
#include "cohort/trace.h"
#include "cohort/train/memory_estimate.h"
#include "train/kept_tensors.h"
#include "train/model_file.h"
#include "train/run_files.h"
#include "train/run_state.h"
#include "train/worker_session.h"
#include "train/zero_checkpoint.h"

namespace cohort {
namespace safetensors {

std::string file_prefix(
    const std::map<std::string, std::pair<at::ScalarType, std::vector<int64_t>>>& layout,
    const std::map<std::string, std::string>& metadata, int64_t& data_bytes,
    const std::vector<std::string>& order) {
  Json header = Json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<std::string> names = order;
  if (names.empty()) {
    for (const auto& entry : layout) names.push_back(entry.first);
  } else if (names.size() != layout.size() ||
             std::set<std::string>(names.begin(), names.end()).size() != layout.size()) {
    throw UsageError("safetensors::file_prefix: the data order names " +
                     std::to_string(names.size()) + " tensors, the layout has " +
                     std::to_string(layout.size()));
  }
  int64_t offset = 0;
  for (const auto& name : names) {
    const auto found = layout.find(name);
    if (found == layout.end())
      throw UsageError("safetensors::file_prefix: the data order names '" + name +
                       "', which the layout lacks");
    const auto& [dtype, shape] = found->second;
    const auto& dtype_text = dtype_name(dtype, name);
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
    header[name] = {
        {"dtype", dtype_text}, {"shape", shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // aligns the data, as the reference writer does
  std::string prefix(8, '\0');
  const uint64_t n = text.size();
  for (int i = 0; i < 8; ++i)
    prefix[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  data_bytes = offset;
  return prefix + text;
}

void write_streaming(
    const std::filesystem::path& file,
    const std::map<std::string, std::pair<at::ScalarType, std::vector<int64_t>>>& layout,
    const std::map<std::string, std::string>& metadata,
    const std::function<at::Tensor(const std::string&)>& tensor_of,
    const std::function<void(const std::string&)>& written) {
  int64_t data_bytes = 0;
  const std::string prefix = file_prefix(layout, metadata, data_bytes);
  const int64_t size = static_cast<int64_t>(prefix.size()) + data_bytes;
  write_atomically(
      file,
      [&](std::ostream& out) {
        out.write(prefix.data(), static_cast<std::streamsize>(prefix.size()));
        for (const auto& [name, info] : layout) {
          const auto t = tensor_of(name).detach().to(at::kCPU).contiguous();
          if (t.scalar_type() != info.first || t.sizes().vec() != info.second) {
            throw UsageError("safetensors::write_streaming: tensor '" + name + "' came as " +
                             c10::str(t.sizes()) + " " + c10::toString(t.scalar_type()) +
                             ", its header says " + c10::str(at::IntArrayRef(info.second)) + " " +
                             c10::toString(info.first));
          }
          out.write(static_cast<const char*>(t.data_ptr()),
                    static_cast<std::streamsize>(t.numel() * t.element_size()));
          if (written) written(name);
        }
      },
      size);
}

void write(const std::filesystem::path& file, const std::map<std::string, at::Tensor>& tensors,
           const std::map<std::string, std::string>& metadata,
           const std::function<void(const std::string&)>& written) {
  if (train::TensorKeeping::keep(file, tensors, metadata)) return;
  std::map<std::string, std::pair<at::ScalarType, std::vector<int64_t>>> layout;
  for (const auto& [name, tensor] : tensors)
    layout[name] = {tensor.scalar_type(), tensor.sizes().vec()};
  write_streaming(
      file, layout, metadata, [&](const std::string& name) { return tensors.at(name); }, written);
}

void read_elements(const std::filesystem::path& file, const Header& header, const std::string& name,
                   int64_t first, at::Tensor& out) {
  if (const auto* kept = train::kept_tensor_file(file))
    return train::read_kept_elements(*kept, file, name, first, out);
  auto it = header.tensors.find(name);
  if (it == header.tensors.end())
    throw UsageError("safetensors file " + file.string() + " has no tensor '" + name + "'");
  const auto& t = it->second;
  const int64_t element = static_cast<int64_t>(c10::elementSize(t.dtype));
  const int64_t begin = t.begin + first * element;
  const int64_t bytes = out.numel() * element;
  if (out.scalar_type() != t.dtype || !out.is_contiguous() || !out.is_cpu() || first < 0 ||
      begin + bytes > t.end) {
    throw UsageError("safetensors file " + file.string() + ": elements [" + std::to_string(first) +
                     ", " + std::to_string(first + out.numel()) + ") of '" + name +
                     "' are outside the tensor or of another dtype");
  }
  std::ifstream in(file, std::ios::binary);
  in.seekg(header.data_start + begin);
  if (!in.read(static_cast<char*>(out.data_ptr()), bytes))
    throw UsageError("safetensors file " + file.string() + " is truncated in '" + name + "'");
}

std::map<std::string, at::Tensor> read(const std::filesystem::path& file) {
  const auto header = read_header(file);
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, info] : header.tensors) {
    auto tensor = torch::empty(info.shape, torch::TensorOptions().dtype(info.dtype));
    auto flat = tensor.view({-1});
    read_elements(file, header, name, 0, flat);
    out[name] = tensor;
  }
  return out;
}

}  // namespace safetensors

Checkpoint Checkpoint::from_directory(const std::filesystem::path& dir) {
  if (!std::filesystem::is_directory(dir)) {
    throw UsageError("Checkpoint::from_directory: " + dir.string() + " is not a directory");
  }
  return Checkpoint(std::filesystem::absolute(dir));
}

namespace {

// meta.json of a checkpoint persisted by cohort; empty otherwise.
Json read_meta(const std::filesystem::path& dir) {
  const auto meta = dir / kMetaFile;
  if (!std::filesystem::exists(meta)) return Json::object();
  std::ifstream in(meta);
  return Json::parse(in);
}

}  // namespace

Json Checkpoint::metrics() const { return read_meta(path_).value("metrics", Json::object()); }

int Checkpoint::world_size() const { return read_meta(path_).value("world_size", 0); }

int Checkpoint::data_parallel_size() const {
  const auto meta = read_meta(path_);
  return meta.value("data_parallel_size", meta.value("world_size", 0));
}

void Checkpoint::verify() const { verify_manifest(path_); }

namespace train {

namespace detail {

std::map<std::string, at::Tensor> model_tensors(const torch::nn::Module& module) {
  std::map<std::string, at::Tensor> tensors;
  for (const auto& p : module.named_parameters()) tensors[p.key()] = p.value();
  for (const auto& b : module.named_buffers()) tensors[b.key()] = b.value();
  return tensors;
}

void read_into(const std::filesystem::path& file, const safetensors::Header& header,
               const std::string& name, int64_t first, at::Tensor& target) {
  if (target.numel() == 0) return;
  const auto info = header.tensors.find(name);
  if (info == header.tensors.end())
    throw UsageError("safetensors file " + file.string() + " has no tensor '" + name + "'");
  if (target.is_cpu() && target.is_contiguous() && target.scalar_type() == info->second.dtype) {
    auto flat = target.view({-1});
    safetensors::read_elements(file, header, name, first, flat);
    return;
  }
  auto staging = at::empty({target.numel()}, at::TensorOptions(info->second.dtype));
  safetensors::read_elements(file, header, name, first, staging);
  target.copy_(staging.view(target.sizes()));
}

void check_model_file(const std::filesystem::path& file, const torch::nn::Module& module,
                      const std::map<std::string, std::vector<int64_t>>& shapes_in_file) {
  auto check = [&](const std::string& name, const at::Tensor& tensor) {
    const auto found = shapes_in_file.find(name);
    if (found == shapes_in_file.end()) {
      throw UsageError("load_model: " + file.string() + " has no tensor '" + name +
                       "': it was saved from a different model");
    }
    if (found->second != tensor.sizes().vec()) {
      throw UsageError("load_model: tensor '" + name + "' in " + file.string() +
                       " has another shape than the model's: it was saved from a different model");
    }
  };
  for (const auto& p : module.named_parameters()) check(p.key(), p.value());
  for (const auto& b : module.named_buffers()) check(b.key(), b.value());
  const auto tensors = model_tensors(module);
  for (const auto& [name, shape] : shapes_in_file) {
    if (tensors.count(name) == 0) {
      throw UsageError("load_model: " + file.string() + " has tensor '" + name +
                       "' that the model lacks: it was saved from a different model");
    }
  }
}

}  // namespace detail

void save_model(const torch::nn::Module& module, const std::filesystem::path& file) {
  safetensors::write(file, detail::model_tensors(module), {{"format", "pt"}});
}

void load_model(torch::nn::Module& module, const std::filesystem::path& file) {
  const auto header = tensor_file_header(file);
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& [name, info] : header.tensors) shapes[name] = info.shape;
  detail::check_model_file(file, module, shapes);
  torch::NoGradGuard no_grad;
  for (auto& [name, target] : detail::model_tensors(module))
    detail::read_into(file, header, name, 0, target);
}

void save_pipeline_stages(const std::filesystem::path& dir,
                          const parallel::pipeline::Pipeline& pipeline) {
  std::filesystem::create_directories(dir);
  const std::vector<int> indices = pipeline.stage_indices();
  for (size_t i = 0; i < indices.size(); ++i) {
    save_model(pipeline.stages()[i].module(),
               dir / ("stage-" + std::to_string(indices[i]) + ".safetensors"));
  }
}

void load_by_name(torch::nn::Module& module, const std::filesystem::path& dir) {
  if (!std::filesystem::is_directory(dir))
    throw UsageError("load_by_name: " + dir.string() + " is not a folder");
  // Which file holds each name.
  struct Source {
    std::filesystem::path file;
    std::shared_ptr<const safetensors::Header> header;
  };
  std::map<std::string, Source> sources;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() != ".safetensors") continue;
    auto header = std::make_shared<const safetensors::Header>(safetensors::read_header(entry));
    for (const auto& [name, info] : header->tensors) sources[name] = {entry.path(), header};
  }
  torch::NoGradGuard no_grad;
  auto load = [&](const std::string& name, at::Tensor& target) {
    const auto it = sources.find(name);
    if (it == sources.end()) {
      throw UsageError("load_by_name: no .safetensors file in " + dir.string() + " has '" + name +
                       "': the files were saved from a different model");
    }
    const safetensors::TensorInfo& info = it->second.header->tensors.at(name);
    if (info.shape != target.sizes() || info.dtype != target.scalar_type()) {
      throw UsageError("load_by_name: '" + name + "' in " + it->second.file.string() + " is " +
                       c10::str(at::IntArrayRef(info.shape)) + " " + c10::toString(info.dtype) +
                       ", the model's is " + c10::str(target.sizes()) + " " +
                       c10::toString(target.scalar_type()) +
                       ": the files were saved from a different model");
    }
    at::Tensor staging = at::empty(info.shape, at::TensorOptions(info.dtype));
    safetensors::read_elements(it->second.file, *it->second.header, name, 0, staging);
    target.copy_(staging);
  };
  for (auto& p : module.named_parameters()) load(p.key(), p.value());
  for (auto& b : module.named_buffers()) load(b.key(), b.value());
}

void save_optimizer(const torch::optim::Optimizer& optimizer, const std::filesystem::path& file) {
  write_atomically(file, [&](std::ostream& out) { torch::save(optimizer, out); });
}

void load_optimizer(torch::optim::Optimizer& optimizer, const std::filesystem::path& file) {
  if (!std::filesystem::exists(file))
    throw UsageError("load_optimizer: " + file.string() + " does not exist");
  // State saved on one device loads onto the parameters' device (a GPU run resumes on a CPU
  // host and the other way round).
  c10::Device device(c10::DeviceType::CPU);
  for (const auto& group : optimizer.param_groups()) {
    if (!group.params().empty()) {
      device = group.params().front().device();
      break;
    }
  }
  try {
    torch::load(optimizer, file.string(), device);
    // libtorch 1.13 restores the per-parameter state but drops the saved param-group options
    // (lr, momentum, ...), which Python's load_state_dict restores: a resumed run must keep the
    // lr its schedule or a world-size change gave it.
    torch::serialize::InputArchive archive;
    archive.load_from(file.string(), device);
    torch::serialize::InputArchive groups;
    archive.read("param_groups", groups);
    for (size_t i = 0; i < optimizer.param_groups().size(); ++i) {
      torch::serialize::InputArchive group, options;
      groups.read("param_groups/" + std::to_string(i), group);
      group.read("options", options);
      optimizer.param_groups()[i].options().serialize(options);
    }
  } catch (const c10::Error& e) {
    throw UsageError("load_optimizer: " + file.string() +
                     " is not a readable optimizer state: " + e.what_without_backtrace());
  }
}

namespace {

using detail::kZeroManifest;

// Whether `optimizer` keeps replicas that differ between synchronisations (local SGD's, DiLoCo's).
const optim::ShardedState* replicas_of(const torch::optim::Optimizer& optimizer) {
  const auto* sharded = dynamic_cast<const optim::ShardedState*>(&optimizer);
  return sharded != nullptr && sharded->holds_replicas() ? sharded : nullptr;
}

// Local SGD's and DiLoCo's state is their replicas, which save_checkpoint keeps.
void refuse_replicas(const torch::optim::Optimizer& optimizer, const char* what,
                     const char* instead) {
  if (replicas_of(optimizer) == nullptr) return;
  throw UsageError(std::string(what) +
                   ": local SGD and DiLoCo keep their optimizer state with their parameters: use " +
                   instead);
}

// What load_optimizer_state reads, for any optimizer: replicas (local SGD's own checkpoint at any
// world size, or its first rank's inner state for another optimizer), ZeRO's or the parameter
// server's shards, a whole optimizer's file, a pipeline's parts, and the first formats of local
// SGD's and the parameter server's checkpoints.
void load_any_optimizer_state(const std::filesystem::path& dir, torch::optim::Optimizer& optimizer,
                              const torch::nn::Module& module) {
  if (holds_state(dir, optim::kReplicasPart)) return detail::load_replicas(optimizer, module, dir);
  if (detail::is_legacy_local_sgd_checkpoint(dir) && replicas_of(optimizer) != nullptr)
    return detail::load_legacy_local_sgd(optimizer, module, dir);
  if (detail::is_legacy_parameter_server_checkpoint(dir))
    return detail::load_legacy_parameter_server(optimizer, module, dir);
  // Into ZeRO at any world size and stage, the parameter server, local SGD's inner optimizers
  // (a new period) or DDP's whole optimizer.
  if (std::filesystem::exists(dir / kZeroManifest))
    return detail::load_zero_shards(optimizer, module, dir);
  const auto file = detail::whole_optimizer_file(dir);
  if (!std::filesystem::exists(file)) {
    // A pipeline's checkpoint: its stages' state in parts, by the whole model's names.
    if (auto parts = find_optimizer_parts(dir); !parts.empty())
      return load_optimizer_parts(parts, optimizer, module);
  }
  if (dynamic_cast<const optim::Stateful*>(&optimizer) != nullptr) {
    // A DDP run's checkpoint: its whole optimizer state, sharded here.
    detail::load_optimizer_file_into_part(optimizer, module, file);
  } else {
    load_optimizer(optimizer, file);
  }
}

// This rank's piece of a sharded optimizer's state, where it writes one (see
// optim::ShardedState), after the group was brought to one state.
void save_sharded_state(const std::filesystem::path& dir, const optim::ShardedState& sharded) {
  if (sharded.writes_state()) save_state(dir, sharded.part_name(), sharded.state_dict());
}

// An optimizer's whole state over `module`'s parameters. A flat optimizer's goes into state files
// a parameter at a time, and loads back a parameter at a time into the state it holds already
// (libtorch's archive would be read whole beside it: a resumed worker held its state twice while
// it loaded); state on disk leaves memory once written. They load into any optimizer as
// optimizer.pt does.
void save_whole_optimizer(const std::filesystem::path& dir,
                          const torch::optim::Optimizer& optimizer,
                          const torch::nn::Module& module) {
  const auto* flat = dynamic_cast<const optim::FlatOptimizer*>(&optimizer);
  if (flat == nullptr || !detail::save_optimizer_as_shards(dir, optimizer, module)) {
    save_optimizer(optimizer, dir / "optimizer.pt");
  }
}

}  // namespace

void save_optimizer_state(const std::filesystem::path& dir,
                          const torch::optim::Optimizer& optimizer,
                          const torch::nn::Module& module) {
  refuse_replicas(optimizer, "save_optimizer_state", "save_checkpoint");
  std::filesystem::create_directories(dir);
  if (const auto* sharded = dynamic_cast<const optim::ShardedState*>(&optimizer)) {
    sharded->prepare_checkpoint();
    save_sharded_state(dir, *sharded);
  } else {
    save_whole_optimizer(dir, optimizer, module);
  }
}

void load_optimizer_state(const std::filesystem::path& dir, torch::optim::Optimizer& optimizer,
                          const torch::nn::Module& module) {
  if (replicas_of(optimizer) != nullptr && is_local_sgd_checkpoint(dir)) {
    throw UsageError("load_optimizer_state: " + dir.string() +
                     " holds local SGD's replicas with their parameters: use load_checkpoint");
  }
  load_any_optimizer_state(dir, optimizer, module);
}

bool checkpoint_per_rank(const torch::optim::Optimizer& optimizer) {
  const auto* sharded = dynamic_cast<const optim::ShardedState*>(&optimizer);
  return sharded != nullptr && sharded->every_rank_saves();
}

bool is_local_sgd_checkpoint(const std::filesystem::path& dir) {
  return holds_state(dir, optim::kReplicasPart) || detail::is_legacy_local_sgd_checkpoint(dir);
}

namespace detail {

void save_model_and_optimizer(const std::filesystem::path& dir, const torch::nn::Module& module,
                              const torch::optim::Optimizer& optimizer) {
  std::filesystem::create_directories(dir);
  if (const auto* sharded = dynamic_cast<const optim::ShardedState*>(&optimizer)) {
    // Every rank of the group: the model by its first rank (while the group gathers one unit at
    // a time where the parameters lie in shards; local SGD's global parameters where the ranks
    // hold replicas), its piece of the state by each.
    sharded->prepare_checkpoint();
    if (sharded->writes_state()) {
      const auto file = dir / "model.safetensors";
      if (!sharded->sharded_units().empty()) {
        detail::save_model_by_unit(*sharded, module, file);
      } else if (sharded->checkpoint_rank() == 0) {
        if (auto tensors = sharded->model_state(); !tensors.empty()) {
          safetensors::write(file, tensors, {{"format", "pt"}});
        } else {
          save_model(module, file);
        }
      }
      save_sharded_state(dir, *sharded);
    }
  } else {
    save_model(module, dir / "model.safetensors");
    save_whole_optimizer(dir, optimizer, module);
  }
}

void save_run_state(const std::filesystem::path& dir) {
  // fp16: the loss scale and its counters (the same on every rank), so that a resumed run scales
  // as the original.
  if (const auto* session = current_session();
      session != nullptr && session->context.world_rank == 0 && session->loss_scaler &&
      session->loss_scaler->enabled()) {
    save_state(dir, optim::kLossScalerPart, session->loss_scaler->state_dict());
  }
}

}  // namespace detail

Checkpoint save_checkpoint(const std::filesystem::path& dir, const torch::nn::Module& module,
                           const torch::optim::Optimizer& optimizer) {
  trace::Span span(trace::Phase::kCheckpoint);
  detail::save_model_and_optimizer(dir, module, optimizer);
  detail::save_run_state(dir);
  return Checkpoint::from_directory(dir);
}

void load_checkpoint(const Checkpoint& checkpoint, torch::nn::Module& module,
                     torch::optim::Optimizer& optimizer) {
  // ZeRO stage 3: every rank reads its shards' ranges of the units' parameters.
  const auto* sharded = dynamic_cast<const optim::ShardedState*>(&optimizer);
  if (sharded != nullptr && holds_state(checkpoint.path(), detail::kModelPiecesPart)) {
    // A live regroup's state of ZeRO stage 3: the ranges of the rank whose shards this one holds.
    detail::load_model_pieces(*sharded, module, checkpoint.path());
  } else if (sharded != nullptr && !sharded->sharded_units().empty()) {
    detail::load_model_shards(*sharded, module, checkpoint.path() / "model.safetensors");
  } else {
    // A live regroup's own state, kept in memory: the model and optimizer take that memory, and
    // the reads below copy nothing.
    adopt_kept_state(checkpoint.path(), module, optimizer);
    load_model(module, checkpoint.path() / "model.safetensors");
  }
  // From a local SGD checkpoint into another optimizer too: the global parameters (loaded above)
  // and its first rank's inner optimizer state on every rank.
  load_any_optimizer_state(checkpoint.path(), optimizer, module);
  restore_run_state(checkpoint, optimizer);
  release_free_memory();  // the load's staging
}

void restore_run_state(const Checkpoint& checkpoint, torch::optim::Optimizer& optimizer) {
  auto* session = current_session();
  // Steps taken before the checkpoint are not this start's: per-step metrics count from here.
  if (session != nullptr) session->steps_at_report = optimizer_steps(*session);
  if (session != nullptr && session->loss_scaler && session->loss_scaler->enabled()) {
    const auto& dir = checkpoint.path();
    if (holds_state(dir, optim::kLossScalerPart)) {
      load_state(dir, optim::kLossScalerPart, *session->loss_scaler);
    } else if (std::filesystem::exists(dir / kLossScalerFile)) {
      optim::StateDict first_format;
      first_format.values = read_json(dir / kLossScalerFile);
      session->loss_scaler->check_state(first_format.values);
      session->loss_scaler->load_state_dict(first_format);
    }
  }
  if (session == nullptr || !session->on_world_size_change) return;
  const int previous = checkpoint.data_parallel_size();
  const int now = data_parallel_position(session->context).world_size;
  if (previous > 0 && previous != now) session->on_world_size_change(optimizer, previous, now);
}

int64_t consolidate_checkpoint(const Checkpoint& checkpoint, const std::filesystem::path& output) {
  const auto& dir = checkpoint.path();
  if (!std::filesystem::is_directory(dir))
    throw UsageError("checkpoint " + dir.string() + " is not a folder");
  if (std::filesystem::exists(dir / kManifestFile)) checkpoint.verify();
  // The whole model (model.safetensors), else a pipeline's stages (stage-<s>.safetensors, the
  // whole model's names); the optimizer's shards and per-rank files are not the model.
  std::vector<std::filesystem::path> files;
  if (std::filesystem::exists(dir / "model.safetensors")) {
    files.push_back(dir / "model.safetensors");
  } else {
    for (const auto& entry : std::filesystem::directory_iterator(dir)) {
      const auto name = entry.path().filename().string();
      if (name.rfind("stage-", 0) == 0 && entry.path().extension() == ".safetensors")
        files.push_back(entry.path());
    }
    std::sort(files.begin(), files.end());
  }
  if (files.empty()) {
    throw UsageError("checkpoint " + dir.string() +
                     " holds no model file (model.safetensors or a pipeline's "
                     "stage-<s>.safetensors): is it a cohort checkpoint folder?");
  }
  struct Source {
    std::filesystem::path file;
    const safetensors::Header* header;
  };
  std::vector<safetensors::Header> headers;
  headers.reserve(files.size());
  for (const auto& file : files) headers.push_back(safetensors::read_header(file));
  std::map<std::string, std::pair<at::ScalarType, std::vector<int64_t>>> layout;
  std::map<std::string, Source> sources;
  for (size_t f = 0; f < files.size(); ++f) {
    for (const auto& [name, info] : headers[f].tensors) {
      const auto [it, added] = layout.emplace(name, std::make_pair(info.dtype, info.shape));
      if (added) {
        sources[name] = {files[f], &headers[f]};
      } else if (it->second.first != info.dtype || it->second.second != info.shape) {
        throw UsageError("checkpoint " + dir.string() + ": tensor '" + name + "' is " +
                         c10::str(at::IntArrayRef(info.shape)) + " in " +
                         files[f].filename().string() + " but " +
                         c10::str(at::IntArrayRef(it->second.second)) + " in " +
                         sources[name].file.filename().string() + ": the files disagree");
      }
    }
  }
  std::filesystem::create_directories(std::filesystem::absolute(output).parent_path());
  safetensors::write_streaming(output, layout, {{"format", "pt"}}, [&](const std::string& name) {
    const auto& [dtype, shape] = layout.at(name);
    auto tensor = at::empty(shape, at::TensorOptions(dtype));
    safetensors::read_elements(sources.at(name).file, *sources.at(name).header, name, 0, tensor);
    return tensor;
  });
  return static_cast<int64_t>(layout.size());
}

void linear_lr_scaling(torch::optim::Optimizer& optimizer, int previous_world_size,
                       int world_size) {
  if (previous_world_size < 1 || world_size < 1) {
    throw UsageError("linear_lr_scaling: world sizes must be >= 1, got " +
                     std::to_string(previous_world_size) + " -> " + std::to_string(world_size));
  }
  const double factor = static_cast<double>(world_size) / previous_world_size;
  for (auto& group : optimizer.param_groups())
    group.options().set_lr(group.options().get_lr() * factor);
}

}  // namespace train
}  // namespace cohort

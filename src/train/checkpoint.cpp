#include "cohort/train/checkpoint.h"

#include <torch/serialize.h>
#include <zlib.h>

#include <fstream>

#include "cohort/error.h"
#include "cohort/parallel/zero_optimizer.h"
#include "train/run_files.h"
#include "train/worker_session.h"

namespace cohort {
namespace safetensors {
namespace {

const std::map<at::ScalarType, std::string>& dtype_names() {
  static const std::map<at::ScalarType, std::string> names{
      {at::kFloat, "F32"}, {at::kDouble, "F64"}, {at::kHalf, "F16"},  {at::kBFloat16, "BF16"},
      {at::kLong, "I64"},  {at::kInt, "I32"},    {at::kShort, "I16"}, {at::kChar, "I8"},
      {at::kByte, "U8"},   {at::kBool, "BOOL"}};
  return names;
}

at::ScalarType dtype_of(const std::string& name, const std::filesystem::path& file) {
  for (const auto& [type, n] : dtype_names()) {
    if (n == name) return type;
  }
  throw UsageError("safetensors file " + file.string() + " has unsupported dtype " + name);
}

}  // namespace

void write(const std::filesystem::path& file, const std::map<std::string, at::Tensor>& tensors,
           const std::map<std::string, std::string>& metadata) {
  Json header = Json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<at::Tensor> data;
  int64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    auto it = dtype_names().find(tensor.scalar_type());
    if (it == dtype_names().end()) {
      throw UsageError("save_model: tensor '" + name + "' has a dtype safetensors cannot hold");
    }
    auto cpu = tensor.detach().to(at::kCPU).contiguous();
    const int64_t bytes = cpu.numel() * cpu.element_size();
    header[name] = {{"dtype", it->second},
                    {"shape", cpu.sizes().vec()},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    data.push_back(cpu);
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // aligns the data, as the reference writer does
  write_atomically(file, [&](std::ostream& out) {
    const uint64_t n = text.size();
    for (int i = 0; i < 8; ++i) out.put(static_cast<char>((n >> (8 * i)) & 0xff));
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    for (const auto& t : data) {
      out.write(static_cast<const char*>(t.data_ptr()),
                static_cast<std::streamsize>(t.numel() * t.element_size()));
    }
  });
}

std::map<std::string, at::Tensor> read(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw UsageError("cannot open safetensors file " + file.string());
  const auto size = static_cast<int64_t>(std::filesystem::file_size(file));
  unsigned char le[8];
  if (!in.read(reinterpret_cast<char*>(le), 8)) {
    throw UsageError("safetensors file " + file.string() + " is truncated: no header length");
  }
  uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | le[i];
  if (header_size > static_cast<uint64_t>(size - 8)) {
    throw UsageError("safetensors file " + file.string() + " is truncated: header of " +
                     std::to_string(header_size) + " bytes in a file of " + std::to_string(size));
  }
  std::string text(header_size, '\0');
  in.read(text.data(), static_cast<std::streamsize>(header_size));
  Json header;
  try {
    header = Json::parse(text);
  } catch (const std::exception& e) {
    throw UsageError("safetensors file " + file.string() + " has a corrupt header: " + e.what());
  }
  const int64_t data_start = 8 + static_cast<int64_t>(header_size);
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, info] : header.items()) {
    if (name == "__metadata__") continue;
    const auto type = dtype_of(info.at("dtype").get<std::string>(), file);
    const auto shape = info.at("shape").get<std::vector<int64_t>>();
    const auto begin = info.at("data_offsets")[0].get<int64_t>();
    const auto end = info.at("data_offsets")[1].get<int64_t>();
    auto tensor = torch::empty(shape, torch::TensorOptions().dtype(type));
    if (end - begin != tensor.numel() * tensor.element_size() || data_start + end > size) {
      throw UsageError("safetensors file " + file.string() + ": tensor '" + name +
                       "' does not fit its byte range (truncated or corrupt file)");
    }
    in.seekg(data_start + begin);
    in.read(static_cast<char*>(tensor.data_ptr()), end - begin);
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

Json Checkpoint::metrics() const {
  auto meta = path_ / kMetaFile;
  if (!std::filesystem::exists(meta)) return Json::object();
  std::ifstream in(meta);
  return Json::parse(in).value("metrics", Json::object());
}

int Checkpoint::world_size() const {
  auto meta = path_ / kMetaFile;
  if (!std::filesystem::exists(meta)) return 0;
  std::ifstream in(meta);
  return Json::parse(in).value("world_size", 0);
}

void Checkpoint::verify() const { verify_manifest(path_); }

namespace train {

void save_model(const torch::nn::Module& module, const std::filesystem::path& file) {
  std::map<std::string, at::Tensor> tensors;
  for (const auto& p : module.named_parameters()) tensors[p.key()] = p.value();
  for (const auto& b : module.named_buffers()) tensors[b.key()] = b.value();
  safetensors::write(file, tensors, {{"format", "pt"}});
}

void load_model(torch::nn::Module& module, const std::filesystem::path& file) {
  auto tensors = safetensors::read(file);
  torch::NoGradGuard no_grad;
  auto load = [&](const std::string& name, at::Tensor& target) {
    auto it = tensors.find(name);
    if (it == tensors.end()) {
      throw UsageError("load_model: " + file.string() + " has no tensor '" + name +
                       "': it was saved from a different model");
    }
    if (it->second.sizes() != target.sizes()) {
      throw UsageError("load_model: tensor '" + name + "' in " + file.string() +
                       " has another shape than the model's: it was saved from a different model");
    }
    target.copy_(it->second);
    tensors.erase(it);
  };
  for (auto& p : module.named_parameters()) load(p.key(), p.value());
  for (auto& b : module.named_buffers()) load(b.key(), b.value());
  if (!tensors.empty()) {
    throw UsageError("load_model: " + file.string() + " has tensor '" + tensors.begin()->first +
                     "' that the model lacks: it was saved from a different model");
  }
}

void save_optimizer(const torch::optim::Optimizer& optimizer, const std::filesystem::path& file) {
  auto tmp = file;
  tmp += ".tmp";
  torch::save(optimizer, tmp.string());
  std::filesystem::rename(tmp, file);
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

// A ZeRO optimizer's state is one file per rank, named for its rank and the world size.
std::string zero_shard_file(const parallel::ZeroOptimizer& zero) {
  const auto& group = zero.process_group();
  return "optimizer.zero-rank" + std::to_string(group.rank()) + "-of-" +
         std::to_string(group.world_size()) + ".pt";
}

}  // namespace

Checkpoint save_checkpoint(const std::filesystem::path& dir, const torch::nn::Module& module,
                           const torch::optim::Optimizer& optimizer) {
  std::filesystem::create_directories(dir);
  if (const auto* zero = dynamic_cast<const parallel::ZeroOptimizer*>(&optimizer)) {
    // Every rank reports its own shard; the parameters are whole on every rank, rank 0 writes
    // them.
    if (zero->process_group().rank() == 0) save_model(module, dir / "model.safetensors");
    save_optimizer(optimizer, dir / zero_shard_file(*zero));
  } else {
    save_model(module, dir / "model.safetensors");
    save_optimizer(optimizer, dir / "optimizer.pt");
  }
  // fp16: the loss scale and its counters, so that a resumed run scales as the original.
  if (const auto* session = current_session();
      session != nullptr && session->loss_scaler && session->loss_scaler->enabled()) {
    write_atomically(dir / kLossScalerFile, session->loss_scaler->state_dict().dump(2) + "\n");
  }
  return Checkpoint::from_directory(dir);
}

void load_checkpoint(const Checkpoint& checkpoint, torch::nn::Module& module,
                     torch::optim::Optimizer& optimizer) {
  load_model(module, checkpoint.path() / "model.safetensors");
  if (const auto* zero = dynamic_cast<const parallel::ZeroOptimizer*>(&optimizer)) {
    const auto file = checkpoint.path() / zero_shard_file(*zero);
    if (!std::filesystem::exists(file)) {
      const int written_by = checkpoint.world_size();
      throw UsageError(
          "checkpoint " + checkpoint.path().string() + " has no " + file.filename().string() +
          (std::filesystem::exists(checkpoint.path() / "optimizer.pt")
               ? ": it was written without ZeRO"
               : ": it was written by " + std::to_string(written_by) + " ranks") +
          ", and loading ZeRO optimizer state at another world size or from DDP is not built "
          "yet: resume with the same number of workers and ZeRO stage");
    }
    load_optimizer(optimizer, file);
  } else {
    load_optimizer(optimizer, checkpoint.path() / "optimizer.pt");
  }
  auto* session = current_session();
  if (session != nullptr && session->loss_scaler && session->loss_scaler->enabled() &&
      std::filesystem::exists(checkpoint.path() / kLossScalerFile)) {
    session->loss_scaler->load_state_dict(read_json(checkpoint.path() / kLossScalerFile));
  }
  if (session == nullptr || !session->on_world_size_change) return;
  const int previous = checkpoint.world_size();
  const int now = session->context.world_size;
  if (previous > 0 && previous != now) session->on_world_size_change(optimizer, previous, now);
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

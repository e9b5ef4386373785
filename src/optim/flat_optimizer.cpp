#include "cohort/optim/flat_optimizer.h"

#include <torch/serialize/archive.h>
#include <torch/version.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <tuple>

#include "cohort/error.h"

// libtorch 2.4 and later have fused SGD, Adam and AdamW kernels for CPU and CUDA tensors: one
// pass over the buffers instead of one per operation.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
#define COHORT_FUSED_OPTIMIZERS 1
#endif

namespace cohort::optim {
namespace {

bool low_precision(c10::ScalarType t) {
  return t == c10::ScalarType::BFloat16 || t == c10::ScalarType::Half;
}

// A tensor of `sizes` over flat's storage from element `offset` on: an alias made with set_()
// rather than an autograd view, so that zero_grad()'s detach_() and set_data() accept it.
at::Tensor alias_into(const at::Tensor& flat, int64_t offset, at::IntArrayRef sizes) {
  auto t = at::empty({0}, flat.options());
  t.set_(flat.storage(), flat.storage_offset() + offset, sizes, c10::contiguous_strides(sizes));
  return t;
}

// torch::optim::SGD's update, on whole buffers or one parameter's slices alike.
void sgd_update(const torch::optim::SGDOptions& o, at::Tensor& p, const at::Tensor& g,
                at::Tensor momentum_buffer, bool first_step) {
  at::Tensor d_p = g;
  if (o.weight_decay() != 0) d_p = d_p.add(p, o.weight_decay());
  if (o.momentum() != 0) {
    if (first_step) {
      momentum_buffer.copy_(d_p);
    } else {
      momentum_buffer.mul_(o.momentum()).add_(d_p, 1 - o.dampening());
    }
    d_p = o.nesterov() ? d_p.add(momentum_buffer, o.momentum()) : momentum_buffer;
  }
  p.add_(d_p, -o.lr());
}

struct AdamHyper {
  double lr, beta1, beta2, eps, weight_decay;
  bool amsgrad, decoupled;
};

AdamHyper adam_hyper(const torch::optim::OptimizerOptions& options, const std::string& algorithm) {
  if (algorithm == "adamw") {
    const auto& o = static_cast<const torch::optim::AdamWOptions&>(options);
    return {o.lr(),  std::get<0>(o.betas()), std::get<1>(o.betas()),
            o.eps(), o.weight_decay(),       o.amsgrad(),
            true};
  }
  const auto& o = static_cast<const torch::optim::AdamOptions&>(options);
  return {o.lr(),  std::get<0>(o.betas()), std::get<1>(o.betas()),
          o.eps(), o.weight_decay(),       o.amsgrad(),
          false};
}

// torch::optim::Adam's and AdamW's update.
void adam_update(const AdamHyper& h, at::Tensor& p, const at::Tensor& g,
                 std::vector<at::Tensor>& state, int64_t step) {
  if (h.decoupled && h.weight_decay != 0) p.mul_(1 - h.lr * h.weight_decay);
  at::Tensor grad = g;
  if (!h.decoupled && h.weight_decay != 0) grad = grad.add(p, h.weight_decay);
  const double bias_correction1 = 1 - std::pow(h.beta1, static_cast<double>(step));
  const double bias_correction2 = 1 - std::pow(h.beta2, static_cast<double>(step));
  auto& exp_avg = state[0];
  auto& exp_avg_sq = state[1];
  exp_avg.mul_(h.beta1).add_(grad, 1 - h.beta1);
  exp_avg_sq.mul_(h.beta2).addcmul_(grad, grad, 1 - h.beta2);
  at::Tensor denom;
  if (h.amsgrad) {
    auto& max_exp_avg_sq = state[2];
    at::maximum_out(max_exp_avg_sq, max_exp_avg_sq, exp_avg_sq);
    denom = (max_exp_avg_sq.sqrt() / std::sqrt(bias_correction2)).add_(h.eps);
  } else {
    denom = (exp_avg_sq.sqrt() / std::sqrt(bias_correction2)).add_(h.eps);
  }
  p.addcdiv_(exp_avg, denom, -h.lr / bias_correction1);
}

// Scales `grads` so that their global L2 norm is at most max_norm, without a host sync; returns
// the norm before clipping.
at::Tensor clip_by_global_norm(const std::vector<at::Tensor>& grads, double max_norm) {
  if (!(max_norm > 0))
    throw UsageError("gradient clipping max_norm " + format_number(max_norm) + " must be > 0");
  torch::NoGradGuard no_grad;
  if (grads.empty()) return at::zeros({}, at::kFloat);
  const auto device = grads.front().device();
  std::vector<at::Tensor> norms;
  for (const auto& g : grads) norms.push_back(g.norm(2).to(device, at::kFloat));
  auto total = at::stack(norms).norm(2);
  const auto coefficient = (max_norm / (total + 1e-6)).clamp_max(1.0);
  for (const auto& g : grads) {
    auto target = g;
    target.mul_(coefficient.to(g.device(), g.scalar_type()));
  }
  return total;
}

}  // namespace

bool FlatOptimizer::has_fused_kernels() {
#ifdef COHORT_FUSED_OPTIMIZERS
  return true;
#else
  return false;
#endif
}

void validate(const torch::optim::SGDOptions& o) {
  if (!(o.lr() >= 0)) throw UsageError("SGD lr " + format_number(o.lr()) + " must be >= 0");
  if (!(o.momentum() >= 0 && o.momentum() <= 1))
    throw UsageError("SGD momentum " + format_number(o.momentum()) + " must be in [0, 1]");
  if (!(o.dampening() >= 0 && o.dampening() <= 1))
    throw UsageError("SGD dampening " + format_number(o.dampening()) + " must be in [0, 1]");
  if (!(o.weight_decay() >= 0))
    throw UsageError("SGD weight_decay " + format_number(o.weight_decay()) + " must be >= 0");
  if (o.nesterov() && (o.momentum() <= 0 || o.dampening() != 0))
    throw UsageError("SGD nesterov needs a momentum > 0 and dampening 0 (momentum " +
                     format_number(o.momentum()) + ", dampening " + format_number(o.dampening()) +
                     ")");
}

namespace {
template <typename Options>
void validate_adam(const Options& o, const std::string& name) {
  if (!(o.lr() >= 0)) throw UsageError(name + " lr " + format_number(o.lr()) + " must be >= 0");
  const auto [beta1, beta2] = o.betas();
  if (!(beta1 >= 0 && beta1 < 1))
    throw UsageError(name + " beta1 " + format_number(beta1) + " must be in [0, 1)");
  if (!(beta2 >= 0 && beta2 < 1))
    throw UsageError(name + " beta2 " + format_number(beta2) + " must be in [0, 1)");
  if (!(o.eps() > 0)) throw UsageError(name + " eps " + format_number(o.eps()) + " must be > 0");
  if (!(o.weight_decay() >= 0))
    throw UsageError(name + " weight_decay " + format_number(o.weight_decay()) + " must be >= 0");
}
}  // namespace

void validate(const torch::optim::AdamOptions& o) { validate_adam(o, "Adam"); }
void validate(const torch::optim::AdamWOptions& o) { validate_adam(o, "AdamW"); }

// A number kept in a 0-dim tensor on the device, made once and then filled in place (a step
// captured in a CUDA graph holds its address), with the value it holds as the host knows it.
struct DeviceScalar {
  at::Tensor tensor;
  double value = 0;
  void set(double v, const at::TensorOptions& options) {
    if (!tensor.defined()) {
      tensor = at::full({}, v, options);
    } else if (value != v) {
      tensor.fill_(v);
    }
    value = v;
  }
};

// A state buffer offloaded to disk: a file under the offload folder, unlinked as soon as it is
// made (nothing stays behind, a crash included), its space reserved, mapped shared into memory.
struct StateFile {
  int fd = -1;
  void* address = nullptr;
  size_t bytes = 0;
  StateFile() = default;
  StateFile(const StateFile&) = delete;
  StateFile& operator=(const StateFile&) = delete;
  ~StateFile() {
    if (address != nullptr) ::munmap(address, bytes);
    if (fd >= 0) ::close(fd);
  }
};

// A CPU tensor of `like`'s values in a new StateFile under `dir`.
at::Tensor file_backed(const std::filesystem::path& dir, const at::Tensor& like,
                       std::shared_ptr<StateFile>& file) {
  const auto fail = [&](const std::string& what) {
    throw RuntimeError("optimizer state offload: " + what + " in " + dir.string() + ": " +
                       std::strerror(errno));
  };
  file = std::make_shared<StateFile>();
  file->bytes = static_cast<size_t>(like.numel()) * like.element_size();
  if (file->bytes == 0) return at::empty({0}, like.options());
  std::string name = (dir / "cohort-optimizer-state-XXXXXX").string();
  file->fd = ::mkstemp(name.data());
  if (file->fd < 0) fail("cannot create a file");
  ::unlink(name.c_str());
  // Reserved now: a full disk is this error, not a SIGBUS in the middle of a step.
  if (const int e = ::posix_fallocate(file->fd, 0, static_cast<off_t>(file->bytes)); e != 0) {
    errno = e;
    fail("cannot reserve " + std::to_string(file->bytes) + " bytes");
  }
  file->address = ::mmap(nullptr, file->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, file->fd, 0);
  if (file->address == MAP_FAILED) {
    file->address = nullptr;
    fail("cannot map " + std::to_string(file->bytes) + " bytes");
  }
  auto keep = file;
  // Zero-filled by the reservation; the caller copies the values in a chunk at a time.
  return at::from_blob(
      file->address, {like.numel()}, [keep](void*) {}, like.options().device(at::kCPU));
}

// Zeros that take no memory until written: on the CPU, fresh pages of an anonymous mapping, which
// the kernel hands out zeroed (the optimizer state: offloaded to disk, it is then never in memory
// whole, not even before its first step).
at::Tensor untouched_zeros(int64_t numel, const at::TensorOptions& options) {
  if (!options.device().is_cpu() || numel == 0) return at::zeros({numel}, options);
  const size_t bytes = static_cast<size_t>(numel) * options.dtype().itemsize();
  void* address =
      ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (address == MAP_FAILED) return at::zeros({numel}, options);
  return at::from_blob(
      address, {numel}, [bytes](void* p) { ::munmap(p, bytes); }, options);
}

// The tensors `members` (one dtype) as one flat buffer of `numel` elements where each lies at its
// offset in `offsets` of one storage (contiguous, one after another from the first, as a flat
// optimizer lays them out); undefined where they do not. Members without elements are not looked
// at.
at::Tensor already_flat(const std::vector<at::Tensor>& members, const std::vector<int64_t>& offsets,
                        int64_t numel) {
  const at::Tensor* first = nullptr;
  int64_t start = 0;
  for (size_t k = 0; k < members.size(); ++k) {
    const auto& m = members[k];
    if (m.numel() == 0) continue;
    if (!m.is_contiguous() || m.is_sparse()) return {};
    if (first == nullptr) {
      first = &m;
      start = m.storage_offset() - offsets[k];
      if (start < 0) return {};
    } else if (!m.storage().is_alias_of(first->storage()) ||
               m.scalar_type() != first->scalar_type() || m.device() != first->device()) {
      return {};
    }
    if (m.storage_offset() != start + offsets[k]) return {};
  }
  if (first == nullptr) return {};
  const auto bytes = static_cast<int64_t>(first->storage().nbytes());
  if ((start + numel) * static_cast<int64_t>(first->element_size()) > bytes) return {};
  auto flat = at::empty({0}, first->options());
  flat.set_(first->storage(), start, {numel}, {1});
  return flat;
}

// One flat layout: the parameters of a param group that share a dtype and a device.
struct Partition {
  std::vector<size_t> members;  // indices into the group's params()
  std::vector<int64_t> offsets;
  int64_t numel = 0;
  at::Tensor params;  // the parameters' dtype; every member is an alias into it
  at::Tensor master;  // float32 copy when the parameters are low precision; else `params`
  at::Tensor grads;   // the master's dtype and device: what the update reads
  // Host offload with parameters on a GPU: the buffer backward writes into (the .grad aliases),
  // on the parameters' device, copied into `grads` on the host before each update; undefined
  // otherwise (`grads` is that buffer).
  at::Tensor device_grads;
  std::vector<at::Tensor> state;
  std::vector<int64_t> steps;  // per member, as torch::optim counts them
  std::vector<at::Tensor> grad_aliases;
  std::vector<const void*> param_addresses;
  std::vector<char> has_grad;
  // Each member's .grad as the last gather saw it (its tensor and in-place version): a gradient
  // that changed since (a backward, zero_grad(), DDP's all-reduce landing) is gathered again.
  std::vector<const void*> gathered_grad;
  std::vector<int64_t> gathered_version;
  bool stepped = false;  // since the layout or the last load
  // No step, load or view of the state since the layout: it is zeros, nothing to carry along.
  bool state_untouched = true;
  // The fused kernels' step count (Adam, AdamW) and, on CUDA, learning rate on the partition's
  // device (see fused_update).
  DeviceScalar step_count, lr;
  bool fused_last = false;  // whether the last step ran on the fused kernels
  // Disk offload: the files behind `state`, one each (empty: the state is in memory).
  std::vector<std::shared_ptr<StateFile>> state_files;

  // The buffer backward writes the gradients into (where the .grad aliases point).
  const at::Tensor& written_grads() const { return device_grads.defined() ? device_grads : grads; }

  // Disk offload: the kernel reads the chunk's state ahead; once updated, it starts writing it
  // back and the chunk leaves this process's memory (the file's pages stay up to date).
  void read_ahead(int64_t start, int64_t length) const {
    for_state_pages(start, length, [](char* at, size_t bytes, const StateFile&, size_t) {
      ::madvise(at, bytes, MADV_WILLNEED);
    });
  }
  // `only`: that state buffer's pages alone (a checkpoint's piece); -1: every buffer's.
  void write_behind(int64_t start, int64_t length, int only = -1) const {
    const auto behind = [](char* at, size_t bytes, const StateFile& f, size_t offset) {
      ::sync_file_range(f.fd, static_cast<off_t>(offset), static_cast<off_t>(bytes),
                        SYNC_FILE_RANGE_WRITE);
      ::madvise(at, bytes, MADV_DONTNEED);
    };
    for_state_pages(start, length, behind, only);
  }
  template <typename Fn>
  void for_state_pages(int64_t start, int64_t length, const Fn& fn, int only = -1) const {
    if (state_files.empty()) return;  // the state is in memory
    const auto page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    for (size_t s = 0; s < state_files.size(); ++s) {
      if (only >= 0 && s != static_cast<size_t>(only)) continue;
      const auto& f = *state_files[s];
      if (f.address == nullptr || length <= 0) continue;
      const size_t element = state[s].element_size();
      size_t begin = static_cast<size_t>(start) * element / page * page;
      const size_t end = std::min(
          f.bytes, (static_cast<size_t>(start + length) * element + page - 1) / page * page);
      if (begin >= end) continue;
      fn(static_cast<char*>(f.address) + begin, end - begin, f, begin);
    }
  }
};

namespace {

// The same updates with libtorch's fused kernels, on a partition's whole buffers; false where
// this libtorch has none (then the vectorised updates above run). On CUDA the step count and
// the learning rate are tensors on the device: a step captured in a CUDA graph then advances the
// count and reads the rate on every replay (FlatOptimizer::before_replay writes a new rate).
bool fused_update(const std::string& algorithm, const torch::optim::OptimizerOptions& options,
                  Partition& part) {
#ifdef COHORT_FUSED_OPTIMIZERS
  at::Tensor& p = part.master;
  const at::Tensor& g = part.grads;
  const int64_t steps_done = part.steps.front();
  if (p.scalar_type() != at::kFloat || (!p.is_cpu() && !p.is_cuda())) return false;
  if (p.is_cuda()) part.lr.set(options.get_lr(), p.options());
  // The kernels take the rate as that tensor (on CUDA) or as a number: one call either way.
  const auto with_lr = [&](const auto& step_at) {
    if (p.is_cuda()) {
      step_at(part.lr.tensor);
    } else {
      step_at(options.get_lr());
    }
  };
  if (algorithm == "sgd") {
    const auto& o = static_cast<const torch::optim::SGDOptions&>(options);
    with_lr([&](const auto& rate) {
      at::_fused_sgd_({p}, {g}, part.state, o.weight_decay(), o.momentum(), rate, o.dampening(),
                      o.nesterov(), /*maximize=*/false, /*is_first_step=*/steps_done == 0);
    });
    return true;
  }
  const auto h = adam_hyper(options, algorithm);
  // The count the kernel reads is this step's: one more than the steps done, added on the device
  // (so that a replay adds it too).
  part.step_count.set(static_cast<double>(steps_done), p.options());
  part.step_count.tensor.add_(1);
  part.step_count.value += 1;
  std::vector<at::Tensor> max_exp_avg_sqs;
  if (h.amsgrad) max_exp_avg_sqs.push_back(part.state[2]);
  const std::vector<at::Tensor> steps{part.step_count.tensor};
  with_lr([&](const auto& rate) {
    if (h.decoupled) {
      at::_fused_adamw_({p}, {g}, {part.state[0]}, {part.state[1]}, max_exp_avg_sqs, steps, rate,
                        h.beta1, h.beta2, h.weight_decay, h.eps, h.amsgrad, /*maximize=*/false);
    } else {
      at::_fused_adam_({p}, {g}, {part.state[0]}, {part.state[1]}, max_exp_avg_sqs, steps, rate,
                       h.beta1, h.beta2, h.weight_decay, h.eps, h.amsgrad, /*maximize=*/false);
    }
  });
  return true;
#else
  (void)algorithm, (void)options, (void)part;
  return false;
#endif
}

// Runs an update over a partition's buffers a chunk at a time. The updates' temporaries are then
// a chunk's size: they come from the allocator's free lists instead of fresh pages every step
// (an 11 M-element temporary costs a page fault per 4 KiB, slower than the arithmetic), and the
// handful of passes over one chunk stay in the cache.
constexpr int64_t kChunkElements = int64_t{1} << 18;

// Disk offload: the fused kernels a chunk at a time (elementwise the same arithmetic as over the
// whole buffers, so the same results), each chunk's state read ahead and written behind. False
// where this libtorch has no fused kernels (said by the first chunk, before it changes anything).
bool fused_update_by_chunk(const std::string& algorithm,
                           const torch::optim::OptimizerOptions& options, Partition& part);

template <typename Update>
void for_each_chunk(Partition& part, const Update& update) {
  for (int64_t start = 0; start < part.numel; start += kChunkElements) {
    const int64_t length = std::min(kChunkElements, part.numel - start);
    part.read_ahead(start + length, std::min(kChunkElements, part.numel - start - length));
    auto p = part.master.narrow(0, start, length);
    const auto g = part.grads.narrow(0, start, length);
    std::vector<at::Tensor> state;
    for (const auto& s : part.state) state.push_back(s.narrow(0, start, length));
    update(p, g, state);
    part.write_behind(start, length);
  }
}

bool fused_update_by_chunk(const std::string& algorithm,
                           const torch::optim::OptimizerOptions& options, Partition& part) {
  for (int64_t start = 0; start < part.numel; start += kChunkElements) {
    const int64_t length = std::min(kChunkElements, part.numel - start);
    part.read_ahead(start + length, std::min(kChunkElements, part.numel - start - length));
    Partition chunk;
    chunk.master = part.master.narrow(0, start, length);
    chunk.grads = part.grads.narrow(0, start, length);
    for (const auto& state : part.state) chunk.state.push_back(state.narrow(0, start, length));
    chunk.steps = {part.steps.front()};
    if (!fused_update(algorithm, options, chunk)) return false;
    part.write_behind(start, length);
  }
  return true;
}

}  // namespace

struct FlatOptimizer::Impl {
  std::string algorithm;
  std::vector<std::vector<Partition>> groups;  // per param group
  std::filesystem::path offload_dir;           // disk offload's folder (empty: in memory)
  bool to_host = false;                        // offload_to_host()

  // The partition's state into files under offload_dir, its values kept.
  void offload(Partition& part) const {
    if (!part.state_files.empty()) return;
    for (auto& state : part.state) {
      if (!state.is_cpu()) {
        throw UsageError("optimizer state offload to disk holds CPU state; this state is on " +
                         state.device().str() + ": keep it in memory");
      }
    }
    const std::vector<at::Tensor> in_memory = part.state;
    for (auto& state : part.state) {
      std::shared_ptr<StateFile> file;
      state = file_backed(offload_dir, state, file);
      part.state_files.push_back(std::move(file));
    }
    // The values, a chunk at a time, each written behind: never the whole state in memory twice.
    for (int64_t start = 0; start < part.numel; start += kChunkElements) {
      const int64_t length = std::min(kChunkElements, part.numel - start);
      for (size_t s = 0; s < part.state.size(); ++s)
        part.state[s].narrow(0, start, length).copy_(in_memory[s].narrow(0, start, length));
      part.write_behind(start, length);
    }
  }

  // Whether every parameter's .grad is what the last gather copied: then the flat buffers (which
  // unscaling or clipping may have changed since) are the gradients to step with.
  static bool gathered_is_current(const std::vector<at::Tensor>& params,
                                  const std::vector<Partition>& parts) {
    for (const auto& part : parts) {
      if (part.gathered_grad.size() != part.members.size()) return false;
      for (size_t k = 0; k < part.members.size(); ++k) {
        const auto& grad = params[part.members[k]].grad();
        const void* impl = grad.defined() ? grad.unsafeGetTensorImpl() : nullptr;
        if (impl != part.gathered_grad[k]) return false;
        if (grad.defined() && grad._version() != part.gathered_version[k]) return false;
      }
    }
    return true;
  }

  static at::Tensor member_slice(const at::Tensor& flat, const Partition& part, size_t k,
                                 const at::Tensor& param) {
    return alias_into(flat, part.offsets[k], param.sizes());
  }

  // Lays the group's parameters out in flat buffers (copying their values) and points them
  // there. `carried`: per parameter index, its steps and state values to keep (a relayout).
  void lay_out(size_t g, std::vector<at::Tensor>& params, const torch::optim::OptimizerOptions& o,
               const std::map<size_t, std::pair<int64_t, std::vector<at::Tensor>>>& carried) {
    torch::NoGradGuard no_grad;
    std::vector<Partition> parts;
    std::map<std::pair<int, std::string>, size_t> index;  // (dtype, device) -> partition
    for (size_t i = 0; i < params.size(); ++i) {
      const auto key =
          std::make_pair(static_cast<int>(params[i].scalar_type()), params[i].device().str());
      auto it = index.find(key);
      if (it == index.end()) {
        it = index.emplace(key, parts.size()).first;
        parts.emplace_back();
      }
      auto& part = parts[it->second];
      part.members.push_back(i);
      part.offsets.push_back(part.numel);
      part.numel += params[i].numel();
    }
    const auto names = state_names_of(algorithm, o);
    for (auto& part : parts) {
      const auto& first = params[part.members.front()];
      // Parameters that already lie one after another in one buffer are stepped where they are:
      // one contiguous parameter (ZeRO's shards are such parameters, aliases into its flat
      // buffers), or another flat optimizer's buffer (a live regroup's kept state); others are
      // copied into a new flat buffer.
      std::vector<at::Tensor> members;
      for (const auto i : part.members) members.push_back(params[i]);
      const auto flat = already_flat(members, part.offsets, part.numel);
      const bool in_place = flat.defined();
      part.params = in_place ? flat : at::empty({part.numel}, first.options());
      const auto compute =
          low_precision(first.scalar_type()) ? c10::ScalarType::Float : first.scalar_type();
      // An in-place parameter whose .grad is already a flat buffer of the compute dtype keeps it
      // as the partition's gradient buffer (ZeRO stage 1: the shard's piece of the gradients).
      const auto& own_grad = first.grad();
      const bool adopt_grad = in_place && own_grad.defined() && own_grad.is_contiguous() &&
                              own_grad.scalar_type() == compute && own_grad.numel() == part.numel &&
                              own_grad.device() == first.device();
      auto written = adopt_grad ? alias_into(own_grad, 0, {part.numel})
                                : untouched_zeros(part.numel, first.options().dtype(compute));
      // Host offload: the update's gradients, masters and state in host memory, pinned where
      // they cross to the GPU and back every step.
      const bool on_host = to_host && !first.device().is_cpu();
      const auto host = at::TensorOptions().dtype(compute).device(at::kCPU);
      if (on_host) {
        part.device_grads = std::move(written);
        part.grads = at::empty({part.numel}, host.pinned_memory(true));
      } else {
        part.grads = std::move(written);
      }
      for (size_t s = 0; s < names.size(); ++s)
        part.state.push_back(
            untouched_zeros(part.numel, part.grads.options().pinned_memory(false)));
      part.steps.assign(part.members.size(), 0);
      part.has_grad.assign(part.members.size(), 0);
      for (size_t k = 0; k < part.members.size(); ++k) {
        auto& p = params[part.members[k]];
        if (!in_place) {
          auto slot = member_slice(part.params, part, k, p);
          slot.copy_(p);
          p.set_data(slot);
        }
        part.param_addresses.push_back(p.data_ptr());
        part.grad_aliases.push_back(member_slice(part.written_grads(), part, k, p));
        auto c = carried.find(part.members[k]);
        if (c != carried.end()) {
          part.state_untouched = false;
          part.steps[k] = c->second.first;
          for (size_t s = 0; s < names.size() && s < c->second.second.size(); ++s)
            member_slice(part.state[s], part, k, p).copy_(c->second.second[s]);
        }
      }
      if (on_host) {
        part.master = at::empty({part.numel}, host.pinned_memory(true));
        part.master.copy_(part.params);
      } else {
        part.master = low_precision(first.scalar_type()) ? part.params.to(compute) : part.params;
      }
      if (!offload_dir.empty()) offload(part);
    }
    groups[g] = std::move(parts);
  }

  // Whether a parameter was moved or replaced since the layout (module->to(), load): then
  // the group is laid out again, its state carried along.
  bool moved(const std::vector<at::Tensor>& params, const std::vector<Partition>& parts) const {
    size_t count = 0;
    for (const auto& part : parts) {
      count += part.members.size();
      for (size_t k = 0; k < part.members.size(); ++k) {
        const auto& p = params[part.members[k]];
        if (!p.defined() || p.data_ptr() != part.param_addresses[k]) return true;
      }
    }
    return count != params.size();
  }

  // `always`: also where nothing moved (the layout's placement changed: offload_to_host).
  void relayout_if_moved(size_t g, std::vector<at::Tensor>& params,
                         const torch::optim::OptimizerOptions& o, bool always = false) {
    if (g < groups.size() && !always && !moved(params, groups[g])) return;
    std::map<size_t, std::pair<int64_t, std::vector<at::Tensor>>> carried;
    if (g < groups.size()) {
      for (const auto& part : groups[g]) {
        if (part.state_untouched) continue;  // zeros and no steps: what a new layout holds
        for (size_t k = 0; k < part.members.size(); ++k) {
          const auto i = part.members[k];
          if (i >= params.size()) continue;
          // Carried where the new state will be: with the parameters, or on the host.
          const auto device = to_host ? at::Device(at::kCPU) : params[i].device();
          std::vector<at::Tensor> values;
          for (const auto& s : part.state) {
            values.push_back(alias_into(s, part.offsets[k], params[i].sizes())
                                 .to(device, s.scalar_type(), false, true));
          }
          carried[i] = {part.steps[k], std::move(values)};
        }
      }
    }
    if (groups.size() <= g) groups.resize(g + 1);
    lay_out(g, params, o, carried);
  }

  // Copies the parameters' gradients into the flat buffers (nothing for gradients that already
  // are aliases there) and, where the gradient was a tensor of its own, leaves the alias as the
  // parameter's .grad, so that later backward passes accumulate into the buffer directly.
  void gather(std::vector<at::Tensor>& params, std::vector<Partition>& parts) {
    torch::NoGradGuard no_grad;
    if (gathered_is_current(params, parts)) return;
    for (auto& part : parts) {
      part.gathered_grad.assign(part.members.size(), nullptr);
      part.gathered_version.assign(part.members.size(), 0);
      for (size_t k = 0; k < part.members.size(); ++k) {
        auto& p = params[part.members[k]];
        const auto grad = p.grad();
        part.has_grad[k] = grad.defined();
        if (!grad.defined()) {
          // An older gradient left in the slot must neither be stepped, nor counted by clipping,
          // nor be taken for an overflow by the loss scaler.
          part.grad_aliases[k].zero_();
          continue;
        }
        auto& slot = part.grad_aliases[k];
        if (grad.data_ptr() != slot.data_ptr()) {
          slot.copy_(grad);
          const bool owns_storage =
              grad.is_contiguous() && grad.storage_offset() == 0 &&
              static_cast<int64_t>(grad.storage().nbytes()) == grad.numel() * grad.element_size();
          if (owns_storage && grad.scalar_type() == slot.scalar_type() && !grad.is_sparse())
            p.mutable_grad() = slot;
        }
        const auto& now = p.grad();
        part.gathered_grad[k] = now.unsafeGetTensorImpl();
        part.gathered_version[k] = now._version();
      }
    }
  }
};

FlatOptimizer::FlatOptimizer(std::vector<torch::optim::OptimizerParamGroup> groups,
                             std::unique_ptr<torch::optim::OptimizerOptions> defaults,
                             std::string algorithm)
    : torch::optim::Optimizer(std::move(groups), std::move(defaults)),
      impl_(std::make_unique<Impl>()),
      algorithm_(std::move(algorithm)) {
  impl_->algorithm = algorithm_;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    for (const auto& p : param_groups_[g].params()) {
      if (!p.defined())
        throw UsageError("Flat optimizer: param group " + std::to_string(g) +
                         " holds an undefined tensor");
      if (p.is_sparse()) throw UsageError("Flat optimizer: sparse parameters are not supported");
      if (!p.is_floating_point())
        throw UsageError("Flat optimizer: parameter of dtype " +
                         std::string(c10::toString(p.scalar_type())) + " in param group " +
                         std::to_string(g) + " is not floating point");
    }
    // Parameters awaiting deferred initialisation (parallel::deferred_unit: a shape over one
    // element) have no values to lay out yet: the first step lays the group out. Under ZeRO the
    // engine builds its own optimizer over the shards and this one never steps.
    const auto& params = param_groups_[g].params();
    const bool deferred = std::any_of(params.begin(), params.end(), [](const at::Tensor& p) {
      return static_cast<int64_t>(p.storage().nbytes()) < p.numel() * p.element_size();
    });
    if (!deferred)
      impl_->relayout_if_moved(g, param_groups_[g].params(), param_groups_[g].options());
  }
}

FlatOptimizer::~FlatOptimizer() = default;

std::vector<torch::Tensor> FlatOptimizer::flat_gradients() {
  std::vector<torch::Tensor> out;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    impl_->relayout_if_moved(g, param_groups_[g].params(), param_groups_[g].options());
    impl_->gather(param_groups_[g].params(), impl_->groups[g]);
    for (auto& part : impl_->groups[g]) out.push_back(part.written_grads());
  }
  return out;
}

torch::Tensor FlatOptimizer::clip_grad_norm(double max_norm) {
  return clip_by_global_norm(flat_gradients(), max_norm);
}

torch::Tensor FlatOptimizer::step(LossClosure closure) {
  at::Tensor loss;
  if (closure) {
    torch::AutoGradMode enable_grad(true);
    loss = closure();
  }
  torch::NoGradGuard no_grad;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    auto& params = param_groups_[g].params();
    const auto& options = param_groups_[g].options();
    impl_->relayout_if_moved(g, params, options);
    auto& parts = impl_->groups[g];
    impl_->gather(params, parts);
    for (auto& part : parts) {
      // Low-precision parameters: the float32 masters start from the parameters' values as they
      // are at the first step (after DDP gave every rank rank 0's weights, or a load).
      if (!part.master.is_same(part.params) && !part.stepped) part.master.copy_(part.params);
      // Host offload: the gradients to the host (a copy that waits for the GPU's work on them).
      if (part.device_grads.defined()) part.grads.copy_(part.device_grads);
      part.stepped = true;
      part.state_untouched = false;
      bool all = true, same_step = true;
      for (size_t k = 0; k < part.members.size(); ++k) {
        all = all && part.has_grad[k];
        same_step = same_step && part.steps[k] == part.steps.front();
      }
      part.fused_last =
          all && same_step &&
          (part.state_files.empty() ? fused_update(algorithm_, options, part)
                                    : fused_update_by_chunk(algorithm_, options, part));
      if (part.fused_last) {
        // done in one pass
      } else if (algorithm_ == "sgd") {
        const auto& o = static_cast<const torch::optim::SGDOptions&>(options);
        if (all && same_step) {
          for_each_chunk(part, [&](at::Tensor& p, const at::Tensor& g,
                                   std::vector<at::Tensor>& state) {
            sgd_update(o, p, g, state.empty() ? at::Tensor() : state[0], part.steps.front() == 0);
          });
        } else {
          for (size_t k = 0; k < part.members.size(); ++k) {
            if (!part.has_grad[k]) continue;
            const auto& p = params[part.members[k]];
            auto master = Impl::member_slice(part.master, part, k, p);
            sgd_update(
                o, master, Impl::member_slice(part.grads, part, k, p),
                part.state.empty() ? at::Tensor() : Impl::member_slice(part.state[0], part, k, p),
                part.steps[k] == 0);
          }
        }
      } else {
        const auto hyper = adam_hyper(options, algorithm_);
        if (all && same_step) {
          for_each_chunk(part,
                         [&](at::Tensor& p, const at::Tensor& g, std::vector<at::Tensor>& state) {
                           adam_update(hyper, p, g, state, part.steps.front() + 1);
                         });
        } else {
          for (size_t k = 0; k < part.members.size(); ++k) {
            if (!part.has_grad[k]) continue;
            const auto& p = params[part.members[k]];
            auto master = Impl::member_slice(part.master, part, k, p);
            std::vector<at::Tensor> state;
            for (const auto& s : part.state) state.push_back(Impl::member_slice(s, part, k, p));
            adam_update(hyper, master, Impl::member_slice(part.grads, part, k, p), state,
                        part.steps[k] + 1);
          }
        }
      }
      for (size_t k = 0; k < part.members.size(); ++k)
        if (part.has_grad[k]) ++part.steps[k];
      if (!part.master.is_same(part.params)) part.params.copy_(part.master);
    }
  }
  // The next step gathers afresh even where .grad was left as it was (a loop without zero_grad).
  skip_step();
  return loss;
}

void FlatOptimizer::before_replay() {
  for (size_t g = 0; g < impl_->groups.size(); ++g) {
    const double lr = param_groups_[g].options().get_lr();
    for (auto& part : impl_->groups[g]) {
      if (part.lr.tensor.defined()) part.lr.set(lr, part.lr.tensor.options());
      for (size_t k = 0; k < part.members.size(); ++k)
        if (part.has_grad[k]) ++part.steps[k];
      if (part.step_count.tensor.defined()) part.step_count.value += 1;  // the replay adds it
    }
  }
}

bool FlatOptimizer::replays_exactly() const {
  for (const auto& parts : impl_->groups)
    for (const auto& part : parts)
      if (!part.fused_last || !part.params.is_cuda() || !part.master.is_cuda()) return false;
  return true;
}

std::vector<int64_t> FlatOptimizer::host_step_counts() const {
  std::vector<int64_t> counts;
  for (const auto& parts : impl_->groups)
    for (const auto& part : parts)
      counts.insert(counts.end(), part.steps.begin(), part.steps.end());
  return counts;
}

void FlatOptimizer::restore_host_step_counts(const std::vector<int64_t>& counts) {
  size_t i = 0;
  for (auto& parts : impl_->groups)
    for (auto& part : parts)
      for (auto& steps : part.steps) {
        if (i == counts.size())
          throw UsageError("Flat optimizer: " + std::to_string(counts.size()) +
                           " step counts given for more parameters");
        steps = counts[i++];
      }
}

std::vector<std::string> FlatOptimizer::state_buffer_names() const {
  return param_groups_.empty() ? std::vector<std::string>{}
                               : state_names_of(algorithm_, param_groups_[0].options());
}

std::vector<torch::Tensor> FlatOptimizer::state_buffers(size_t group) const {
  auto& parts = impl_->groups.at(group);
  if (parts.empty()) return {};
  parts.front().state_untouched = false;  // they may be written
  return parts.front().state;
}

void FlatOptimizer::release_state_pages(size_t group, size_t state, int64_t start,
                                        int64_t length) const {
  const auto& parts = impl_->groups.at(group);
  if (!parts.empty()) parts.front().write_behind(start, length, static_cast<int>(state));
}

int64_t FlatOptimizer::steps_taken(size_t group) const {
  const auto& parts = impl_->groups.at(group);
  return parts.empty() || parts.front().steps.empty() ? 0 : parts.front().steps.front();
}

void FlatOptimizer::set_steps_taken(size_t group, int64_t steps) {
  for (auto& part : impl_->groups.at(group)) {
    std::fill(part.steps.begin(), part.steps.end(), steps);
    part.state_untouched = false;
  }
}

void FlatOptimizer::offload_state(const std::filesystem::path& dir) {
  std::error_code error;
  if (!std::filesystem::is_directory(dir, error)) {
    throw UsageError("optimizer state offload: " + dir.string() +
                     " is not a folder: create it, or choose one on a disk with room");
  }
  if (::access(dir.c_str(), W_OK) != 0) {
    throw UsageError("optimizer state offload: " + dir.string() +
                     " is not writable by this process: choose another folder");
  }
  torch::NoGradGuard no_grad;
  impl_->offload_dir = dir;
  for (auto& parts : impl_->groups)
    for (auto& part : parts) impl_->offload(part);
}

bool FlatOptimizer::state_offloaded() const { return !impl_->offload_dir.empty(); }

void FlatOptimizer::offload_to_host() {
  if (impl_->to_host) return;
  impl_->to_host = true;
  for (size_t g = 0; g < impl_->groups.size(); ++g) {
    const auto& parts = impl_->groups[g];
    const bool on_gpu = std::any_of(parts.begin(), parts.end(),
                                    [](const Partition& p) { return !p.params.is_cpu(); });
    // Laid out again with the state carried along; CPU partitions come back as they were.
    if (on_gpu) {
      impl_->relayout_if_moved(g, param_groups_[g].params(), param_groups_[g].options(),
                               /*always=*/true);
    }
  }
}

bool FlatOptimizer::offloaded_to_host() const { return impl_->to_host; }

void FlatOptimizer::skip_step() {
  for (auto& parts : impl_->groups)
    for (auto& part : parts) part.gathered_grad.clear();
}

int64_t FlatOptimizer::state_bytes() const {
  int64_t bytes = 0;
  for (const auto& parts : impl_->groups) {
    for (const auto& part : parts) {
      bytes += part.grads.numel() * part.grads.element_size();
      if (part.device_grads.defined())
        bytes += part.device_grads.numel() * part.device_grads.element_size();
      for (const auto& s : part.state) bytes += s.numel() * s.element_size();
      if (!part.master.is_same(part.params))
        bytes += part.master.numel() * part.master.element_size();
    }
  }
  return bytes;
}

namespace {
constexpr const char* kFormat = "cohort.flat_optimizer.v1";
}

void FlatOptimizer::save(torch::serialize::OutputArchive& archive) const {
  // The param groups' options where libtorch's own optimizers keep them, so that
  // train::load_optimizer restores lr and friends the same way for both.
  torch::serialize::OutputArchive groups(archive.compilation_unit());
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    torch::serialize::OutputArchive group(archive.compilation_unit());
    torch::serialize::OutputArchive options(archive.compilation_unit());
    param_groups_[g].options().serialize(options);
    group.write("options", options);
    groups.write("param_groups/" + std::to_string(g), group);
  }
  archive.write("param_groups", groups);
  torch::serialize::OutputArchive flat(archive.compilation_unit());
  flat.write("format", c10::IValue(std::string(kFormat)));
  flat.write("algorithm", c10::IValue(algorithm_));
  for (size_t g = 0; g < impl_->groups.size(); ++g) {
    const auto& parts = impl_->groups[g];
    const auto names = state_names_of(algorithm_, param_groups_[g].options());
    // Per parameter, in the group's order: steps and numel; state as one buffer per name in the
    // parameters' order (independent of the dtype/device partitioning).
    const auto& params = param_groups_[g].params();
    std::vector<int64_t> steps(params.size(), 0), numels(params.size(), 0);
    std::vector<std::vector<at::Tensor>> per_name(names.size(),
                                                  std::vector<at::Tensor>(params.size()));
    const std::string prefix = "group/" + std::to_string(g) + "/";
    // One dtype per saved buffer: float32, or float64 when any parameter is float64.
    auto saved_dtype = at::kFloat;
    for (const auto& part : parts)
      if (part.grads.scalar_type() == at::kDouble) saved_dtype = at::kDouble;
    for (const auto& part : parts) {
      for (size_t k = 0; k < part.members.size(); ++k) {
        const auto i = part.members[k];
        steps[i] = part.steps[k];
        numels[i] = params[i].numel();
        for (size_t s = 0; s < names.size(); ++s)
          per_name[s][i] =
              part.state[s].narrow(0, part.offsets[k], params[i].numel()).to(at::kCPU, saved_dtype);
      }
    }
    // Masters of low-precision parameters, so that a resumed run continues from the same float32
    // values.
    std::vector<at::Tensor> masters(params.size());
    bool any_master = false;
    for (const auto& part : parts) {
      if (part.master.is_same(part.params)) continue;
      any_master = true;
      for (size_t k = 0; k < part.members.size(); ++k) {
        const auto i = part.members[k];
        masters[i] =
            part.master.narrow(0, part.offsets[k], params[i].numel()).to(at::kCPU, at::kFloat);
      }
    }
    if (any_master) {
      for (size_t i = 0; i < params.size(); ++i)
        if (!masters[i].defined())
          masters[i] = params[i].detach().reshape(-1).to(at::kCPU, at::kFloat);
      flat.write(prefix + "master", at::cat(masters));
    }
    flat.write(prefix + "steps", at::tensor(steps, at::kLong));
    flat.write(prefix + "numels", at::tensor(numels, at::kLong));
    // One part holding every parameter in the group's order, back to back, in the saved dtype on
    // the CPU: its state buffers are already the concatenation, written as they are (a
    // concatenation would copy the whole state into fresh memory).
    bool in_order = parts.size() == 1 && parts[0].members.size() == params.size();
    int64_t total = 0;
    for (size_t k = 0; in_order && k < params.size(); ++k) {
      in_order = parts[0].members[k] == k && parts[0].offsets[k] == total;
      total += params[k].numel();
    }
    for (size_t s = 0; s < names.size(); ++s) {
      if (params.empty()) {
        flat.write(prefix + names[s], at::zeros({0}, at::kFloat));
      } else if (in_order && parts[0].state[s].device().is_cpu() &&
                 parts[0].state[s].scalar_type() == saved_dtype) {
        flat.write(prefix + names[s], parts[0].state[s].narrow(0, 0, total));
      } else {
        flat.write(prefix + names[s], at::cat(per_name[s]));
      }
    }
  }
  archive.write("cohort_flat_state", flat);
}

void FlatOptimizer::load(torch::serialize::InputArchive& archive) {
  torch::serialize::InputArchive flat;
  if (!archive.try_read("cohort_flat_state", flat)) {
    throw UsageError(
        "this optimizer state was not written by a cohort flat optimizer (no cohort_flat_state): "
        "it comes from libtorch's torch::optim; load it into the torch::optim optimizer that "
        "wrote it, or start the flat optimizer afresh");
  }
  c10::IValue format, algorithm;
  flat.read("format", format);
  flat.read("algorithm", algorithm);
  if (!format.isString() || format.toStringRef() != kFormat)
    throw UsageError("optimizer state has format '" +
                     (format.isString() ? format.toStringRef() : std::string("?")) +
                     "', expected " + kFormat);
  if (algorithm.toStringRef() != algorithm_)
    throw UsageError("optimizer state was written by a flat " + algorithm.toStringRef() +
                     " optimizer, not " + algorithm_ + ": use the same --optimizer");
  torch::NoGradGuard no_grad;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    auto& params = param_groups_[g].params();
    impl_->relayout_if_moved(g, params, param_groups_[g].options());
    const std::string prefix = "group/" + std::to_string(g) + "/";
    at::Tensor steps, numels;
    if (!flat.try_read(prefix + "steps", steps) || !flat.try_read(prefix + "numels", numels))
      throw UsageError("optimizer state has no param group " + std::to_string(g) +
                       ": it was written for an optimizer with fewer param groups");
    if (numels.numel() != static_cast<int64_t>(params.size()))
      throw UsageError("optimizer state's param group " + std::to_string(g) + " has " +
                       std::to_string(numels.numel()) + " parameters, the optimizer " +
                       std::to_string(params.size()));
    for (size_t i = 0; i < params.size(); ++i) {
      if (numels[i].item<int64_t>() != params[i].numel())
        throw UsageError("optimizer state's parameter " + std::to_string(i) + " of param group " +
                         std::to_string(g) + " has " + std::to_string(numels[i].item<int64_t>()) +
                         " elements, the model's " + std::to_string(params[i].numel()));
    }
    const auto names = state_names_of(algorithm_, param_groups_[g].options());
    std::vector<at::Tensor> values(names.size());
    for (size_t s = 0; s < names.size(); ++s) {
      if (!flat.try_read(prefix + names[s], values[s]))
        throw UsageError("optimizer state lacks '" + names[s] + "' of param group " +
                         std::to_string(g) + " (saved with other options, e.g. amsgrad?)");
    }
    at::Tensor masters;
    const bool has_masters = flat.try_read(prefix + "master", masters);
    std::vector<int64_t> offsets(params.size(), 0);
    for (size_t i = 1; i < params.size(); ++i) offsets[i] = offsets[i - 1] + params[i - 1].numel();
    for (auto& part : impl_->groups[g]) {
      for (size_t k = 0; k < part.members.size(); ++k) {
        const auto i = part.members[k];
        part.steps[k] = steps[i].item<int64_t>();
        for (size_t s = 0; s < names.size(); ++s)
          part.state[s]
              .narrow(0, part.offsets[k], params[i].numel())
              .copy_(values[s].narrow(0, offsets[i], params[i].numel()));
        if (!part.master.is_same(part.params)) {
          part.master.narrow(0, part.offsets[k], params[i].numel())
              .copy_(has_masters ? masters.narrow(0, offsets[i], params[i].numel())
                                 : part.params.narrow(0, part.offsets[k], params[i].numel()));
        }
      }
      part.stepped = true;
      part.state_untouched = false;
    }
  }
}

FlatOptimizer::ParameterState FlatOptimizer::parameter_state(size_t group, size_t index) {
  auto state = parameter_state_views(group, index);
  for (auto& values : state.values) values = values.clone();
  return state;
}

FlatOptimizer::ParameterState FlatOptimizer::parameter_state_views(size_t group, size_t index) {
  auto& params = param_groups_.at(group).params();
  impl_->relayout_if_moved(group, params, param_groups_[group].options());
  for (auto& part : impl_->groups[group]) {
    for (size_t k = 0; k < part.members.size(); ++k) {
      if (part.members[k] != index) continue;
      part.state_untouched = false;  // the views may be written (a load's)
      ParameterState state{.steps = part.steps[k], .values = {}};
      for (const auto& buffer : part.state)
        state.values.push_back(buffer.narrow(0, part.offsets[k], params[index].numel()));
      return state;
    }
  }
  throw UsageError("FlatOptimizer::parameter_state: param group " + std::to_string(group) +
                   " has no parameter " + std::to_string(index));
}

void FlatOptimizer::release_parameter_state(size_t group, size_t index, size_t state) const {
  for (const auto& part : impl_->groups.at(group)) {
    for (size_t k = 0; k < part.members.size(); ++k) {
      if (part.members[k] != index) continue;
      const auto numel = param_groups_.at(group).params().at(index).numel();
      part.write_behind(part.offsets[k], numel, static_cast<int>(state));
      return;
    }
  }
}

void FlatOptimizer::set_parameter_state(size_t group, size_t index, const ParameterState& state) {
  torch::NoGradGuard no_grad;
  auto& params = param_groups_.at(group).params();
  impl_->relayout_if_moved(group, params, param_groups_[group].options());
  for (auto& part : impl_->groups[group]) {
    for (size_t k = 0; k < part.members.size(); ++k) {
      if (part.members[k] != index) continue;
      if (state.values.size() != part.state.size()) {
        throw UsageError("FlatOptimizer::set_parameter_state: " +
                         std::to_string(state.values.size()) + " state buffers given, the " +
                         algorithm_ + " optimizer keeps " + std::to_string(part.state.size()));
      }
      part.steps[k] = state.steps;
      for (size_t s = 0; s < part.state.size(); ++s) {
        auto own = part.state[s].narrow(0, part.offsets[k], params[index].numel());
        const auto& given = state.values[s];
        // Filled in place (parameter_state_views): nothing to copy.
        if (given.data_ptr() == own.data_ptr() && given.numel() == own.numel() &&
            given.scalar_type() == own.scalar_type() && given.is_contiguous()) {
          continue;
        }
        own.copy_(given.reshape({-1}));
      }
      part.stepped = true;
      part.state_untouched = false;
      return;
    }
  }
  throw UsageError("FlatOptimizer::set_parameter_state: param group " + std::to_string(group) +
                   " has no parameter " + std::to_string(index));
}

bool FlatOptimizer::adopt(size_t group, const std::vector<torch::Tensor>& weights,
                          const std::vector<ParameterState>& states) {
  torch::NoGradGuard no_grad;
  auto& params = param_groups_.at(group).params();
  const auto& options = param_groups_[group].options();
  if (weights.size() != params.size() || states.size() != params.size()) return false;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& w = weights[i];
    if (!w.defined() || w.sizes() != params[i].sizes() ||
        w.scalar_type() != params[i].scalar_type() || w.device() != params[i].device())
      return false;
  }
  // The weights share the parameters' dtypes and devices: the layout's partitions are theirs.
  impl_->relayout_if_moved(group, params, options);
  const auto& parts = impl_->groups[group];
  std::vector<std::vector<at::Tensor>> adopted(parts.size());
  for (size_t p = 0; p < parts.size(); ++p) {
    const auto& part = parts[p];
    if (!part.state_files.empty() || part.device_grads.defined()) return false;
    std::vector<at::Tensor> members;
    for (const auto member : part.members) members.push_back(weights[member]);
    if (!already_flat(members, part.offsets, part.numel).defined()) return false;
    for (size_t s = 0; s < part.state.size(); ++s) {
      std::vector<at::Tensor> values;
      for (const auto member : part.members) {
        const auto& given = states[member].values;
        if (given.size() != part.state.size() || given[s].numel() != params[member].numel())
          return false;
        values.push_back(given[s]);
      }
      auto flat = already_flat(values, part.offsets, part.numel);
      if (!flat.defined() || flat.scalar_type() != part.state[s].scalar_type() ||
          flat.device() != part.state[s].device())
        return false;
      adopted[p].push_back(std::move(flat));
    }
  }
  for (size_t i = 0; i < params.size(); ++i) params[i].set_data(weights[i]);
  impl_->relayout_if_moved(group, params, options);  // over the weights' buffers, as they lie
  auto& laid_out = impl_->groups[group];
  for (size_t p = 0; p < laid_out.size(); ++p) {
    auto& part = laid_out[p];
    part.state = std::move(adopted[p]);
    for (size_t k = 0; k < part.members.size(); ++k) part.steps[k] = states[part.members[k]].steps;
    part.stepped = true;
    part.state_untouched = false;
  }
  return true;
}

FlatSGD::FlatSGD(std::vector<torch::Tensor> params, torch::optim::SGDOptions options)
    : FlatSGD(std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup(
                  std::move(params))},
              std::move(options)) {}

FlatSGD::FlatSGD(std::vector<torch::optim::OptimizerParamGroup> groups,
                 torch::optim::SGDOptions options)
    : FlatOptimizer(std::move(groups),
                    (validate(options), std::make_unique<torch::optim::SGDOptions>(options)),
                    "sgd") {}

FlatAdam::FlatAdam(std::vector<torch::Tensor> params, torch::optim::AdamOptions options)
    : FlatAdam(std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup(
                   std::move(params))},
               std::move(options)) {}

FlatAdam::FlatAdam(std::vector<torch::optim::OptimizerParamGroup> groups,
                   torch::optim::AdamOptions options)
    : FlatOptimizer(std::move(groups),
                    (validate(options), std::make_unique<torch::optim::AdamOptions>(options)),
                    "adam") {}

FlatAdamW::FlatAdamW(std::vector<torch::Tensor> params, torch::optim::AdamWOptions options)
    : FlatAdamW(std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup(
                    std::move(params))},
                std::move(options)) {}

FlatAdamW::FlatAdamW(std::vector<torch::optim::OptimizerParamGroup> groups,
                     torch::optim::AdamWOptions options)
    : FlatOptimizer(std::move(groups),
                    (validate(options), std::make_unique<torch::optim::AdamWOptions>(options)),
                    "adamw") {}

std::vector<std::string> state_names_of(const std::string& algorithm,
                                        const torch::optim::OptimizerOptions& o) {
  if (algorithm == "sgd") {
    if (static_cast<const torch::optim::SGDOptions&>(o).momentum() == 0) return {};
    return {"momentum_buffer"};
  }
  const bool amsgrad = algorithm == "adam"
                           ? static_cast<const torch::optim::AdamOptions&>(o).amsgrad()
                           : static_cast<const torch::optim::AdamWOptions&>(o).amsgrad();
  if (amsgrad) return {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  return {"exp_avg", "exp_avg_sq"};
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const OptimizerOptions& o,
                                                        std::vector<torch::Tensor> params) {
  o.check();
  const double lr = o.learning_rate();
  const double decay = o.weight_decay_or_default();
  // Adam's and AdamW's options, which differ only in their type.
  const auto adam = [&](auto options) {
    options.weight_decay(decay);
    if (o.betas) options.betas({o.betas->first, o.betas->second});
    if (o.eps) options.eps(*o.eps);
    validate(options);
    return options;
  };
  if (o.algorithm == "adamw") {
    const auto options = adam(torch::optim::AdamWOptions(lr));
    if (o.flat) return std::make_unique<FlatAdamW>(std::move(params), options);
    return std::make_unique<torch::optim::AdamW>(std::move(params), options);
  }
  if (o.algorithm == "adam") {
    const auto options = adam(torch::optim::AdamOptions(lr));
    if (o.flat) return std::make_unique<FlatAdam>(std::move(params), options);
    return std::make_unique<torch::optim::Adam>(std::move(params), options);
  }
  auto options =
      torch::optim::SGDOptions(lr).momentum(o.momentum).nesterov(o.nesterov).weight_decay(decay);
  validate(options);
  if (o.flat) return std::make_unique<FlatSGD>(std::move(params), options);
  return std::make_unique<torch::optim::SGD>(std::move(params), options);
}

std::string algorithm_of(const torch::optim::Optimizer& optimizer, const std::string& who,
                         const std::string& why) {
  if (const auto* flat = dynamic_cast<const FlatOptimizer*>(&optimizer)) return flat->algorithm();
  if (dynamic_cast<const torch::optim::SGD*>(&optimizer)) return "sgd";
  if (dynamic_cast<const torch::optim::AdamW*>(&optimizer)) return "adamw";
  if (dynamic_cast<const torch::optim::Adam*>(&optimizer)) return "adam";
  throw UsageError(who +
                   ": the optimizer is neither SGD, Adam nor AdamW (torch::optim's or cohort's "
                   "flat ones): " +
                   why);
}

std::unique_ptr<FlatOptimizer> make_flat_optimizer(
    std::vector<torch::optim::OptimizerParamGroup> groups, const std::string& algorithm,
    const torch::optim::OptimizerOptions& options) {
  if (algorithm == "sgd")
    return std::make_unique<FlatSGD>(std::move(groups),
                                     dynamic_cast<const torch::optim::SGDOptions&>(options));
  if (algorithm == "adam")
    return std::make_unique<FlatAdam>(std::move(groups),
                                      dynamic_cast<const torch::optim::AdamOptions&>(options));
  if (algorithm == "adamw")
    return std::make_unique<FlatAdamW>(std::move(groups),
                                       dynamic_cast<const torch::optim::AdamWOptions&>(options));
  throw UsageError("make_flat_optimizer: unknown algorithm '" + algorithm +
                   "': choose sgd, adam or adamw");
}

torch::Tensor clip_grad_norm(const std::vector<torch::Tensor>& parameters, double max_norm) {
  std::vector<at::Tensor> grads;
  for (const auto& p : parameters)
    if (p.grad().defined()) grads.push_back(p.grad());
  return clip_by_global_norm(grads, max_norm);
}

}  // namespace cohort::optim

#pragma once
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "cohort/json.h"
#include "cohort/optim/state_dict.h"
#include "cohort/parallel/tensor_parallel.h"
#include "cohort/train/safetensors_header.h"

namespace cohort::parallel::pipeline {
class Pipeline;
}

namespace cohort {

/// A directory of files that together are a checkpoint (Ray Train's Checkpoint). A worker writes
/// its files to any folder and reports Checkpoint::from_directory(folder); cohort copies them into
/// the run directory as checkpoint_NNNNNN, with a manifest of sizes and checksums.
class Checkpoint {
 public:
  /// The checkpoint in `dir` (Ray Train's Checkpoint.from_directory); UsageError when it is not a
  /// directory.
  static Checkpoint from_directory(const std::filesystem::path& dir);
  /// Its folder.
  const std::filesystem::path& path() const { return path_; }
  /// The metrics reported with it (meta.json), when it was persisted by cohort.
  Json metrics() const;
  /// How many workers the group that wrote it had (meta.json); 0 when not known.
  int world_size() const;
  /// How many of them were data-parallel replicas: with a mesh its dp degree, else world_size().
  int data_parallel_size() const;
  /// Checks every file against the manifest; throws UsageError naming the file and the problem.
  void verify() const;

 private:
  explicit Checkpoint(std::filesystem::path path) : path_(std::move(path)) {}
  std::filesystem::path path_;
};

namespace train {

/// Writes the module's parameters and buffers (by their dotted names) as safetensors, readable
/// by Python's safetensors or plain numpy. Written to a temporary name and renamed.
void save_model(const torch::nn::Module& module, const std::filesystem::path& file);
/// Loads a file written by save_model into a module of the same architecture; throws UsageError
/// naming the missing, unexpected or mis-shaped tensor.
void load_model(torch::nn::Module& module, const std::filesystem::path& file);

/// Pipelines: writes this rank's stages' parameters and buffers, under the whole model's names
/// (split_sequential keeps them), as `dir``/stage-<s>.safetensors` (dir created). Call it on the
/// ranks of one pipeline (e.g. dp index 0): the stage files together are the model.
void save_pipeline_stages(const std::filesystem::path& dir,
                          const parallel::pipeline::Pipeline& pipeline);
/// Loads every parameter and buffer of `module` by name from the .safetensors files in `dir`:
/// model.safetensors of an unsplit model, or the stage files of a pipeline cut any way. So a whole
/// model loads from a pipeline's stages, a stage from a whole model, and a stage of one cut from
/// another cut's files. Reads only the bytes of the tensors it needs. A name found in no file, or
/// with another shape or dtype, is a UsageError naming it and the folder.
void load_by_name(torch::nn::Module& module, const std::filesystem::path& dir);

/// Optimizer state (libtorch's own format), alongside the model.
void save_optimizer(const torch::optim::Optimizer& optimizer, const std::filesystem::path& file);
/// Loads save_optimizer's file into `optimizer` (its parameters in the same order).
void load_optimizer(torch::optim::Optimizer& optimizer, const std::filesystem::path& file);

/// The checkpointer of parts with state (optim::Stateful, PyTorch DCP's protocol): writes this
/// rank's `state` of part `name` into `dir` (created) as "<name>-rank<shard>-of-<shards>
/// .safetensors", each piece under "<tensor>/<first element>"; shard 0 also writes
/// "<name>_manifest.json" with the files and the values. Every rank of a sharded state calls it;
/// of a replicated one (shards 1), one rank; a replicated part of values only (a loss scaler's, a
/// schedule's) is its manifest alone. UsageError for a piece outside its tensor.
void save_state(const std::filesystem::path& dir, const std::string& name,
                const optim::StateDict& state);
/// Loads part `name` of `dir` (save_state's files) into `part`, whatever number of ranks wrote
/// it: part.check_state(values), then every tensor and range part.state_dict() holds, read from
/// only the overlapping pieces of the files, then part.load_state_dict(). UsageError naming the
/// folder and the tensor's range when the files do not cover it, or a listed file is missing.
void load_state(const std::filesystem::path& dir, const std::string& name, optim::Stateful& part);
/// Whether `dir` holds part `name` (save_state's manifest of it).
bool holds_state(const std::filesystem::path& dir, const std::string& name);

/// The usual checkpoint of a training loop, in one call each way: `dir` (created) gets
/// model.safetensors and optimizer.pt (a flat optimizer: its state as state files, written a
/// parameter at a time and read back into the buffers it holds, loadable into any optimizer
/// alike); returns it as a Checkpoint ready for report(). With an
/// optimizer whose state lies in pieces over its group (optim::ShardedState: ZeRO's and the
/// parameter server's shards, local SGD's replicas) every rank calls it and writes its part (see
/// checkpoint_per_rank), and model.safetensors holds ShardedState::model_state() where it gives
/// one (local SGD's global parameters); with ZeRO's sharding groups (HSDP) the ranks of the first
/// group do, the others write nothing.
Checkpoint save_checkpoint(const std::filesystem::path& dir, const torch::nn::Module& module,
                           const torch::optim::Optimizer& optimizer);
/// The optimizer's part of save_checkpoint and load_checkpoint alone, for loops that keep their
/// model otherwise (a pipeline's stages; `module` holds the parameters the optimizer steps, by
/// the names its files use): `dir` (created) gets optimizer.pt (a flat optimizer: its state as
/// state files, as save_checkpoint writes it), or with an optim::ShardedState (ZeRO's, the
/// parameter server's) this rank's shards (every rank of its group calls it then). Each loads
/// into any: shards into ZeRO at any world size and stage, into the parameter server at any
/// number of servers, or into the whole optimizer over `module`'s parameters; optimizer.pt into
/// a shard of it. Local SGD and DiLoCo keep their state with the parameters: UsageError (use
/// save_checkpoint).
void save_optimizer_state(const std::filesystem::path& dir,
                          const torch::optim::Optimizer& optimizer,
                          const torch::nn::Module& module);
/// Loads save_optimizer_state's files of `dir` into `optimizer` over `module`'s parameters, at
/// any world size and for any engine the arithmetic allows; into local SGD or DiLoCo, every
/// rank's inner optimizer takes the state and a new period starts (their own checkpoint loads
/// with load_checkpoint: UsageError).
void load_optimizer_state(const std::filesystem::path& dir, torch::optim::Optimizer& optimizer,
                          const torch::nn::Module& module);
/// A model's optimizer state kept in several folders of save_optimizer_state, one per part of the
/// model (a pipeline's stages, tensor-parallel slices, each maybe sharded by ZeRO): with each
/// part, its optimizer's parameters in order, by the name the folder's files use, the whole
/// model's name and the shape, and for a tensor-parallel slice which one. A run cut otherwise, or
/// not at all, loads them by the whole model's names.
struct OptimizerPart {
  /// One parameter of the part.
  struct Parameter {
    std::string name;            ///< in the part's files
    std::string whole_name;      ///< its name in the whole model
    std::vector<int64_t> shape;  ///< this part's (a slice's)
    /// Slice `slice` of `slices` of the whole parameter, cut by `cut` (slices 1: whole).
    parallel::TensorParallelCut cut = {};
    int64_t slice = 0;   ///< which slice, from 0
    int64_t slices = 1;  ///< of how many (1: the whole parameter)
  };
  std::filesystem::path dir;          ///< the folder of the part's files
  std::vector<Parameter> parameters;  ///< in the optimizer's order
};
/// Writes part.dir/optimizer_part.json, beside save_optimizer_state's files.
void save_optimizer_part(const OptimizerPart& part);
/// The parts in the folders of `checkpoint_dir`, by folder name; none: empty.
std::vector<OptimizerPart> find_optimizer_parts(const std::filesystem::path& checkpoint_dir);
/// Loads `optimizer` (a whole one over `module`'s parameters, or a ZeroOptimizer at any stage and
/// world size) from `parts`, each parameter's state from the parts that hold its whole-model
/// name (its slices gathered and cut anew where the slicing differs), reading only the parts
/// that hold some. `layout` describes `module`'s parameters by their names in it (or the ZeRO
/// engine's): whole-model name and slice; a name it lacks is the whole model's, whole. UsageError
/// naming a parameter, or a slice of one, that no part holds. load_optimizer_state (and
/// load_checkpoint) take the parts of a folder that holds no optimizer state of its own.
void load_optimizer_parts(const std::vector<OptimizerPart>& parts,
                          torch::optim::Optimizer& optimizer, const torch::nn::Module& module,
                          const std::vector<OptimizerPart::Parameter>& layout = {});
/// Whether every rank must call save_checkpoint (and report the result) for `optimizer`: ZeRO's
/// shards (with sharding groups, the first group's ranks), the parameter server's (saving
/// synchronises the group), local SGD's per-rank parameters and state. Otherwise rank 0's files
/// are the checkpoint.
bool checkpoint_per_rank(const torch::optim::Optimizer& optimizer);
/// Whether `dir` is save_checkpoint's folder of a LocalSgdOptimizer (local SGD or DiLoCo: the
/// global parameters, every rank's own and its inner state; the current format or the first).
/// A synchronous run loads it too (its first rank's inner state, on every rank).
bool is_local_sgd_checkpoint(const std::filesystem::path& dir);
/// Loads save_checkpoint's files into `module` and `optimizer`, at any world size and into either
/// engine (see load_optimizer_state); then restore_run_state.
void load_checkpoint(const Checkpoint& checkpoint, torch::nn::Module& module,
                     torch::optim::Optimizer& optimizer);
/// The rest of load_checkpoint, for loops that load the model and the optimizer state themselves
/// (a pipeline's stages: load_by_name, load_optimizer_state), after both: fp16's loss scale comes
/// back, per-step metrics count from here, and ScalingConfig::on_world_size_change runs when the
/// checkpoint came from a group of another size: of another data-parallel size, with a mesh on
/// either side (the global batch scales with dp, not with the pipeline's or tensor-parallel ranks),
/// and the sizes passed are those.
void restore_run_state(const Checkpoint& checkpoint, torch::optim::Optimizer& optimizer);

/// Any checkpoint's model (DDP's, ZeRO's at any stage, local SGD's, the parameter server's, or a
/// pipeline's stage files) as one safetensors file at `output`, written one tensor at a time: no
/// more than one tensor is held beyond what is written. The checkpoint is verified against its
/// manifest first. Returns the number of tensors written. UsageError naming the folder when it
/// holds no model file, or two files disagree on a tensor.
int64_t consolidate_checkpoint(const Checkpoint& checkpoint, const std::filesystem::path& output);

/// An on_world_size_change for the linear scaling rule (Goyal et al. 2017): with the per-worker
/// batch fixed, the global batch scales with the world size, and so does every group's lr.
void linear_lr_scaling(torch::optim::Optimizer& optimizer, int previous_world_size, int world_size);

}  // namespace train

namespace safetensors {

/// The safetensors format: an 8-byte little-endian header length, a JSON header naming each
/// tensor's dtype, shape and byte range, then the raw little-endian data.
/// `written`, where given, is called with each tensor's name once its bytes are out.
void write(const std::filesystem::path& file, const std::map<std::string, at::Tensor>& tensors,
           const std::map<std::string, std::string>& metadata = {},
           const std::function<void(const std::string&)>& written = {});
/// The same file written one tensor at a time: the header from `layout` (each name's dtype and
/// shape), then each tensor's bytes as tensor_of(name) returns it, so that no more than one is in
/// memory at once; then written(name), where given.
void write_streaming(
    const std::filesystem::path& file,
    const std::map<std::string, std::pair<at::ScalarType, std::vector<int64_t>>>& layout,
    const std::map<std::string, std::string>& metadata,
    const std::function<at::Tensor(const std::string&)>& tensor_of,
    const std::function<void(const std::string&)>& written = {});
std::map<std::string, at::Tensor> read(const std::filesystem::path& file);

/// Elements [first, first + out.numel()) of tensor `name`, flattened, into `out` (a contiguous
/// CPU tensor of its dtype), reading only their bytes.
void read_elements(const std::filesystem::path& file, const Header& header, const std::string& name,
                   int64_t first, at::Tensor& out);

}  // namespace safetensors

}  // namespace cohort

// ZeRO checkpoints: the optimizer state as shards that reload at any world size and stage, and
// moved between ZeRO and the whole optimizers of DDP (torch::optim's or cohort's flat ones). One
// loader (zero_checkpoint.cpp) reads state by parameter name from shards or optimizer.pt files,
// also a split model's parts (train::load_optimizer_parts).
#pragma once
#include <filesystem>
#include <string>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "cohort/optim/state_dict.h"
#include "train/state_files.h"

namespace cohort::train::detail {

// The one param group of a whole optimizer: each of its parameters' names in `module`; a
// UsageError starting with `who` where it has more groups or a parameter that is not the model's.
std::vector<std::string> parameter_names(const torch::optim::Optimizer& optimizer,
                                         const torch::nn::Module& module, const char* who);

// The manifest of a checkpoint's optimizer shards (optim::kOptimizerShardsPart).
inline constexpr const char* kZeroManifest = "zero_manifest.json";

// The file of a folder's whole optimizer state (a torch::optim archive, e.g. DDP's): optimizer.pt,
// else a first-format local SGD checkpoint's first rank's inner state (its replicas agree at the
// checkpoints of `cohort train`, which synchronises first; any one serves every rank of a
// synchronous run, which must step alike). optimizer.pt when the folder holds neither (the
// caller names it).
std::filesystem::path whole_optimizer_file(const std::filesystem::path& dir);

// The sharded optimizer state of `dir` (optim::kOptimizerShardsPart) into `optimizer`: a
// ZeroOptimizer at any stage and world size (for each piece of this rank's shard only the
// overlapping ranges of the files are read), or the optimizer of a DDP model (torch::optim's or a
// flat SGD, Adam or AdamW over `module`'s parameters: every parameter's state read whole).
void load_zero_shards(torch::optim::Optimizer& optimizer, const torch::nn::Module& module,
                      const std::filesystem::path& dir);
// The state of the optimizer of a DDP model (as load_zero_shards takes it) into `dir` as the one
// shard of part optim::kOptimizerShardsPart: written and read back as fast as a copy, where the
// archive optimizer.pt is a pickle; load_zero_shards reads it into any optimizer. False, and
// nothing written, for an optimizer whose state has no such form (not SGD, Adam or AdamW).
bool save_optimizer_as_shards(const std::filesystem::path& dir,
                              const torch::optim::Optimizer& optimizer,
                              const torch::nn::Module& module);
// Local SGD's replicas (optim::kReplicasPart) in `dir` into `optimizer`: local SGD's own at any
// world size (optim::Stateful::state_to_load says which ranks' pieces), or any other optimizer
// (a whole one over `module`'s parameters, ZeRO, the parameter server) the first rank's inner
// optimizer state by name.
void load_replicas(torch::optim::Optimizer& optimizer, const torch::nn::Module& module,
                   const std::filesystem::path& dir);
// Whether `dir` is a local SGD checkpoint of the first format (local_sgd.json).
bool is_legacy_local_sgd_checkpoint(const std::filesystem::path& dir);
// Its state into `optimizer`, which holds replicas (optim::ShardedState::holds_replicas), as the
// current format loads; UsageError naming a missing or altered file.
void load_legacy_local_sgd(torch::optim::Optimizer& optimizer, const torch::nn::Module& module,
                           const std::filesystem::path& dir);
// Whether `dir` is a parameter-server checkpoint of the first format (parameter_server.json):
// each server's flat range in its own files.
bool is_legacy_parameter_server_checkpoint(const std::filesystem::path& dir);
// Its optimizer state into `optimizer` (the parameter server at any number of servers, ZeRO, or
// a whole optimizer over `module`'s parameters): every parameter's state by name, as the shards
// of the current format load.
void load_legacy_parameter_server(torch::optim::Optimizer& optimizer,
                                  const torch::nn::Module& module,
                                  const std::filesystem::path& dir);
// A DDP checkpoint's optimizer.pt (written by torch::optim's or a flat optimizer of the same
// algorithm over `module`'s parameters) into an optimizer that is a part with state itself
// (optim::Stateful: ZeRO's shard of it).
void load_optimizer_file_into_part(torch::optim::Optimizer& optimizer,
                                   const torch::nn::Module& module,
                                   const std::filesystem::path& file);

// ZeRO stage 3 (parameters in shards, optim::ShardedState::sharded_units): the module's parameters
// and buffers as one safetensors file (save_model's), written by rank 0 while the group gathers one
// unit at a time: no rank holds more than the largest unit beyond its shards. Every rank of the
// group calls it.
void save_model_by_unit(const optim::ShardedState& sharded, const torch::nn::Module& module,
                        const std::filesystem::path& file);
// Its inverse (load_model's checks and errors), with no collective: every rank reads only its
// shards' ranges of the units' parameters (ShardedState::parameter_shards) and the other tensors
// whole. A module that names the parameters otherwise than the engine (a parent of its module)
// gathers them whole instead, every rank of the group then.
void load_model_shards(const optim::ShardedState& sharded, torch::nn::Module& module,
                       const std::filesystem::path& file);

// ZeRO stage 3 without a collective (a live regroup's state, whose group is broken): the module
// as the part kModelPiecesPart of this rank's pieces, `shard` of `shards` (its ZeRO state's):
// its shards' ranges of the units' parameters (ShardedState::parameter_shards) and the other
// tensors whole. The manifest names this rank's file only (the state of one rank, taken whole by
// a rank that holds the same shards).
inline constexpr const char* kModelPiecesPart = "model_pieces";
void save_model_pieces(const std::filesystem::path& dir, const optim::ShardedState& sharded,
                       const torch::nn::Module& module, int shard, int shards);
// Its inverse: each parameter's range this rank holds (or the whole tensor) from the part's
// pieces; a UsageError naming the tensor where they do not cover it (the pieces of another
// shard).
void load_model_pieces(const optim::ShardedState& sharded, torch::nn::Module& module,
                       const std::filesystem::path& dir);

}  // namespace cohort::train::detail

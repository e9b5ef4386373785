/// \file
/// Which units of a model checkpoint their activations (`--activation-checkpointing`), without
/// libtorch (DeepSpeed JSON, plans and their fuzz targets read it); activation_checkpointing.h
/// applies it to a model.
#pragma once
#include <string>
#include <vector>

namespace cohort::parallel {

/// Which units of a model checkpoint their activations (`--activation-checkpointing`). The
/// units are the model's parallel::FullyShard layers, in the order of named_modules(): the zoo's
/// mlp and cnn each linear and convolution layer, resnet18 its stem, 8 blocks and head, vit its
/// encoder blocks.
struct ActivationCheckpointing {
  /// Every `every`-th unit (the every-th, 2 x every-th, ...: torchtitan's selective
  /// checkpointing); 1: all of them but, outside a pipeline, the last, which backward recomputes
  /// right after the forward (parallel::UnitChoiceOptions); 0: none unless `layers` names some.
  int every = 0;
  /// Units by name ("layers.3", or "layers" for every unit under it) or by the type of the module
  /// they wrap ("BasicBlock", "EncoderBlock", "Linear").
  std::vector<std::string> layers;

  /// Whether any unit is checkpointed.
  bool enabled() const { return every > 0 || !layers.empty(); }
  /// A UsageError naming the flag and the fix: every < 0, both set, an empty name.
  void validate() const;
};

/// How a model's units run, which decides whether every:K checkpoints the last of them.
struct UnitChoiceOptions {
  /// The units run as pipeline stages. Without a pipeline, backward begins with the model's last
  /// unit right after the forward ends: checkpointed, it would be recomputed at once for no
  /// memory saved (its activations are live at that moment either way), so every:K leaves it
  /// plain, as PyTorch's checkpoint_sequential leaves its last segment. A pipeline stage may hold
  /// its last unit for other micro-batches' steps first (GPipe runs every forward before any
  /// backward), so there every:K checkpoints all the units it counts. layers:NAMES is taken as
  /// written either way.
  bool pipeline = false;
};

/// Parses `--activation-checkpointing`: "none", "every:K" (K >= 1) or "layers:NAME[,NAME...]".
/// A UsageError of one line naming the text and the forms otherwise.
ActivationCheckpointing parse_activation_checkpointing(const std::string& text);

/// The flag's text of `policy` ("none", "every:2", "layers:blocks.0,blocks.1").
std::string to_string(const ActivationCheckpointing& policy);

}  // namespace cohort::parallel

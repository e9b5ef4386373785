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
  /// checkpointing); 1: all of them; 0: none unless `layers` names some.
  int every = 0;
  /// Units by name ("layers.3", or "layers" for every unit under it) or by the type of the module
  /// they wrap ("BasicBlock", "EncoderBlock", "Linear").
  std::vector<std::string> layers;

  /// Whether any unit is checkpointed.
  bool enabled() const { return every > 0 || !layers.empty(); }
  /// A UsageError naming the flag and the fix: every < 0, both set, an empty name.
  void validate() const;
};

/// Parses `--activation-checkpointing`: "none", "every:K" (K >= 1) or "layers:NAME[,NAME...]".
/// A UsageError of one line naming the text and the forms otherwise.
ActivationCheckpointing parse_activation_checkpointing(const std::string& text);

/// The flag's text of `policy` ("none", "every:2", "layers:blocks.0,blocks.1").
std::string to_string(const ActivationCheckpointing& policy);

}  // namespace cohort::parallel

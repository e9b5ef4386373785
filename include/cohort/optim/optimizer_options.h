/// \file
/// The optimizer a run steps with, as options (flags, a config file, DeepSpeed JSON and a Tune
/// trial all set them), without libtorch; optim::make_optimizer (<cohort/optim/flat_optimizer.h>)
/// builds it over a model's parameters:
///
///   cohort::optim::OptimizerOptions options{.algorithm = "adamw", .lr = 3e-4};
///   auto model = cohort::train::parallelize(spec, [&](auto params) {
///     return cohort::optim::make_optimizer(options, params); }, loss, plan);
///
/// cli::add_optimizer_options gives a program the flags (--optimizer, --lr, --momentum,
/// --weight-decay, --flat-optimizer) with one call.
#pragma once
#include <optional>
#include <string>
#include <utility>

#include "cohort/json.h"

namespace cohort::optim {

/// An optimizer's algorithm and hyperparameters.
struct OptimizerOptions {
  std::string algorithm = "sgd";  ///< "sgd" (with momentum), "adam" or "adamw"
  double lr = 0;                  ///< the learning rate; 0: the algorithm's (learning_rate())
  double momentum = 0.9;          ///< SGD's momentum
  bool nesterov = false;          ///< SGD's Nesterov momentum (needs momentum > 0)
  /// Unset: the algorithm's (weight_decay_or_default()): 0, and 0.01 for adamw (decoupled).
  std::optional<double> weight_decay;
  std::optional<std::pair<double, double>> betas;  ///< Adam's and AdamW's; unset: libtorch's
  std::optional<double> eps;                       ///< Adam's and AdamW's; unset: libtorch's
  /// cohort's flat optimizers (parameters, gradients and state in contiguous buffers; what ZeRO,
  /// offload and captured steps need), else libtorch's torch::optim.
  bool flat = true;

  /// The learning rate used: lr, or 0.02 for sgd and 0.001 for adam and adamw.
  double learning_rate() const;
  /// The weight decay used: weight_decay, or 0 (0.01 for adamw).
  double weight_decay_or_default() const;
  /// How many state buffers of the parameters' size the algorithm keeps: Adam's two moments,
  /// SGD's momentum buffer (none without momentum).
  int state_buffers() const;
  /// UsageError naming an unknown algorithm, a negative learning rate or hyperparameters the
  /// algorithm has none of (betas or eps for sgd, Nesterov for adam); make_optimizer checks the
  /// values' ranges (optim::validate).
  void check() const;
};

/// The options as flat JSON keys, those a Tune search space and a Trainer's train_loop_config use:
/// "optimizer", "lr" (the learning rate used), "momentum", "sgd_nesterov", "weight_decay" (the
/// one used), "betas", "eps", "flat_optimizer".
void to_json(Json& json, const OptimizerOptions& options);
/// OptimizerOptions from JSON (see to_json); a missing key keeps its default, a value of the
/// wrong type is a UsageError naming it.
void from_json(const Json& json, OptimizerOptions& options);

}  // namespace cohort::optim

#include "cohort/optim/optimizer_options.h"

#include "cohort/error.h"

namespace cohort::optim {

double OptimizerOptions::learning_rate() const {
  if (lr > 0) return lr;
  return algorithm == "adam" || algorithm == "adamw" ? 1e-3 : 0.02;
}

double OptimizerOptions::weight_decay_or_default() const {
  return weight_decay.value_or(algorithm == "adamw" ? 0.01 : 0.0);
}

int OptimizerOptions::state_buffers() const {
  return algorithm == "sgd" ? (momentum > 0 ? 1 : 0) : 2;
}

void OptimizerOptions::check() const {
  if (algorithm != "sgd" && algorithm != "adam" && algorithm != "adamw")
    throw UsageError("unknown optimizer '" + algorithm +
                     "' (--optimizer, OptimizerOptions::algorithm): choose sgd, adam or adamw");
  if (!(lr >= 0)) {
    throw UsageError("the learning rate (--lr) " + format_number(lr) +
                     " is negative: give one > 0 (0: the optimizer's default)");
  }
  if (algorithm == "sgd" && (betas || eps)) {
    throw UsageError(
        "betas and eps are Adam's and AdamW's hyperparameters: sgd has none (choose adam or "
        "adamw, or drop them)");
  }
  if (algorithm != "sgd" && nesterov)
    throw UsageError("Nesterov momentum is SGD's: " + algorithm + " has none (choose sgd)");
}

void to_json(Json& j, const OptimizerOptions& o) {
  j = Json{{"optimizer", o.algorithm},
           {"lr", o.learning_rate()},
           {"momentum", o.momentum},
           {"sgd_nesterov", o.nesterov},
           {"weight_decay", o.weight_decay_or_default()},
           {"flat_optimizer", o.flat}};
  if (o.betas) j["betas"] = {o.betas->first, o.betas->second};
  if (o.eps) j["eps"] = *o.eps;
}

void from_json(const Json& j, OptimizerOptions& o) {
  const OptimizerOptions d;
  o.algorithm = json_field(j, "optimizer", d.algorithm);
  o.lr = json_field(j, "lr", d.lr);
  o.momentum = json_field(j, "momentum", d.momentum);
  o.nesterov = json_field(j, "sgd_nesterov", d.nesterov);
  if (j.contains("weight_decay")) o.weight_decay = json_field(j, "weight_decay", 0.0);
  o.flat = json_field(j, "flat_optimizer", d.flat);
  if (const auto betas = j.find("betas"); betas != j.end() && !betas->is_null()) {
    if (!betas->is_array() || betas->size() != 2 || !(*betas)[0].is_number() ||
        !(*betas)[1].is_number()) {
      throw UsageError("field 'betas' is " + betas->dump().substr(0, 40) + ", not two numbers");
    }
    o.betas = std::make_pair((*betas)[0].get<double>(), (*betas)[1].get<double>());
  }
  if (j.contains("eps") && !j["eps"].is_null()) o.eps = json_field(j, "eps", 0.0);
}

}  // namespace cohort::optim

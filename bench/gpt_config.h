// The zoo GPT's sizes as the GPT benches pass them to their workers: the config's "layers",
// "width", "heads" and "context".
#pragma once
#include "cohort/json.h"
#include "cohort/models/zoo.h"

namespace cohort::bench {

inline models::ModelOptions gpt_options(const Json& config) {
  models::ModelOptions options;
  options.depth = config["layers"];
  options.width = config["width"];
  options.heads = config["heads"];
  options.context = config["context"];
  return options;
}

}  // namespace cohort::bench

// A boolean flag whose default is in its help and in the effective options (a run's
// config.json): what every add_*_options of the library adds its switches with.
#pragma once
#include <string>

#include <CLI/CLI.hpp>

namespace cohort::cli {

inline CLI::Option* add_bool_flag(CLI::App* cmd, const std::string& names, bool& value,
                                  const std::string& help) {
  return cmd->add_flag(names, value, help)->default_str(value ? "true" : "false");
}

}  // namespace cohort::cli

/// \file
/// `--config FILE` for a program's command line: every option of a command from a JSON or TOML
/// file, the command line overriding it; and the effective options of a run, as a JSON file the
/// same flag reads back (what `cohort train --config <run>/config.json` resumes from):
///
///   std::string config;
///   cohort::cli::add_config_option(&app, config);
///   CLI11_PARSE(app, argc, argv);
///   cohort::cli::apply_config_file(&app, config);   // UsageError naming the file and the key
///   run.extra_files[cohort::cli::kConfigFile] = cohort::cli::effective_options(&app).dump(2);
///
/// Needs CLI11 (Debian's libcli11-dev), as <cohort/cli/plan_options.h>.
#pragma once

#include <string>

#include <CLI/CLI.hpp>

#include "cohort/json.h"

namespace cohort::cli {

/// Where a run directory keeps the effective options of the command that started it.
inline constexpr const char* kConfigFile = "config.json";

/// Adds --config FILE to `cmd`, storing the path in `file`.
void add_config_option(CLI::App* cmd, std::string& file);

/// After parsing: sets every option of `cmd` that the command line did not give from `file`
/// (nothing when `file` is empty). Keys are option names without the dashes ("batch-size" or
/// "batch_size"); values are numbers, strings, booleans (flags: "resume": false) or, for
/// repeatable options, lists. A file that cannot be read or parsed, an unknown key or a value of
/// the wrong type or text that is not UTF-8 is a UsageError naming the file and the key.
void apply_config_file(CLI::App* cmd, const std::string& file);

/// Every option of `cmd` that has a value (given, from the file, or a default), by name: numbers,
/// strings, booleans and lists, as apply_config_file reads them. Options left unset (whose
/// default depends on others, such as cohort train's --lr) are left out. A value that is not
/// UTF-8 text (which JSON cannot hold) is a UsageError naming the option.
Json effective_options(const CLI::App* cmd);

}  // namespace cohort::cli

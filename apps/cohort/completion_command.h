// `cohort completion bash`: a bash completion script for the subcommands and their flags, made
// from the command line's own definition, so that it never lags behind it.
#pragma once
#include <string>

#include <CLI/CLI.hpp>

namespace cohort::cli {

CLI::App* add_completion_command(CLI::App& app, std::string& shell);
// Prints the script for `shell` (bash) of every subcommand of `app`; UsageError for another shell.
int run_completion_command(const CLI::App& app, const std::string& shell);

}  // namespace cohort::cli

#include "completion_command.h"

#include <iostream>
#include <string>

#include "cohort/error.h"

namespace cohort::cli {
namespace {

// The long flags of `cmd`, --help included, space-separated ("--help --model ...").
std::string flags_of(const CLI::App& cmd) {
  std::string flags;
  for (const auto* option : cmd.get_options()) {
    for (const auto& name : option->get_lnames()) flags += (flags.empty() ? "--" : " --") + name;
  }
  return flags;
}

}  // namespace

CLI::App* add_completion_command(CLI::App& app, std::string& shell) {
  auto* cmd = app.add_subcommand(
      "completion",
      "Print a shell completion script: `source <(cohort completion bash)`, or save it as "
      "/etc/bash_completion.d/cohort");
  cmd->add_option("shell", shell, "bash")->required();
  return cmd;
}

int run_completion_command(const CLI::App& app, const std::string& shell) {
  if (shell != "bash") {
    throw UsageError("completion for '" + shell + "' is not built: use `cohort completion bash`");
  }
  std::string names, cases;
  for (const auto* sub : app.get_subcommands({})) {
    names += (names.empty() ? "" : " ") + sub->get_name();
    cases += "    " + sub->get_name() + ") flags=\"" + flags_of(*sub) + "\" ;;\n";
  }
  std::cout << "# bash completion for cohort: source <(cohort completion bash)\n"
               "_cohort() {\n"
               "  local cur=\"${COMP_WORDS[COMP_CWORD]}\" sub=\"\" flags i\n"
               "  for ((i = 1; i < COMP_CWORD; i++)); do\n"
               "    case \" "
            << names
            << " \" in *\" ${COMP_WORDS[i]} \"*) sub=\"${COMP_WORDS[i]}\"; break ;; esac\n"
               "  done\n"
               "  if [[ -z \"$sub\" ]]; then\n"
               "    COMPREPLY=($(compgen -W \""
            << names
            << " --help\" -- \"$cur\"))\n"
               "    return\n"
               "  fi\n"
               "  case \"$sub\" in\n"
            << cases
            << "  esac\n"
               "  if [[ \"$cur\" == -* ]]; then\n"
               "    COMPREPLY=($(compgen -W \"$flags\" -- \"$cur\"))\n"
               "  else\n"
               "    COMPREPLY=($(compgen -f -- \"$cur\"))\n"
               "  fi\n"
               "}\n"
               "complete -o filenames -F _cohort cohort\n";
  return 0;
}

}  // namespace cohort::cli

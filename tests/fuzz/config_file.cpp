// Fuzz target: a program's --config file (cli::apply_config_file), JSON or TOML, read into a
// command with every kind of option a program has (integers, a bounded one, a real number,
// strings, a flag with its negation, a list). A file may be refused with a UsageError naming it;
// nothing else may escape, and a file that is taken gives effective options (a run's
// config.json) that read back into a fresh command as the same values.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "cohort/cli/config_file.h"
#include "cohort/error.h"
#include "cohort/json.h"
#include "memory_file.h"

namespace {

// The options of a program as its main() would add them.
struct Program {
  CLI::App app{"fuzzed", "fuzzed"};
  int workers = 2;
  int64_t steps = 0;
  int stage = 0;
  double lr = 0.1;
  std::string name = "run";
  std::string mode;
  bool resume = true;
  std::vector<std::string> tags;
  std::string config;

  Program() {
    app.add_option("--workers", workers)->capture_default_str();
    app.add_option("--max-steps", steps)->capture_default_str();
    app.add_option("--zero-stage", stage)->check(CLI::Range(0, 3))->capture_default_str();
    app.add_option("--lr", lr)->capture_default_str();
    app.add_option("--name", name)->capture_default_str();
    app.add_option("--mode", mode);
    app.add_flag("--resume,!--no-resume", resume)->default_str("true");
    app.add_option("--tag", tags);
    cohort::cli::add_config_option(&app, config);
  }

  // The values the program sees (a NaN learning rate equals a NaN).
  bool same_values(const Program& o) const {
    const bool same_lr = lr == o.lr || (std::isnan(lr) && std::isnan(o.lr));
    return workers == o.workers && steps == o.steps && stage == o.stage && same_lr &&
           name == o.name && mode == o.mode && resume == o.resume && tags == o.tags;
  }

  // Parses no arguments, then `file` (false: refused).
  bool read(const std::string& file) {
    std::vector<std::string> none;
    app.parse(none);
    try {
      cohort::cli::apply_config_file(&app, file);
    } catch (const cohort::UsageError&) {
      return false;
    }
    return true;
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const cohort::fuzz::MemoryFile input(std::string(reinterpret_cast<const char*>(data), size));
  Program first;
  if (!first.read(input.path())) return 0;
  if (first.stage < 0 || first.stage > 3) std::abort();  // CLI::Range held
  const cohort::Json effective = cohort::cli::effective_options(&first.app);
  const cohort::fuzz::MemoryFile saved(effective.dump(2));
  Program again;
  if (!again.read(saved.path())) std::abort();  // a run's own config.json is refused
  if (!again.same_values(first)) std::abort();
  return 0;
}

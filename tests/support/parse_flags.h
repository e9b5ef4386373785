// Parses `args` (without the program's name) with `app`, as a program's main does with its argv:
// what the tests of the library's add_*_options helpers call.
#pragma once
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace cohort::testing {

inline void parse_flags(CLI::App& app, std::vector<std::string> args) {
  args.insert(args.begin(), "program");
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  app.parse(static_cast<int>(argv.size()), argv.data());
}

}  // namespace cohort::testing

// Measurements that must start from a fresh process (a probe after other work in the same
// process finds less: its heap has already grown): this bench again, with `arguments`, printing
// one JSON object on its standard output, which is returned (`arguments` as the shell reads them).
#pragma once
#include <cstdio>
#include <filesystem>
#include <stdexcept>
#include <string>

#include "cohort/json.h"

namespace cohort::bench {

inline Json json_of_fresh_process(const std::string& arguments) {
  // The program's path quoted for the shell: it may hold spaces or quotes.
  std::string program = "'";
  for (const char c : std::filesystem::read_symlink("/proc/self/exe").string())
    program += c == '\'' ? std::string("'\\''") : std::string(1, c);
  const std::string command = program + "' " + arguments;
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) throw std::runtime_error("could not run " + command);
  std::string out;
  char buffer[4096];
  while (const size_t n = std::fread(buffer, 1, sizeof buffer, pipe)) out.append(buffer, n);
  if (::pclose(pipe) != 0) throw std::runtime_error(command + " failed: " + out);
  return Json::parse(out);
}

}  // namespace cohort::bench

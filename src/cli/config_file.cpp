#include "cohort/cli/config_file.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include "cohort/error.h"

namespace cohort::cli {

namespace {

constexpr const char* kConfigOption = "--config";

bool is_flag(const CLI::Option* option) { return option->get_expected_max() == 0; }

// Whether `text` is UTF-8, as JSON (a run's config.json) holds text.
bool is_utf8(const std::string& text) {
  try {
    (void)Json(text).dump();
  } catch (const Json::type_error&) {
    return false;
  }
  return true;
}

// The command as its user types it: "cohort train", or a program's own name.
std::string command_name(const CLI::App* cmd) {
  std::string name;
  for (const CLI::App* app = cmd; app != nullptr; app = app->get_parent()) {
    // A program's name is its path as it was started (argv[0]): its file name says it.
    const auto part = app->get_parent() == nullptr
                          ? std::filesystem::path(app->get_name()).filename().string()
                          : app->get_name();
    if (!part.empty()) name = part + (name.empty() ? "" : " " + name);
  }
  return name.empty() ? "this program" : name;
}

// The file's keys and values, as CLI11's config items (name, input strings).
std::vector<CLI::ConfigItem> read_items(const std::string& file) {
  std::ifstream in(file);
  if (!in) {
    throw UsageError("--config " + file +
                     ": cannot read the file; give the path of a JSON or TOML file");
  }
  std::stringstream text;
  text << in.rdbuf();
  const std::string content = text.str();
  const auto first = content.find_first_not_of(" \t\r\n");
  const bool json = std::filesystem::path(file).extension() == ".json" ||
                    (first != std::string::npos && content[first] == '{');
  std::vector<CLI::ConfigItem> items;
  if (!json) {
    std::istringstream toml(content);
    try {
      for (auto& item : CLI::ConfigTOML().from_config(toml)) {
        // CLI11 marks sections with "++" and "--" items; options live at the top.
        if (item.name == "++" || item.name == "--") continue;
        if (!item.parents.empty()) {
          throw UsageError("--config " + file + ": key '" + item.fullname() +
                           "' is in a section; give the options at the top of the file");
        }
        // TOML strings take any bytes; JSON's parser already refuses what is not UTF-8.
        for (const auto& input : item.inputs) {
          if (!is_utf8(input)) {
            throw UsageError("--config " + file + ": key '" + item.name +
                             "' has a value that is not UTF-8 text: write the file in UTF-8");
          }
        }
        items.push_back(std::move(item));
      }
    } catch (const CLI::Error& e) {
      throw UsageError("--config " + file + " is not valid TOML: " + e.what());
    }
    return items;
  }
  Json j;
  try {
    j = Json::parse(content);
  } catch (const Json::exception& e) {
    throw UsageError("--config " + file + " is not valid JSON: " + e.what());
  }
  if (!j.is_object())
    throw UsageError("--config " + file + ": the file must hold one JSON object of options");
  for (const auto& entry : j.items()) {
    const Json& value = entry.value();
    CLI::ConfigItem item;
    item.name = entry.key();
    const auto input = [&](const Json& v) -> std::string {
      if (v.is_string()) return v.get<std::string>();
      if (v.is_boolean() || v.is_number()) return v.dump();
      throw UsageError("--config " + file + ": key '" + item.name + "' has the value " + v.dump() +
                       ": give a number, a string, true/false or a list of them");
    };
    if (value.is_array()) {
      for (const auto& v : value) item.inputs.push_back(input(v));
    } else {
      item.inputs.push_back(input(value));
    }
    items.push_back(std::move(item));
  }
  return items;
}

}  // namespace

void add_config_option(CLI::App* cmd, std::string& file) {
  cmd->add_option(kConfigOption, file,
                  "read the options from a JSON or TOML file (keys as the flags without dashes, "
                  "e.g. {\"model\": \"vit\", \"batch-size\": 32}); the command line overrides "
                  "it; a run's config.json is such a file");
}

void apply_config_file(CLI::App* cmd, const std::string& file) {
  if (file.empty()) return;
  for (const auto& item : read_items(file)) {
    std::string name = item.name;
    std::replace(name.begin(), name.end(), '_', '-');
    CLI::Option* option = cmd->get_option_no_throw("--" + name);
    if (option == nullptr || name == "config" || name == "help") {
      const auto command = command_name(cmd);
      throw UsageError("--config " + file + ": unknown key '" + item.name +
                       "': it is no option of `" + command + "` (see " + command + " --help)");
    }
    if (option->count() > 0) continue;  // the command line overrides the file
    try {
      if (is_flag(option)) {
        if (item.inputs.size() != 1) throw CLI::ConversionError(item.name, "one value");
        const std::string value = item.inputs.front();
        if (value != "true" && value != "false")
          throw CLI::ConversionError("--" + name + " = " + value, "");
        option->add_result(option->get_flag_value(name, value));
      } else {
        if (item.inputs.size() > 1 && option->get_items_expected_max() < 2) {
          throw CLI::ConversionError("--" + name, "one value, not a list");
        }
        option->add_result(item.inputs);
      }
      option->run_callback();
    } catch (const CLI::Error& e) {
      const std::string expected = is_flag(option) ? "true or false"
                                   : option->get_type_name().empty()
                                       ? "a value"
                                       : "a value of type " + option->get_type_name();
      throw UsageError("--config " + file + ": key '" + item.name +
                       "' = " + CLI::detail::join(item.inputs, ",") + " has the wrong type: give " +
                       expected + " (" + e.what() + ")");
    }
  }
}

Json effective_options(const CLI::App* cmd) {
  Json out = Json::object();
  for (const CLI::Option* option : cmd->get_options()) {
    if (option->get_lnames().empty()) continue;
    const std::string name = option->get_lnames().front();
    if (name == "help" || name == "config") continue;
    std::vector<std::string> values = option->results();
    for (const auto& value : values) {
      if (!is_utf8(value)) {
        throw UsageError("--" + name +
                         ": the value is not UTF-8 text, which a run's options file holds: give "
                         "it in UTF-8");
      }
    }
    if (option->count() == 0) {
      if (option->get_default_str().empty()) continue;
      values = {option->get_default_str()};
    }
    const auto typed = [&](const std::string& v) -> Json {
      if (is_flag(option)) return v == "true" || v == "1";
      const std::string type = option->get_type_name();
      if (type == "FLOAT" || type == "INT" || type == "UINT") {
        try {
          return Json::parse(v);
        } catch (const Json::exception&) {
        }
      }
      return v;
    };
    if (is_flag(option)) {
      out[name] = option->count() > 0 ? Json(option->as<bool>()) : typed(values.front());
    } else if (option->get_items_expected_max() > 1) {
      Json list = Json::array();
      for (const auto& v : values) list.push_back(typed(v));
      out[name] = list;
    } else if (!values.empty()) {
      out[name] = typed(values.back());
    }
  }
  return out;
}

}  // namespace cohort::cli

#include "cohort/cli/config_file.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "cohort/cli/plan_options.h"
#include "cohort/error.h"
#include "support/tiny_mnist.h"

namespace cohort {
namespace {

// A program of a user's own, as its main() builds it: the plan's flags, one of its own and
// --config.
struct Program {
  CLI::App app{"a trainer of the user's", "trainer"};
  cli::PlanOptions plan;
  int workers = 2;
  std::string config;

  Program() {
    cli::add_plan_options(&app, plan);
    app.add_option("--workers", workers)->capture_default_str();
    cli::add_config_option(&app, config);
  }

  // Parses `args` and then the file --config names.
  void parse(std::vector<std::string> args) {
    std::reverse(args.begin(), args.end());  // CLI11 takes them last first
    app.parse(args);
    cli::apply_config_file(&app, config);
  }
};

class ConfigFile : public ::testing::Test {
 protected:
  void TearDown() override { std::filesystem::remove_all(dir); }

  std::string write(const std::string& name, const std::string& text) {
    const auto path = dir / name;
    std::ofstream(path) << text;
    return path.string();
  }

  // The UsageError's message of parsing `args`; empty if none.
  std::string problem_of(const std::vector<std::string>& args) {
    try {
      Program().parse(args);
    } catch (const UsageError& e) {
      return e.what();
    }
    return "";
  }

  std::filesystem::path dir = cohort::testing::temp_dir("config_file");
};

// A program's own --config gives every option, the plan's and its own, from JSON or TOML; the
// command line wins; the effective options written out read back to the same program.
TEST_F(ConfigFile, GivesAProgramsOptionsAndTheCommandLineWins) {
  const auto json = write("run.json",
                          R"({"pp": 4, "zero-stage": 1, "workers": 8, "precision": "bf16",
                              "gradient_accumulation_steps": 3})");
  Program from_json;
  from_json.parse({"--config", json, "--pp", "2"});
  EXPECT_EQ(from_json.plan.pp, 2);
  EXPECT_EQ(from_json.plan.zero.stage, 1);
  EXPECT_EQ(from_json.workers, 8);
  EXPECT_EQ(from_json.plan.precision, "bf16");
  EXPECT_EQ(from_json.plan.gradient_accumulation_steps, 3);

  const auto toml = write("run.toml", "pp = 4\nzero-stage = 2\ncuda-graph = false\n");
  Program from_toml;
  from_toml.parse({"--config", toml});
  EXPECT_EQ(from_toml.plan.pp, 4);
  EXPECT_EQ(from_toml.plan.zero.stage, 2);
  EXPECT_EQ(from_toml.workers, 2);

  const auto saved = write(cli::kConfigFile, cli::effective_options(&from_json.app).dump(2));
  Program again;
  again.parse({"--config", saved});
  EXPECT_EQ(again.plan.pp, 2);
  EXPECT_EQ(again.plan.zero.stage, 1);
  EXPECT_EQ(again.workers, 8);
  EXPECT_EQ(again.plan.precision, "bf16");
  EXPECT_EQ(again.plan.gradient_accumulation_steps, 3);
}

// An unknown key names the program (not `cohort`), a wrong type names the key and the type, a
// file that cannot be read or parsed is named.
TEST_F(ConfigFile, BadFilesAreNamedWithTheProgramsCommand) {
  EXPECT_EQ(problem_of({"--config", write("unknown.json", R"({"ppp": 2})")}),
            "--config " + (dir / "unknown.json").string() +
                ": unknown key 'ppp': it is no option of `trainer` (see trainer --help)");
  EXPECT_NE(problem_of({"--config", write("type.json", R"({"workers": "many"})")})
                .find("key 'workers' = many has the wrong type: give a value of type INT"),
            std::string::npos);
  EXPECT_NE(problem_of({"--config", write("broken.json", "{\"pp\": ")}).find("is not valid JSON"),
            std::string::npos);
  EXPECT_NE(problem_of({"--config", (dir / "missing.toml").string()}).find("cannot read the file"),
            std::string::npos);
  // TOML takes any bytes in a string; a run's config.json (JSON) holds only UTF-8 text. The
  // fuzzer's first find: this ended `cohort train` with a JSON library's type error.
  EXPECT_EQ(problem_of({"--config", write("latin1.toml", "pp = 2\nprecision = \"bf\xff\"\n")}),
            "--config " + (dir / "latin1.toml").string() +
                ": key 'precision' has a value that is not UTF-8 text: write the file in UTF-8");
  Program given;
  given.parse({"--precision", "bf\xff"});
  try {
    cli::effective_options(&given.app);
    ADD_FAILURE() << "a value that is not UTF-8 was written out";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("--precision: the value is not UTF-8 text"),
              std::string::npos)
        << e.what();
  }
}

// A DeepSpeed JSON config puts its plan into a program's plan options and gives back the rest
// (the batch size, the optimizer) for the program's own options; an activation-checkpointing
// choice of the flags stays.
TEST_F(ConfigFile, ADeepSpeedConfigSetsThePlanOptions) {
  const auto file = write("ds.json", R"({
      "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2,
      "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
      "bf16": {"enabled": true}, "gradient_clipping": 1.0,
      "zero_optimization": {"stage": 2, "reduce_bucket_size": 5000},
      "activation_checkpointing": {}})");
  cli::PlanOptions options;
  const auto ds = cli::load_deepspeed_config(file, 2, options);
  EXPECT_EQ(options.zero.stage, 2);
  EXPECT_EQ(options.zero.reduce_bucket_size, 5000);
  EXPECT_EQ(options.precision, "bf16");
  EXPECT_EQ(options.gradient_clipping, 1.0);
  EXPECT_EQ(options.gradient_accumulation_steps, 2);
  EXPECT_EQ(options.activation_checkpointing, "every:1");
  EXPECT_EQ(options.plan(2).zero.stage, 2);
  EXPECT_EQ(ds.micro_batch_size, 8);
  EXPECT_EQ(ds.optimizer, "adamw");
  EXPECT_EQ(ds.lr, 0.001);

  cli::PlanOptions chosen{.activation_checkpointing = "every:2"};
  cli::load_deepspeed_config(file, 2, chosen);
  EXPECT_EQ(chosen.activation_checkpointing, "every:2");

  // With a program's optimizer options: the file's optimizer section, the rest kept.
  optim::OptimizerOptions optimizer{.momentum = 0.5, .flat = false};
  cli::PlanOptions with_optimizer;
  cli::load_deepspeed_config(write("sgd.json", R"({"train_micro_batch_size_per_gpu": 8,
          "optimizer": {"type": "SGD", "params": {"lr": 0.05, "nesterov": true}}})"),
                             2, with_optimizer, optimizer);
  EXPECT_EQ(optimizer.algorithm, "sgd");
  EXPECT_EQ(optimizer.lr, 0.05);
  EXPECT_TRUE(optimizer.nesterov);
  EXPECT_EQ(optimizer.momentum, 0.5);
  EXPECT_FALSE(optimizer.flat);

  cli::PlanOptions untouched;
  try {
    cli::load_deepspeed_config(write("bad.json", R"({"train_micro_batch_size_per_gpu": 8,
                                                     "zero_optimization": {"stage": 7}})"),
                               2, untouched);
    ADD_FAILURE() << "a ZeRO stage of 7 was taken";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("zero_optimization.stage"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace cohort

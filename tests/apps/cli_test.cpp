// The cohort command line, run as a user runs it.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <optional>
#include <set>
#include <sstream>
#include <thread>
#include <tuple>

#include "cohort/comm/store.h"
#include "cohort/data/idx.h"
#include "cohort/json.h"
#include "cohort/models/zoo.h"
#include "cohort/runtime/blas.h"
#include "cohort/train/checkpoint.h"
#include "cohort/version.h"
#include "support/cuda.h"
#include "support/reference_blas.h"
#include "support/subprocess.h"
#include "support/tiny_mnist.h"

namespace cohort {
namespace {

using cohort::testing::cli_path;
using cohort::testing::CommandResult;
using cohort::testing::run_command;

class Cli : public ::testing::Test {
 protected:
  std::filesystem::path dir = cohort::testing::temp_dir("cli");
  std::filesystem::path data = cohort::testing::write_tiny_mnist(dir / "data", 512, 128);
  void TearDown() override { std::filesystem::remove_all(dir); }

  CommandResult train(std::vector<std::string> args,
                      std::chrono::seconds deadline = std::chrono::seconds(120)) {
    std::vector<std::string> argv{cli_path(), "train", "--storage-path", (dir / "runs").string()};
    argv.insert(argv.end(), args.begin(), args.end());
    return run_command(argv, deadline);
  }
  // Starts a run that would train for ages; returns once it trains, with its workers' pids.
  std::vector<int> wait_until_training(cohort::testing::Process& driver) {
    auto started = driver.wait_for_line("started 2 worker(s) [pids ", std::chrono::seconds(60));
    EXPECT_TRUE(started) << driver.output();
    std::vector<int> pids;
    if (!started) return pids;
    std::istringstream in(started->substr(started->find("[pids ") + 6));
    for (int pid; in >> pid;) pids.push_back(pid);
    EXPECT_EQ(pids.size(), 2u);
    EXPECT_TRUE(driver.wait_for_line("first training step", std::chrono::seconds(60)))
        << driver.output();
    return pids;
  }
  std::vector<std::string> endless_run(const std::string& name) {
    return {cli_path(),     "train",       "--storage-path", (dir / "runs").string(),
            "--data-dir",   data.string(), "--epochs",       "100000",
            "--batch-size", "8",           "--name",         name};
  }
  // A short run of 2 workers on the tiny data set (32 steps an epoch) with `optimizer`, then
  // `extra`.
  std::vector<std::string> small_run(const std::string& optimizer,
                                     const std::vector<std::string>& extra) const {
    std::vector<std::string> args{"--data-dir",   data.string(), "--workers",   "2",
                                  "--batch-size", "8",           "--optimizer", optimizer,
                                  "--seed",       "4",           "--quiet"};
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  }
  // `cohort train` of run `name`: 2 workers on the tiny data set with Adam, then `extra`.
  std::vector<std::string> named_run(const std::string& name,
                                     const std::vector<std::string>& extra) const {
    std::vector<std::string> argv{cli_path(),  "train", "--storage-path", (dir / "runs").string(),
                                  "--name",    name,    "--data-dir",     data.string(),
                                  "--workers", "2",     "--optimizer",    "adam"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return argv;
  }
  Json result_of(const std::string& name) {
    return Json::parse(cohort::testing::read_text((dir / "runs" / name / "result.json").string()));
  }
  // A run that ended well and resumed from a checkpoint.
  static ::testing::AssertionResult resumed(const CommandResult& run) {
    if (run.exit_code != 0 || run.output.find("resuming from") == std::string::npos)
      return ::testing::AssertionFailure() << "exit code " << run.exit_code << ":\n" << run.output;
    return ::testing::AssertionSuccess();
  }
  // Each of `files` is in `folder`.
  static void expect_files(const std::filesystem::path& folder,
                           const std::vector<std::string>& files) {
    for (const auto& file : files)
      EXPECT_TRUE(std::filesystem::exists(folder / file)) << (folder / file).string();
  }
  // A run stopped and resumed ends as the one never stopped: the same steps, train loss and test
  // accuracy, bit for bit.
  void expect_same_end(const std::string& resumed_run, const std::string& straight_run) {
    const Json resumed = result_of(resumed_run), straight = result_of(straight_run);
    EXPECT_EQ(resumed["steps"], straight["steps"]);
    EXPECT_EQ(resumed["train_loss"].get<double>(), straight["train_loss"].get<double>());
    EXPECT_EQ(resumed["test_accuracy"].get<double>(), straight["test_accuracy"].get<double>());
  }
};

// --cuda-graph on a GPU: each step one CUDA graph, the run as the eager one (the same steps; loss
// and accuracy within rounding) with no fallback.
TEST_F(Cli, ACudaGraphRunTrainsAsTheEagerOneDoes) {
  COHORT_REQUIRE_CUDA();
  auto run = [&](const std::string& name, std::vector<std::string> extra) {
    std::vector<std::string> args{"--data-dir", data.string(),  "--workers", "1",
                                  "--use-gpu",  "--batch-size", "16",        "--epochs",
                                  "2",          "--optimizer",  "adam",      "--seed",
                                  "4",          "--name",       name};
    args.insert(args.end(), extra.begin(), extra.end());
    return train(args);
  };
  const auto eager = run("eager", {});
  ASSERT_EQ(eager.exit_code, 0) << eager.output;
  const auto graph = run("graph", {"--cuda-graph"});
  ASSERT_EQ(graph.exit_code, 0) << graph.output;
  EXPECT_EQ(graph.output.find("runs eagerly"), std::string::npos) << graph.output;
  const Json e = result_of("eager"), g = result_of("graph");
  EXPECT_EQ(g["steps"], e["steps"]);
  EXPECT_NEAR(g["train_loss"].get<double>(), e["train_loss"].get<double>(),
              1e-3 * e["train_loss"].get<double>());
  EXPECT_NEAR(g["test_accuracy"].get<double>(), e["test_accuracy"].get<double>(), 0.02);
}

TEST_F(Cli, BadInputIsAOneLineUsageErrorWithExitCode2) {
  auto truncated = dir / "truncated";
  std::filesystem::copy(data, truncated);
  std::filesystem::remove(truncated / "train-images-idx3-ubyte.gz");
  auto images = torch::zeros({512, 28, 28}, torch::kUInt8);
  data::write_idx(truncated / "train-images-idx3-ubyte", images);
  std::filesystem::resize_file(truncated / "train-images-idx3-ubyte", 1000);

  std::vector<std::pair<std::vector<std::string>, std::string>> cases{
      {{"--model", "alexnet", "--data-dir", data.string()}, "unknown model 'alexnet'"},
      {{"--optimizer", "rmsprop", "--data-dir", data.string()},
       "unknown optimizer 'rmsprop' (--optimizer"},
      {{"--workers", "0", "--data-dir", data.string()}, "--workers 0 must be >= 1"},
      {{"--threads", "0", "--data-dir", data.string()}, "--threads 0 must be >= 1"},
      {{"--max-failures", "-2", "--data-dir", data.string()},
       "--max-failures -2 must be >= 0, or -1 for unlimited"},
      {{"--log-every-steps", "-1", "--data-dir", data.string()},
       "--log-every-steps -1 must be >= 0 (0: about every 15 seconds)"},
      {{"--workers", "2", "--min-workers", "3", "--data-dir", data.string()},
       "--min-workers 3 must be between 1 and --workers 2"},
      {{"--lr", "-0.1", "--data-dir", data.string()}, "is negative"},
      {{"--data-dir", (dir / "absent").string()}, "does not exist"},
      {{"--data-dir", truncated.string()}, "is truncated"},
      {{"--batch-size", "300", "--data-dir", data.string()}, "larger than a shard"},
      {{"--dataset", "cifar"}, "unknown --dataset 'cifar'"},
      {{"--epochs", "two"}, "--epochs"},
      {{"--bogus"}, "bogus"},
      {{"--backend", "mpi", "--data-dir", data.string()},
       "unknown communication backend 'mpi': use auto"},
      {{"--gpus-per-worker", "2", "--data-dir", data.string()},
       "--gpus-per-worker 2 needs --use-gpu"},
      {{"--precision", "fp8", "--data-dir", data.string()}, "unknown precision 'fp8'"},
      {{"--zero-stage", "2", "--shard-group-size", "3", "--workers", "2", "--data-dir",
        data.string()},
       "--shard-group-size 3 does not divide the 2 data-parallel workers"},
      {{"--activation-checkpointing", "every:0", "--data-dir", data.string()},
       "--activation-checkpointing 'every:0': K must be >= 1"},
      {{"--model", "resnet18", "--activation-checkpointing", "layers:block3", "--data-dir",
        data.string()},
       "--activation-checkpointing layers:block3: the model has no unit named or of type "
       "'block3'; its units: stem (Sequential), layers.0 (BasicBlock)"},
      {{"--cuda-graph", "--data-dir", data.string()},
       "--cuda-graph needs --use-gpu: CUDA graphs capture GPU work"},
      {{"--momentum", "1.5", "--data-dir", data.string()}, "SGD momentum 1.5 must be in [0, 1]"},
      {{"--optimizer", "adamw", "--weight-decay", "-0.5", "--data-dir", data.string()},
       "AdamW weight_decay -0.5 must be >= 0"},
      {{"--gradient-clipping", "-1", "--data-dir", data.string()}, "--gradient-clipping -1"},
      {{"--lr-decay", "exp", "--data-dir", data.string()}, "unknown --lr-decay 'exp'"},
      {{"--pp", "3", "--data-dir", data.string()},
       "--pp 3 --tp 1 makes groups of 3 workers, which does not divide --workers 2"},
      {{"--pp", "0", "--data-dir", data.string()}, "--pp 0 must be >= 1"},
      {{"--tp", "2", "--model", "mlp", "--data-dir", data.string()},
       "mlp has no tensor-parallel layers; use --model vit"},
      {{"--pp", "2", "--model", "mlp", "--schedule", "interleaved", "--data-dir", data.string()},
       "mlp has 3 layers, too few for 4 pipeline stages"},
      {{"--pp", "2", "--model", "resnet18", "--schedule", "interleaved", "--micro-batches", "3",
        "--data-dir", data.string()},
       "the interleaved schedule needs micro-batches a multiple of"},
      {{"--schedule", "pipedream", "--data-dir", data.string()},
       "unknown pipeline schedule 'pipedream'"},
      {{"--pp", "2", "--micro-batches", "16", "--batch-size", "8", "--data-dir", data.string()},
       "--batch-size 8 cannot be split into 16 micro-batches"},
      {{"--pp", "2", "--sync", "async-ps:1", "--data-dir", data.string()},
       "--sync async-ps:1 with --pp 2 --tp 1 is not supported yet: the parameter server serves "
       "whole models; use --sync ddp, local-sgd:H or diloco:H"},
      {{"--workers", "4", "--pp", "2", "--min-workers", "3", "--data-dir", data.string()},
       "--min-workers 3 with --pp 2 x --tp 1: an elastic group keeps whole replicas of 2 workers; "
       "use a multiple of 2"},
      {{"--warmup-steps", "-3", "--data-dir", data.string()}, "--warmup-steps -3 must be >= 0"},
      {{"--test-examples", "-5", "--data-dir", data.string()}, "--test-examples -5 must be >= 0"},
      {{"--sync", "local-sgd:0", "--data-dir", data.string()},
       "sync mode 'local-sgd:0': H 0 must be >= 1"},
      {{"--sync", "gossip", "--data-dir", data.string()},
       "unknown sync mode 'gossip': choose ddp, local-sgd:H, diloco:H (H: optimizer steps between "
       "synchronisations, >= 1) or async-ps:K"},
      {{"--sync", "async-ps:-1", "--data-dir", data.string()},
       "sync mode 'async-ps:-1': K -1 must be >= 0"},
      {{"--parameter-servers", "2", "--data-dir", data.string()},
       "--parameter-servers 2 with --sync ddp: parameter servers serve only --sync async-ps:K"},
      {{"--parameter-servers", "3", "--workers", "2", "--sync", "async-ps:1", "--data-dir",
        data.string()},
       "--parameter-servers 3 must be between 0 and --workers 2: the servers run in the worker "
       "processes, at most one per worker"},
      {{"--parameter-servers", "-1", "--sync", "async-ps:1", "--data-dir", data.string()},
       "--parameter-servers -1 must be between 0 and --workers 2"},
      {{"--sync", "async-ps:2", "--zero-stage", "1", "--data-dir", data.string()},
       "--sync async-ps:2 cannot be combined with ZeRO stage 1"},
      {{"--sync", "diloco:8", "--zero-stage", "2", "--data-dir", data.string()},
       "--sync diloco:8 cannot be combined with ZeRO stage 2"},
      {{"--outer-lr", "0.5", "--data-dir", data.string()},
       "use them with --sync diloco:H, not --sync ddp"},
      {{"--lr", "nan", "--data-dir", data.string()}, "--lr nan is not a finite number"},
      {{"--momentum", "inf", "--data-dir", data.string()}, "--momentum inf is not a finite number"},
      {{"--workers", "100000", "--data-dir", data.string()},
       "--workers 100000 is more than the 512 training examples"},
      {{"--profile-steps", "0-5", "--data-dir", data.string()},
       "--profile-steps '0-5': steps count from 1; give the steps to trace as A-B"},
      {{"--profile-steps", "9-3", "--data-dir", data.string()},
       "--profile-steps '9-3': the last step is before the first"},
      {{"--profile-steps", "ten", "--data-dir", data.string()},
       "--profile-steps 'ten': not a step range"},
      {{"--profile-steps", "40-45", "--max-steps", "30", "--data-dir", data.string()},
       "the run stops after --max-steps 30, before step 40"},
      {{"--umask", "0o77", "--data-dir", data.string()},
       "unknown --umask '0o77': give octal permission bits such as 077"},
      {{"--umask", "1777", "--data-dir", data.string()}, "unknown --umask '1777'"},
      {{"--checkpoint-every-steps", "0", "--data-dir", data.string()},
       "--checkpoint-every-steps 0 must be >= 1 (leave it out to checkpoint at each epoch's end "
       "only)"},
      {{"--checkpoint-every-steps", "-3", "--data-dir", data.string()},
       "--checkpoint-every-steps -3 must be >= 1"},
      {{"--checkpoint-when-busy", "skip", "--data-dir", data.string()},
       "--checkpoint-when-busy skip needs --async-checkpoint"},
      {{"--checkpoint-when-busy", "never", "--async-checkpoint", "--data-dir", data.string()},
       "unknown --checkpoint-when-busy 'never': choose wait or skip"},
      {{"--snapshot-every-steps", "0", "--data-dir", data.string()},
       "--snapshot-every-steps 0 must be >= 1 (leave it out to keep no in-memory snapshots)"},
      {{"--snapshot-every-steps", "-2", "--data-dir", data.string()},
       "--snapshot-every-steps -2 must be >= 1"},
      {{"--snapshot-every-steps", "5", "--snapshot-dir", "", "--data-dir", data.string()},
       "--snapshot-every-steps needs a --snapshot-dir"},
      {{"--recovery", "heal", "--data-dir", data.string()},
       "unknown --recovery 'heal': choose restart or live"},
      {{"--recovery", "live", "--zero-stage", "2", "--workers", "2", "--data-dir", data.string()},
       "live recovery (--recovery live) cannot go on without a lost worker of ZeRO stage 2"},
      {{"--recovery", "live", "--sync", "async-ps:0", "--workers", "2", "--data-dir",
        data.string()},
       "--recovery restart, with --snapshot-every-steps K"},
      {{"--recovery", "live", "--no-replace-lost", "--min-workers", "2", "--zero-stage", "2",
        "--shard-group-size", "2", "--workers", "4", "--data-dir", data.string()},
       "--recovery live --no-replace-lost with --shard-group-size 2: the survivors of a lost "
       "worker are no multiple of 2"},
      {{"--recovery", "live", "--no-replace-lost", "--workers", "3", "--data-dir", data.string()},
       "--recovery live with --no-replace-lost goes on with fewer workers: give --min-workers "
       "below --workers 3 (e.g. --min-workers 2)"},
  };
  if (!torch::cuda::is_available()) {
    cases.push_back({{"--use-gpu", "--data-dir", data.string()},
                     "use_gpu is set but this libtorch sees no CUDA device"});
    cases.push_back(
        {{"--precision", "fp16", "--data-dir", data.string()},
         "precision fp16 needs a GPU: autocast on cpu has no float16. Use bf16 instead"});
  } else {
    cases.push_back(
        {{"--use-gpu", "--workers", "64", "--batch-size", "4", "--data-dir", data.string()},
         "GPUs, but this node has"});
  }
  for (const auto& [args, fragment] : cases) {
    auto r = train(args, std::chrono::seconds(30));
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find(fragment), std::string::npos)
        << "expected '" << fragment << "' in: " << r.output;
    EXPECT_LE(std::count(r.output.begin(), r.output.end(), '\n'), 2) << r.output;
  }
  auto none = run_command({cli_path()}, std::chrono::seconds(30));
  EXPECT_EQ(none.exit_code, 2) << none.output;
}

// `cohort completion bash` completes the subcommands and each one's flags, as bash runs it.
TEST_F(Cli, CompletionScriptCompletesSubcommandsAndTheirFlags) {
  const auto script = run_command({cli_path(), "completion", "bash"});
  ASSERT_EQ(script.exit_code, 0) << script.output;
  const auto file = dir / "cohort.bash";
  std::ofstream(file) << script.output;
  auto complete = [&](const std::string& words, int current) {
    const auto r = run_command({"bash", "-c",
                                "source " + file.string() + "; COMP_WORDS=(" + words +
                                    "); COMP_CWORD=" + std::to_string(current) +
                                    "; _cohort; echo \"${COMPREPLY[*]}\""});
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return r.output;
  };
  EXPECT_EQ(complete("cohort tr", 1), "train\n");
  EXPECT_EQ(complete("cohort train --micro", 2), "--micro-batches\n");
  const auto sched = complete("cohort tune --model cnn --sched", 4);  // tune's and the pipeline's
  std::istringstream words(sched);
  const std::set<std::string> offered{std::istream_iterator<std::string>(words), {}};
  EXPECT_EQ(offered, (std::set<std::string>{"--scheduler", "--schedule"})) << sched;
  EXPECT_EQ(complete("cohort launch --nproc", 2), "--nproc-per-node\n");
  const auto zsh = run_command({cli_path(), "completion", "zsh"});
  EXPECT_EQ(zsh.exit_code, 2);
  EXPECT_NE(zsh.output.find("use `cohort completion bash`"), std::string::npos) << zsh.output;
}

TEST_F(Cli, LaunchRejectsBadOptionsAndNamesANodeThatNeverJoins) {
  const std::string cli = cli_path();
  for (const auto& [args, fragment] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--nnodes", "2", "--node-rank", "2", "--", "/bin/true"},
            "--node-rank 2 must be in [0, 2)"},
           {{"--master", "nohost", "--", "/bin/true"}, "must be HOST:PORT"},
           {{"--", "no-such-program-here"}, "is not in PATH"},
           {{"--nproc-per-node", "0", "--", "/bin/true"},
            "--nproc-per-node 0 is a CPU-only node: give it --data-workers N"},
           {{"--data-workers", "-1", "--", "/bin/true"},
            "--nproc-per-node and --data-workers must be >= 0"},
           {{"--nnodes", "2", "--", "/bin/true"},
            "a job of 2 nodes needs one secret on every node: set COHORT_JOB_SECRET (or "
            "COHORT_JOB_SECRET_FILE"},
           {{"--rdzv", "http://10.0.0.9:2379", "--", "/bin/true"},
            "--rdzv 'http://10.0.0.9:2379' is no etcd endpoint: give etcd://HOST:PORT"},
           {{"--rdzv", "etcd://10.0.0.9", "--", "/bin/true"},
            "--rdzv '10.0.0.9' must be HOST:PORT"},
           {{"--min-nodes", "1", "--", "/bin/true"}, "--min-nodes 1 needs --rdzv etcd://HOST:PORT"},
           {{"--rdzv", "etcd://127.0.0.1:2379", "--nnodes", "2", "--min-nodes", "3", "--",
             "/bin/true"},
            "--min-nodes 3 must be in [1, 2] (--nnodes)"}}) {
    std::vector<std::string> argv{cli, "launch"};
    argv.insert(argv.end(), args.begin(), args.end());
    auto r = run_command(argv, std::chrono::seconds(30));
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find(fragment), std::string::npos) << r.output;
  }
  // A job secret given badly: one line naming it and the fix, exit code 2, before any rendezvous.
  const auto wide = dir / "wide_secret";
  std::ofstream(wide) << "a secret that others can read\n";
  std::filesystem::permissions(wide, std::filesystem::perms::owner_read |
                                         std::filesystem::perms::owner_write |
                                         std::filesystem::perms::others_read);
  for (const auto& [env, args, fragment] : std::vector<
           std::tuple<std::map<std::string, std::string>, std::vector<std::string>, std::string>>{
           {{{"COHORT_JOB_SECRET", "short"}},
            {},
            "COHORT_JOB_SECRET holds a secret of 5 bytes; a job secret needs at least 16"},
           {{{"COHORT_JOB_SECRET", "a secret of this job"}},
            {"--insecure"},
            "--insecure with COHORT_JOB_SECRET or COHORT_JOB_SECRET_FILE set"},
           {{{"COHORT_JOB_SECRET_FILE", wide.string()}},
            {},
            "has mode 0604: others could read it; make it private with: chmod 600"}}) {
    std::vector<std::string> argv{cli, "launch"};
    argv.insert(argv.end(), args.begin(), args.end());
    argv.insert(argv.end(), {"--", "/bin/true"});
    auto r = run_command(argv, std::chrono::seconds(30), env);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find(fragment), std::string::npos) << r.output;
  }
  // Node 1 never comes: node 0 gives up at the rendezvous deadline, naming it.
  const int port = comm::Store::connect({.is_server = true}).port();  // free once the store is gone
  const auto start = std::chrono::steady_clock::now();
  auto r = run_command(
      {cli, "launch", "--nnodes", "2", "--node-rank", "0", "--master",
       "127.0.0.1:" + std::to_string(port), "--rdzv-timeout", "1", "--insecure", "--", "/bin/true"},
      std::chrono::seconds(60));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("nodes [1] of 2 did not join round 0"), std::string::npos) << r.output;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));

  // An etcd that does not answer: a bad --rdzv, named within the rendezvous deadline.
  const auto asked = std::chrono::steady_clock::now();
  r = run_command({cli, "launch", "--rdzv", "etcd://127.0.0.1:" + std::to_string(port),
                   "--rdzv-timeout", "2", "--insecure", "--", "/bin/true"},
                  std::chrono::seconds(60));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("cannot reach the rendezvous etcd at 127.0.0.1:" + std::to_string(port) +
                          " within 2000 ms"),
            std::string::npos)
      << r.output;
  EXPECT_LT(std::chrono::steady_clock::now() - asked, std::chrono::seconds(30));
}

TEST_F(Cli, ConfigFilesGiveEveryOptionTheCommandLineOverridesAndRunsSaveTheirOwn) {
  const auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir / name) << text;
    return (dir / name).string();
  };
  const std::string json =
      write("run.json", "{\"data_dir\": \"" + data.string() +
                            "\", \"model\": \"mlp\", \"workers\": 1, \"batch-size\": 32, "
                            "\"epochs\": 5, \"max-steps\": 3, \"quiet\": true}");
  // The command line wins over the file: 1 epoch, not 5.
  auto r = train({"--config", json, "--epochs", "1", "--name", "from_json"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto saved_path = dir / "runs" / "from_json" / "config.json";
  const Json saved = Json::parse(cohort::testing::read_text(saved_path.string()));
  EXPECT_EQ(saved["model"], "mlp");
  EXPECT_EQ(saved["workers"], 1);
  EXPECT_EQ(saved["batch-size"], 32);
  EXPECT_EQ(saved["epochs"], 1);
  EXPECT_EQ(saved["max-steps"], 3);
  EXPECT_EQ(saved["quiet"], true);
  EXPECT_EQ(saved["resume"], true);  // a default
  EXPECT_EQ(saved["name"], "from_json");
  EXPECT_FALSE(saved.contains("lr")) << "unset, its default depends on the optimizer";
  EXPECT_EQ(result_of("from_json")["steps"], 3);

  // A run's config.json runs it again; TOML says the same.
  r = train({"--config", saved_path.string(), "--name", "again"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  Json again =
      Json::parse(cohort::testing::read_text((dir / "runs" / "again" / "config.json").string()));
  again["name"] = "from_json";
  EXPECT_EQ(again, saved);
  const std::string toml =
      write("run.toml", "data-dir = \"" + data.string() +
                            "\"\nmodel = \"mlp\"\nworkers = 1\nepochs = "
                            "1\nmax_steps = 2\nresume = false\nquiet = true\n");
  r = train({"--config", toml, "--name", "from_toml"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(result_of("from_toml")["steps"], 2);
  EXPECT_EQ(Json::parse(cohort::testing::read_text(
                (dir / "runs" / "from_toml" / "config.json").string()))["resume"],
            false);

  const std::vector<std::pair<std::string, std::string>> bad = {
      {write("unknown.json", "{\"modle\": \"mlp\"}"),
       "unknown.json: unknown key 'modle': it is no option of `cohort train`"},
      {write("type.json", "{\"workers\": \"many\"}"),
       "type.json: key 'workers' = many has the wrong type: give a value of type INT"},
      {write("flag.toml", "quiet = 3\n"),
       "flag.toml: key 'quiet' = 3 has the wrong type: give true or false"},
      {write("broken.json", "{\"workers\": 2,"), "broken.json is not valid JSON"},
      {write("nested.json", "{\"zero\": {\"stage\": 2}}"),
       "nested.json: key 'zero' has the value {\"stage\":2}: give a number, a string"},
      {write("section.toml", "[train]\nworkers = 2\n"),
       "section.toml: key 'train.workers' is in a section"},
      {(dir / "missing.json").string(), "missing.json: cannot read the file"},
  };
  for (const auto& [file, fragment] : bad) {
    r = train({"--config", file}, std::chrono::seconds(30));
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find(fragment), std::string::npos)
        << "expected '" << fragment << "' in: " << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
  }
}

// `cohort --version` says which build this is; `cohort env` what it sees, and names launcher
// variables that contradict each other (exit code 2) and a rendezvous host that does not resolve.
// `cohort estimate` prints each worker's memory by item, per plan, with no data and no worker;
// `--memory-budget` refuses a plan over it there and in `cohort train`, before any worker starts.
TEST_F(Cli, EstimateSaysWhatEachWorkerNeedsAndABudgetRefusesAPlanOverIt) {
  const auto estimate = [&](std::vector<std::string> args) {
    args.insert(args.begin(), {cli_path(), "estimate", "--model", "resnet18", "--workers", "4"});
    return run_command(args, std::chrono::seconds(120));
  };
  // The optimizer state of 11.2 M parameters under AdamW: 89.4 MB whole, a quarter sharded.
  const auto ddp = estimate({"--optimizer", "adamw"});
  ASSERT_EQ(ddp.exit_code, 0) << ddp.output;
  EXPECT_NE(ddp.output.find("optimizer state:  89.4 MB"), std::string::npos) << ddp.output;
  EXPECT_NE(ddp.output.find("activations:"), std::string::npos) << ddp.output;
  EXPECT_NE(ddp.output.find("runtime:"), std::string::npos) << ddp.output;
  const auto zero = estimate({"--optimizer", "adamw", "--zero-stage", "2"});
  ASSERT_EQ(zero.exit_code, 0) << zero.output;
  EXPECT_NE(zero.output.find("optimizer state:  22.4 MB"), std::string::npos) << zero.output;
  EXPECT_NE(zero.output.find("gradient buckets:"), std::string::npos) << zero.output;
  EXPECT_NE(zero.output.find("--workers 4 --zero-stage 2 --batch-size"), std::string::npos)
      << zero.output;
  // A pipeline's worker: its stage's parameters, and the other stage's, which it keeps too.
  const auto pipeline = estimate({"--optimizer", "adamw", "--pp", "2"});
  ASSERT_EQ(pipeline.exit_code, 0) << pipeline.output;
  EXPECT_NE(pipeline.output.find("--workers 4 --pp 2 --batch-size"), std::string::npos)
      << pipeline.output;
  EXPECT_NE(pipeline.output.find("the model's other stages:"), std::string::npos)
      << pipeline.output;
  const auto over = estimate({"--optimizer", "adamw", "--memory-budget", "0.05"});
  EXPECT_EQ(over.exit_code, 2) << over.output;
  EXPECT_NE(over.output.find("over --memory-budget 50.0 MB; the largest item is "),
            std::string::npos)
      << over.output;
  auto r = train({"--data-dir", data.string(), "--memory-budget", "0.05", "--name", "budget"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("over --memory-budget 50.0 MB"), std::string::npos) << r.output;
  EXPECT_FALSE(std::filesystem::exists(dir / "runs" / "budget" / "logs")) << "a worker started";
  r = train({"--data-dir", data.string(), "--memory-budget", "64", "--name", "fits", "--max-steps",
             "2", "--epochs", "1"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("within --memory-budget 64.0 GB"), std::string::npos) << r.output;
}

// The optimizer state in files trains as in memory, under DDP and ZeRO alike; a folder that is
// not there or has no room is refused before any worker starts; cpu on a CPU run says it has
// nothing to do.
TEST_F(Cli, OptimizerStateOffloadedToDiskTrainsAsInMemory) {
  const auto offload = dir / "offload";
  std::filesystem::create_directories(offload);
  for (const std::string stage : {"0", "2"}) {
    const std::vector<std::string> common{
        "--data-dir", data.string(), "--workers",   "2",     "--epochs",     "1",  "--max-steps",
        "6",          "--quiet",     "--optimizer", "adamw", "--zero-stage", stage};
    auto with = [&](std::vector<std::string> extra) {
      auto args = common;
      args.insert(args.end(), extra.begin(), extra.end());
      return args;
    };
    auto memory = train(with({"--name", "memory" + stage}));
    ASSERT_EQ(memory.exit_code, 0) << memory.output;
    auto disk =
        train(with({"--name", "disk" + stage, "--offload-optimizer", "disk:" + offload.string()}));
    ASSERT_EQ(disk.exit_code, 0) << disk.output;
    EXPECT_EQ(result_of("disk" + stage)["train_loss"], result_of("memory" + stage)["train_loss"])
        << "stage " << stage;
    EXPECT_EQ(result_of("disk" + stage)["test_loss"], result_of("memory" + stage)["test_loss"]);
    const auto log = cohort::testing::read_text(
        (dir / "runs" / ("disk" + stage) / "logs" / "rank-0.log").string());
    EXPECT_NE(log.find("rank 0's optimizer state, "), std::string::npos) << log;
  }
  EXPECT_TRUE(std::filesystem::is_empty(offload)) << "a state file stayed behind";
  auto r = train({"--data-dir", data.string(), "--offload-optimizer",
                  "disk:" + (dir / "absent").string(), "--name", "absent"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("absent is not a folder: create it"), std::string::npos) << r.output;
  r = train({"--data-dir", data.string(), "--offload-optimizer", "cpu", "--name", "cpu",
             "--max-steps", "2", "--epochs", "1"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  const auto log =
      cohort::testing::read_text((dir / "runs" / "cpu" / "logs" / "rank-0.log").string());
  EXPECT_NE(log.find("--offload-optimizer cpu: the optimizer state is in host memory already"),
            std::string::npos)
      << log;
}

TEST_F(Cli, VersionAndEnvSayWhatThisBuildIsAndSees) {
  auto r = run_command({cli_path(), "--version"}, std::chrono::seconds(30));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.rfind(std::string("cohort ") + COHORT_VERSION + " (git ", 0), 0u) << r.output;
  EXPECT_NE(r.output.find(std::string("libtorch ") + build::kLibtorchVersion), std::string::npos)
      << r.output;
  const auto env = [&](const std::vector<std::string>& variables) {
    std::vector<std::string> argv{"env", "-i"};
    argv.insert(argv.end(), variables.begin(), variables.end());
    argv.push_back(cli_path());
    argv.push_back("env");
    return run_command(argv, std::chrono::seconds(60));
  };
  r = env({});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("launch       none"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("data plane   binds 127.0.0.1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("variables    none"), std::string::npos) << r.output;
  // The BLAS this test's libtorch calls, the command's too.
  EXPECT_NE(r.output.find("BLAS         " + runtime::blas_library().name), std::string::npos)
      << r.output;
  // With Debian's reference BLAS first (where it is installed), a warning says what to install.
  if (const auto reference = cohort::testing::reference_blas_file(); !reference.empty()) {
    r = env({"LD_PRELOAD=" + reference});
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("BLAS         the reference BLAS (" +
                            std::filesystem::path(reference).parent_path().string() + "/"),
              std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("warning: libtorch's matrix products run on the reference BLAS"),
              std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("apt install libopenblas0-openmp"), std::string::npos) << r.output;
  }
  r = env({"RANK=1"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("warning: RANK is set but WORLD_SIZE is not"), std::string::npos)
      << r.output;
  r = env({"RANK=1", "WORLD_SIZE=2", "MASTER_ADDR=no-such-host.invalid", "MASTER_PORT=29500",
           "COHORT_JOB_SECRET=hunter2-of-the-job"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("launch       torchrun: rank 1 of 2"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("  MASTER_ADDR=no-such-host.invalid\n"), std::string::npos) << r.output;
  // A secret's value never goes into a report that users paste into issues.
  EXPECT_NE(r.output.find("  COHORT_JOB_SECRET=(set, 18 characters, not shown)\n"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("hunter2"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("warning: MASTER_ADDR 'no-such-host.invalid' does not resolve"),
            std::string::npos)
      << r.output;
}

TEST_F(Cli, HelpIsGroupedWithExamples) {
  // Newer CLI11 reflows the footer and may change the headings' case.
  const auto lower = [](std::string text) {
    std::transform(text.begin(), text.end(), text.begin(),
                   [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    return text;
  };
  auto r = run_command({cli_path(), "--help"}, std::chrono::seconds(30));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  std::string help = lower(r.output);
  const auto examples = help.find("examples:");
  EXPECT_NE(examples, std::string::npos) << r.output;
  EXPECT_NE(help.find("cohort train --model cnn", examples), std::string::npos) << r.output;
  r = run_command({cli_path(), "train", "--help"}, std::chrono::seconds(30));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  help = lower(r.output);
  size_t at = 0;
  for (const char* group :
       {"model and data:", "workers and devices:", "training:", "parallelism and synchronisation:",
        "run directory and recovery:", "output and observability:", "examples:"}) {
    const auto found = help.find(group, at);
    EXPECT_NE(found, std::string::npos) << group << " (in order) in " << r.output;
    if (found != std::string::npos) at = found;
  }
}

TEST_F(Cli, TrainsEndToEndAndWritesTheRunDirectory) {
  auto r = train({"--data-dir", data.string(), "--workers", "2", "--epochs", "2", "--batch-size",
                  "32", "--name", "e2e", "--lr", "0.05", "--umask", "027"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("(rank=0, pid="), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[report 2] epoch 2"), std::string::npos) << r.output;
  auto result = result_of("e2e");
  for (const char* key : {"test_accuracy", "train_loss", "epochs", "steps", "samples_per_second",
                          "workers", "wall_seconds", "time_to_first_step_s"}) {
    EXPECT_TRUE(result.contains(key)) << key << " missing from " << result.dump();
  }
  EXPECT_EQ(result["workers"], 2);
  EXPECT_EQ(result["epochs"], 2);
  EXPECT_EQ(result["steps"], 2 * (256 / 32));
  EXPECT_GT(result["samples_per_second"].get<double>(), 0);
  // The tiny data set is easy: a model that learned anything beats chance by far.
  EXPECT_GT(result["test_accuracy"].get<double>(), 0.5);
  std::ifstream metrics(dir / "runs" / "e2e" / "metrics.jsonl");
  int lines = 0;
  for (std::string line; std::getline(metrics, line);) ++lines;
  EXPECT_EQ(lines, 2);
  EXPECT_TRUE(std::filesystem::exists(dir / "runs" / "e2e" / "logs" / "rank-1.log"));
  // --umask 027: the group may read the run, others not.
  const auto mode = [](const std::filesystem::path& path) {
    return static_cast<unsigned>(std::filesystem::status(path).permissions()) & 0777;
  };
  const auto checkpoint = std::filesystem::path(result["checkpoint"].get<std::string>());
  EXPECT_EQ(mode(dir / "runs" / "e2e"), 0750u);
  EXPECT_EQ(mode(checkpoint), 0750u);
  EXPECT_EQ(mode(checkpoint / "model.safetensors"), 0640u);
  EXPECT_EQ(mode(dir / "runs" / "e2e" / "result.json"), 0640u);
}

TEST_F(Cli, ResultHoldsTheValuesTheRunUsedAndThroughputOnlyWhereMeasured) {
  const auto run = [&](const std::string& steps, const std::string& name) {
    auto args = small_run("adamw", {"--epochs", "1", "--max-steps", steps, "--name", name});
    *(std::find(args.begin(), args.end(), "--workers") + 1) = "1";
    return train(args);
  };
  // One step: the first step (start-up) is never timed, so there is no throughput, and the run
  // says so instead of reporting 0 samples per second.
  auto r = run("1", "one_step");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("samples_per_second not measured"), std::string::npos) << r.output;
  auto result = result_of("one_step");
  EXPECT_FALSE(result.contains("samples_per_second")) << result.dump();
  // The config holds the optimizer's defaults the run used, not the flags' "unset" zeros: run
  // again from it, it is the same run.
  EXPECT_EQ(result["config"]["lr"].get<double>(), 1e-3) << result["config"].dump();
  EXPECT_EQ(result["config"]["weight_decay"].get<double>(), 0.01) << result["config"].dump();
  EXPECT_EQ(result["lr"].get<double>(), 1e-3);
  // Three steps, fewer than the warm-up: measured over the two after the first.
  r = run("3", "three_steps");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  result = result_of("three_steps");
  EXPECT_GT(result.value("samples_per_second", 0.0), 0) << result.dump();
  EXPECT_EQ(result.value("throughput_steps", 0), 2) << result.dump();
}

TEST_F(Cli, SameSeedSameWorkersSameLoss) {
  const std::vector<std::string> common{"--data-dir", data.string(), "--workers",    "2",
                                        "--epochs",   "1",           "--batch-size", "16",
                                        "--seed",     "11",          "--quiet"};
  auto first = common, second = common;
  first.insert(first.end(), {"--name", "a"});
  second.insert(second.end(), {"--name", "b"});
  ASSERT_EQ(train(first).exit_code, 0);
  ASSERT_EQ(train(second).exit_code, 0);
  EXPECT_EQ(result_of("a")["train_loss"].get<double>(), result_of("b")["train_loss"].get<double>());
  auto third = common;
  third[9] = "12";
  third.insert(third.end(), {"--name", "c"});
  ASSERT_EQ(train(third).exit_code, 0);
  EXPECT_NE(result_of("a")["train_loss"].get<double>(), result_of("c")["train_loss"].get<double>());
}

// Resuming restores weights, optimizer state, epoch and data order: the result is the same as
// that of a run that was never interrupted.
TEST_F(Cli, ResumeContinuesExactlyWhereItStopped) {
  const std::vector<std::string> common{"--data-dir",  data.string(),  "--workers",
                                        "2",           "--batch-size", "16",
                                        "--optimizer", "adam",         "--quiet"};
  auto with = [&](std::vector<std::string> extra) {
    auto args = common;
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  };
  // The flat AdamW under bf16 autocast, with clipping and a warmup-cosine schedule: its state,
  // the schedule's lr and the steps resume exactly too.
  {
    std::vector<std::string> fast = common;
    fast[7] = "adamw";
    fast.insert(fast.end(), {"--precision", "bf16", "--gradient-clipping", "1", "--warmup-steps",
                             "5", "--lr-decay", "cosine"});
    auto a = fast, b = fast, c = fast;
    // Stopped after epoch 1 of 2 (16 steps of 16 examples per worker): the cosine spans both.
    a.insert(a.end(), {"--epochs", "2", "--name", "fast_straight"});
    b.insert(b.end(), {"--epochs", "2", "--max-steps", "16", "--name", "fast_resumed"});
    c.insert(c.end(), {"--epochs", "2", "--name", "fast_resumed"});
    ASSERT_EQ(train(a).exit_code, 0);
    ASSERT_EQ(train(b).exit_code, 0);
    auto again = train(c);
    ASSERT_EQ(again.exit_code, 0) << again.output;
    auto straight = result_of("fast_straight"), resumed = result_of("fast_resumed");
    EXPECT_EQ(resumed["train_loss"].get<double>(), straight["train_loss"].get<double>());
    EXPECT_EQ(resumed["test_accuracy"].get<double>(), straight["test_accuracy"].get<double>());
    EXPECT_GT(straight["test_accuracy"].get<double>(), 0.3) << "bf16 training did not learn";
  }
  ASSERT_EQ(train(with({"--epochs", "2", "--name", "straight"})).exit_code, 0);
  ASSERT_EQ(train(with({"--epochs", "1", "--name", "resumed"})).exit_code, 0);
  auto second = train(with({"--epochs", "2", "--name", "resumed"}));
  ASSERT_TRUE(resumed(second));
  const auto straight = result_of("straight");
  EXPECT_EQ(result_of("resumed")["epochs"], 2);
  expect_same_end("resumed", "straight");
  // --no-resume starts from scratch: one epoch again.
  ASSERT_EQ(train(with({"--epochs", "1", "--name", "resumed", "--no-resume"})).exit_code, 0);
  EXPECT_EQ(result_of("resumed")["steps"], straight["steps"].get<int>() / 2);
}

// ZeRO through the CLI: every stage trains to the DDP run's result (the same arithmetic, in
// another order of float sums), and a stage-2 run with accumulation resumes exactly.
TEST_F(Cli, ZeroStagesTrainAsDdpAndResumeExactly) {
  auto with = [&](const std::vector<std::string>& extra) { return small_run("adamw", extra); };
  ASSERT_EQ(train(with({"--epochs", "1", "--name", "ddp"})).exit_code, 0);
  for (const char* stage : {"1", "2", "3"}) {
    auto r = train(
        with({"--epochs", "1", "--zero-stage", stage, "--name", std::string("zero") + stage}));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const auto ddp = result_of("ddp"), zero = result_of(std::string("zero") + stage);
    EXPECT_NEAR(zero["train_loss"].get<double>(), ddp["train_loss"].get<double>(),
                1e-4 * ddp["train_loss"].get<double>())
        << "stage " << stage;
    EXPECT_EQ(zero["replica_spread"].get<double>(), 0.0) << "stage " << stage;
  }
  // Stage 3 (the MLP's first layer sharded), two micro-batches per step: 16 steps of 2 x 8 per
  // worker in the epoch.
  auto zero2 = [&](std::vector<std::string> extra) {
    auto args = with({"--zero-stage", "3", "--gradient-accumulation-steps", "2"});
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  };
  ASSERT_EQ(train(zero2({"--epochs", "2", "--name", "z_straight"})).exit_code, 0);
  ASSERT_EQ(train(zero2({"--epochs", "2", "--max-steps", "16", "--name", "z_resumed"})).exit_code,
            0);
  EXPECT_EQ(result_of("z_resumed")["steps"], 16);
  auto again = train(zero2({"--epochs", "2", "--name", "z_resumed"}));
  ASSERT_EQ(again.exit_code, 0) << again.output;
  EXPECT_EQ(result_of("z_straight")["steps"], 32);
  expect_same_end("z_resumed", "z_straight");
  // The shards are in the checkpoint, one file per rank, and a third epoch on one worker (at
  // stage 1) resumes from them.
  bool found = false;
  for (const auto& entry : std::filesystem::directory_iterator(dir / "runs" / "z_resumed"))
    found = found || std::filesystem::exists(entry.path() / "zero-rank1-of-2.safetensors");
  EXPECT_TRUE(found);
  auto one_worker = zero2({"--epochs", "3", "--name", "z_resumed"});
  one_worker[3] = "1";  // --workers
  *(std::find(one_worker.begin(), one_worker.end(), "--zero-stage") + 1) = "1";
  auto other = train(one_worker);
  ASSERT_TRUE(resumed(other));
  EXPECT_EQ(result_of("z_resumed")["epochs"], 3);
}

// `cohort checkpoint consolidate`: a pipeline's stage files and a ZeRO stage-3 run's checkpoint
// become one safetensors file holding every tensor of the whole model; an altered checkpoint and
// a folder without a model are refused by name.
TEST_F(Cli, CheckpointConsolidateWritesTheWholeModelAsOneFile) {
  auto with = [&](const std::vector<std::string>& extra) { return small_run("sgd", extra); };
  ASSERT_EQ(train(with({"--model", "mlp", "--epochs", "1", "--pp", "2", "--name", "pp"})).exit_code,
            0);
  ASSERT_EQ(train(with({"--model", "mlp", "--epochs", "1", "--zero-stage", "3", "--name", "z3"}))
                .exit_code,
            0);
  auto last_checkpoint = [&](const std::string& run) {
    std::filesystem::path last;
    for (const auto& entry : std::filesystem::directory_iterator(dir / "runs" / run))
      if (entry.is_directory() && entry.path().filename().string().rfind("checkpoint_", 0) == 0 &&
          entry.path() > last)
        last = entry.path();
    return last;
  };
  auto consolidate = [&](const std::filesystem::path& checkpoint, const std::string& output) {
    return run_command({cli_path(), "checkpoint", "consolidate", checkpoint.string(), "-o",
                        (dir / output).string()},
                       std::chrono::seconds(60));
  };
  const auto model_names = [] {
    std::set<std::string> names;
    auto mlp = cohort::models::create_model("mlp");
    for (const auto& p : mlp->named_parameters()) names.insert(p.key());
    return names;
  }();
  for (const std::string run : {"pp", "z3"}) {
    const auto checkpoint = last_checkpoint(run);
    auto r = consolidate(checkpoint, run + ".safetensors");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("wrote 6 tensors"), std::string::npos) << r.output;
    const auto tensors = cohort::safetensors::read(dir / (run + ".safetensors"));
    std::set<std::string> names;
    for (const auto& [name, tensor] : tensors) names.insert(name);
    EXPECT_EQ(names, model_names) << run;
    // The same values as the checkpoint's own files.
    for (const auto& entry : std::filesystem::directory_iterator(checkpoint)) {
      const auto file = entry.path().filename().string();
      if (file != "model.safetensors" && file.rfind("stage-", 0) != 0) continue;
      for (const auto& [name, tensor] : cohort::safetensors::read(entry.path()))
        EXPECT_TRUE(torch::equal(tensors.at(name), tensor)) << run << " " << name;
    }
  }
  // An altered checkpoint fails its manifest; a folder without a model says so.
  const auto altered = last_checkpoint("z3") / "model.safetensors";
  {
    std::fstream f(altered, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-4, std::ios::end);
    f.write("XXXX", 4);
  }
  auto bad = consolidate(last_checkpoint("z3"), "bad.safetensors");
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("model.safetensors"), std::string::npos) << bad.output;
  auto empty = consolidate(dir / "data", "empty.safetensors");
  EXPECT_EQ(empty.exit_code, 2) << empty.output;
  EXPECT_NE(empty.output.find("holds no model file"), std::string::npos) << empty.output;
}

// A pipeline of two workers trains the MLP as one worker does (the same batches, the gradient
// of each batch's mean summed over micro-batches in another order); the ViT tensor-parallel over
// two workers likewise. A zero-bubble pipeline stopped after an epoch resumes exactly, and in
// another cut (one worker, 4 stages) as the pipeline trains; one worker's checkpoint resumes in a
// pipeline; tensor-parallel slices are gathered and cut anew likewise.
TEST_F(Cli, PipelinesAndTensorParallelismTrainAsOneWorkerAndResumeExactly) {
  auto with = [&](const std::vector<std::string>& extra) { return small_run("sgd", extra); };
  auto one_worker = [&](std::vector<std::string> args) {
    args[3] = "1";  // --workers
    return args;
  };
  ASSERT_EQ(train(one_worker(with({"--model", "mlp", "--epochs", "1", "--name", "one"}))).exit_code,
            0);
  auto piped = train(with({"--model", "mlp", "--epochs", "1", "--pp", "2", "--name", "pp"}));
  ASSERT_EQ(piped.exit_code, 0) << piped.output;
  EXPECT_NE(cohort::testing::read_text((dir / "runs" / "pp" / "logs" / "rank-0.log").string())
                .find("mesh dp 1 x pp 2 x tp 1: 3 layers in 2 stages, 1f1b over 4 micro-batches"),
            std::string::npos);
  const auto one = result_of("one"), pp = result_of("pp");
  EXPECT_EQ(pp["steps"], one["steps"]);
  EXPECT_NEAR(pp["train_loss"].get<double>(), one["train_loss"].get<double>(),
              1e-4 * one["train_loss"].get<double>());
  EXPECT_NEAR(pp["test_accuracy"].get<double>(), one["test_accuracy"].get<double>(), 0.02);

  const std::vector<std::string> vit{"--model",     "vit", "--epochs",        "1",
                                     "--max-steps", "4",   "--test-examples", "32"};
  auto vit_run = [&](std::vector<std::string> extra) {
    auto args = vit;
    args.insert(args.end(), extra.begin(), extra.end());
    return with(args);
  };
  ASSERT_EQ(train(one_worker(vit_run({"--name", "vit_one"}))).exit_code, 0);
  auto sliced = train(vit_run({"--tp", "2", "--name", "vit_tp"}));
  ASSERT_EQ(sliced.exit_code, 0) << sliced.output;
  EXPECT_NEAR(result_of("vit_tp")["train_loss"].get<double>(),
              result_of("vit_one")["train_loss"].get<double>(),
              1e-4 * result_of("vit_one")["train_loss"].get<double>());
  // The checkpoints hold the whole model: the pipeline's and the tensor-parallel run's weights
  // are one worker's, to float rounding.
  for (const auto& [mesh_run, plain] : {std::pair{"pp", "one"}, std::pair{"vit_tp", "vit_one"}}) {
    const auto file = [&](const char* run) {
      return dir / "runs" / run / "checkpoint_000000" / "model.safetensors";
    };
    const auto got = safetensors::read(file(mesh_run)), want = safetensors::read(file(plain));
    ASSERT_EQ(got.size(), want.size()) << mesh_run;
    for (const auto& [name, tensor] : want) {
      ASSERT_TRUE(got.count(name)) << mesh_run << " lacks " << name;
      EXPECT_TRUE(torch::allclose(got.at(name), tensor, 1e-3, 1e-5)) << mesh_run << " " << name;
    }
  }

  auto zb = [&](std::vector<std::string> extra) {
    auto args = small_run("adam", {"--model", "cnn", "--pp", "2", "--schedule", "zero-bubble"});
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  };
  for (const auto& [epochs, name] : {std::pair{"2", "zb_straight"}, std::pair{"1", "zb_resumed"}}) {
    auto r = train(zb({"--epochs", epochs, "--name", name}));
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  auto again = train(zb({"--epochs", "2", "--name", "zb_resumed"}));
  ASSERT_TRUE(resumed(again));
  expect_same_end("zb_resumed", "zb_straight");
  const auto straight = result_of("zb_straight");
  // Another cut resumes by the model's names: the pipeline's epoch-1 checkpoint continued by one
  // worker without a mesh, and by a pipeline of 4 stages (both dp 1: the same global batch),
  // trains epoch 2 as the pipeline did.
  using Recut = std::tuple<std::string, std::string, std::vector<std::string>, std::string>;
  for (const auto& [name, workers, mesh, into] :
       {Recut{"zb_plain", "1", {}, "a run without a mesh"},
        Recut{"zb_pp4",
              "4",
              {"--pp", "4", "--schedule", "gpipe"},
              "--pp 4 --tp 1 --schedule gpipe"}}) {
    ASSERT_EQ(train(zb({"--epochs", "1", "--name", name})).exit_code, 0);
    auto args = small_run("adam", {"--model", "cnn", "--epochs", "2", "--name", name});
    args[3] = workers;  // --workers
    args.insert(args.end(), mesh.begin(), mesh.end());
    auto r = train(args);
    ASSERT_TRUE(resumed(r));
    EXPECT_NE(cohort::testing::read_text((dir / "runs" / name / "logs" / "rank-0.log").string())
                  .find("re-cutting the optimizer state of checkpoint_000000 from --pp 2 --tp 1 "
                        "--schedule zero-bubble to " +
                        into),
              std::string::npos)
        << name;
    const auto got = result_of(name);
    EXPECT_EQ(got["steps"], straight["steps"]) << name;
    EXPECT_NEAR(got["train_loss"].get<double>(), straight["train_loss"].get<double>(),
                1e-4 * straight["train_loss"].get<double>())
        << name;
    EXPECT_NEAR(got["lr"].get<double>(), straight["lr"].get<double>(), 1e-12) << name;
  }
  // And back: one worker's checkpoint into a pipeline of 2 stages.
  ASSERT_EQ(
      train(one_worker(with({"--model", "mlp", "--epochs", "2", "--name", "one_2"}))).exit_code, 0);
  auto into_pipeline =
      train(with({"--model", "mlp", "--epochs", "2", "--pp", "2", "--name", "one"}));
  ASSERT_EQ(into_pipeline.exit_code, 0) << into_pipeline.output;
  EXPECT_NEAR(result_of("one")["train_loss"].get<double>(),
              result_of("one_2")["train_loss"].get<double>(),
              1e-4 * result_of("one_2")["train_loss"].get<double>());
  // Tensor-parallel slices too: the ViT's tp-2 checkpoint continued by one worker, and one
  // worker's continued at tp 2, train their second epoch as the tp-2 run resumed at tp 2.
  auto vit_epoch = [&](const std::string& name, int epoch, bool sliced) {
    auto args = with({"--model", "vit", "--epochs", std::to_string(epoch), "--max-steps",
                      std::to_string(4 * epoch), "--test-examples", "32", "--name", name});
    if (sliced) {
      args.push_back("--tp");
      args.push_back("2");
    } else {
      args = one_worker(args);
    }
    auto r = train(args);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return r;
  };
  vit_epoch("vit_ref", 1, true);
  vit_epoch("vit_ref", 2, true);
  EXPECT_NE(vit_epoch("vit_tp", 2, false).output.find("resuming from"), std::string::npos);
  EXPECT_NE(vit_epoch("vit_one", 2, true).output.find("resuming from"), std::string::npos);
  const auto vit_ref = result_of("vit_ref");
  for (const char* name : {"vit_tp", "vit_one"}) {
    EXPECT_EQ(result_of(name)["steps"], vit_ref["steps"]) << name;
    EXPECT_NEAR(result_of(name)["train_loss"].get<double>(), vit_ref["train_loss"].get<double>(),
                1e-4 * vit_ref["train_loss"].get<double>())
        << name;
  }
}

// --gradient-accumulation-steps with a pipeline: two batches of 8 per optimizer step are one
// pipeline step over both batches' micro-batches, the same as a batch of 16 in 8 micro-batches,
// and train as one worker accumulating two batches without a mesh.
TEST_F(Cli, APipelineAccumulatesBatchesAsOneStepOverTheirMicroBatches) {
  auto run = [&](const std::string& name, const std::string& workers, const std::string& batch,
                 const std::vector<std::string>& extra) {
    auto args = small_run("sgd", {"--model", "mlp", "--epochs", "1", "--name", name});
    args[3] = workers;  // --workers
    args[5] = batch;    // --batch-size
    args.insert(args.end(), extra.begin(), extra.end());
    auto r = train(args);
    EXPECT_EQ(r.exit_code, 0) << r.output;
  };
  run("accumulated", "2", "8", {"--pp", "2", "--gradient-accumulation-steps", "2"});
  run("big_batch", "2", "16", {"--pp", "2", "--micro-batches", "8"});
  run("one", "1", "8", {"--gradient-accumulation-steps", "2"});
  EXPECT_NE(
      cohort::testing::read_text((dir / "runs" / "accumulated" / "logs" / "rank-0.log").string())
          .find("1f1b over 8 micro-batches"),
      std::string::npos);
  const auto accumulated = result_of("accumulated");
  EXPECT_EQ(accumulated["steps"], result_of("big_batch")["steps"]);
  EXPECT_EQ(accumulated["steps"], result_of("one")["steps"]);
  EXPECT_EQ(accumulated["train_loss"].get<double>(),
            result_of("big_batch")["train_loss"].get<double>());
  const auto model = [&](const char* run) {
    return safetensors::read(dir / "runs" / run / "checkpoint_000000" / "model.safetensors");
  };
  const auto got = model("accumulated"), big = model("big_batch"), one = model("one");
  ASSERT_EQ(got.size(), one.size());
  for (const auto& [name, tensor] : one) {
    EXPECT_TRUE(torch::equal(got.at(name), big.at(name))) << name;
    EXPECT_TRUE(torch::allclose(got.at(name), tensor, 1e-3, 1e-5)) << name;
  }
}

// ZeRO as a pipeline's data parallelism (2 x 2 workers): the same training as DDP's, every dp
// rank's shards of every stage's optimizer state in the checkpoint (DDP's: state files), an exact
// resume, and the shards resumed by DDP at another dp degree.
TEST_F(Cli, ZeroShardsAPipelinesDataParallelismAndResumesExactly) {
  auto mesh_run = [&](const std::string& zero, const std::string& epochs, const std::string& name) {
    auto args = small_run("adam", {"--model", "mlp", "--pp", "2", "--zero-stage", zero, "--epochs",
                                   epochs, "--name", name});
    args[3] = "4";  // --workers: dp 2 x pp 2
    return train(args);
  };
  auto ddp = mesh_run("0", "1", "ddp");
  ASSERT_EQ(ddp.exit_code, 0) << ddp.output;
  // DDP's flat optimizer keeps each stage's state as state files, read back into its buffers
  // (libtorch's archive would be read whole beside them).
  for (const char* stage : {"optimizer-pp0-of-2-tp0-of-1", "optimizer-pp1-of-2-tp0-of-1"}) {
    const auto folder = dir / "runs" / "ddp" / "checkpoint_000000" / stage;
    expect_files(folder, {"zero_manifest.json", "optimizer_part.json"});
    EXPECT_FALSE(std::filesystem::exists(folder / "optimizer.pt")) << folder.string();
  }
  // Epoch 1 as DDP's: its train loss is in the first checkpoint's metrics.
  const auto first_epoch = [&](const std::string& run) {
    return cohort::Checkpoint::from_directory(dir / "runs" / run / "checkpoint_000000").metrics();
  };
  for (const std::string stage : {"2", "3"}) {
    const std::string name = "straight" + (stage == "2" ? "" : stage);
    auto straight = mesh_run(stage, "2", name);
    ASSERT_EQ(straight.exit_code, 0) << straight.output;
    EXPECT_NE(cohort::testing::read_text((dir / "runs" / name / "logs" / "rank-0.log").string())
                  .find("ZeRO stage " + stage + " over dp"),
              std::string::npos);
    EXPECT_NEAR(first_epoch(name)["train_loss"].get<double>(),
                first_epoch("ddp")["train_loss"].get<double>(),
                1e-4 * first_epoch("ddp")["train_loss"].get<double>())
        << "ZeRO stage " << stage;
  }
  // Stage 3 (which keeps only the shards of the first stage's fc1, the mlp's one unit above the
  // persistence threshold: Pipeline.ZeroShardsTheDataParallelismOfEverySchedule checks the
  // shards) resumes exactly from its checkpoint.
  ASSERT_EQ(mesh_run("3", "1", "resumed3").exit_code, 0);
  ASSERT_TRUE(resumed(mesh_run("3", "2", "resumed3")));
  expect_same_end("resumed3", "straight3");
  expect_files(dir / "runs" / "straight" / "checkpoint_000000",
               {"optimizer-pp0-of-2-tp0-of-1/zero-rank0-of-2.safetensors",
                "optimizer-pp1-of-2-tp0-of-1/zero-rank1-of-2.safetensors",
                "optimizer-pp1-of-2-tp0-of-1/zero_manifest.json"});
  ASSERT_EQ(mesh_run("2", "1", "resumed").exit_code, 0);
  auto again = mesh_run("2", "2", "resumed");
  ASSERT_TRUE(resumed(again));
  expect_same_end("resumed", "straight");
  // DDP on one pipeline (dp 1) takes every stage's state whole from the two shards (and clips
  // by the whole model's norm); half the global batch, half the lr (linear scaling).
  auto args = small_run("adam", {"--model", "mlp", "--pp", "2", "--epochs", "3",
                                 "--gradient-clipping", "0.5", "--name", "resumed"});
  auto ddp_resume = train(args);
  ASSERT_TRUE(resumed(ddp_resume));
  EXPECT_EQ(result_of("resumed")["epochs"], 3);
  EXPECT_NEAR(result_of("resumed")["lr"].get<double>(),
              result_of("straight")["lr"].get<double>() / 2,
              1e-9 * result_of("straight")["lr"].get<double>());
}

// Local SGD and DiLoCo over the dp replicas of pipelines (dp 2 x pp 2): diloco:4 trains as on two
// workers without a mesh, checkpoints every stage's local SGD state and resumes exactly; its
// checkpoint resumes as DDP on the same mesh and as local SGD without a mesh, and DDP's into
// DiLoCo.
TEST_F(Cli, LocalSgdAndDiLoCoOverPipelinesTrainAndResumeExactly) {
  const std::vector<std::string> diloco{"--outer-lr", "0.5", "--outer-momentum", "0.5"};
  auto mesh_run = [&](const std::string& sync, const std::string& epochs, const std::string& name) {
    auto args = small_run(
        "sgd", {"--model", "mlp", "--pp", "2", "--sync", sync, "--epochs", epochs, "--name", name});
    args[3] = "4";  // --workers: dp 2 x pp 2
    if (sync != "ddp") args.insert(args.end(), diloco.begin(), diloco.end());
    return train(args);
  };
  auto plain = small_run(
      "sgd", {"--model", "mlp", "--sync", "diloco:4", "--epochs", "1", "--name", "plain"});
  plain.insert(plain.end(), diloco.begin(), diloco.end());
  ASSERT_EQ(train(plain).exit_code, 0);
  auto straight = mesh_run("diloco:4", "2", "straight");
  ASSERT_EQ(straight.exit_code, 0) << straight.output;
  const Json first_epoch =
      cohort::Checkpoint::from_directory(dir / "runs" / "straight" / "checkpoint_000000").metrics();
  EXPECT_NEAR(first_epoch["train_loss"].get<double>(),
              result_of("plain")["train_loss"].get<double>(),
              1e-4 * result_of("plain")["train_loss"].get<double>());
  // The micro-batches sum in another order: a test example on the edge may go either way.
  EXPECT_NEAR(first_epoch["test_accuracy"].get<double>(),
              result_of("plain")["test_accuracy"].get<double>(), 2.0 / 128);
  EXPECT_NE(cohort::testing::read_text((dir / "runs" / "straight" / "logs" / "rank-0.log").string())
                .find("diloco:4 over dp"),
            std::string::npos);
  expect_files(dir / "runs" / "straight" / "checkpoint_000000",
               {"optimizer-pp0-of-2-tp0-of-1/local_sgd_manifest.json",
                "optimizer-pp0-of-2-tp0-of-1/model.safetensors",
                "optimizer-pp1-of-2-tp0-of-1/local_sgd-rank1-of-2.safetensors",
                "optimizer-pp1-of-2-tp0-of-1/optimizer_part.json"});
  ASSERT_EQ(mesh_run("diloco:4", "1", "resumed").exit_code, 0);
  auto again = mesh_run("diloco:4", "2", "resumed");
  ASSERT_TRUE(resumed(again));
  expect_same_end("resumed", "straight");
  std::printf(
      "diloco:4 over dp 2 x pp 2: epoch 1 train loss %.10f (2 workers without a mesh: "
      "%.10f), epoch 2 %.10f, resumed %.10f\n",
      first_epoch["train_loss"].get<double>(), result_of("plain")["train_loss"].get<double>(),
      result_of("straight")["train_loss"].get<double>(),
      result_of("resumed")["train_loss"].get<double>());
  // DiLoCo's checkpoint as DDP on the same mesh; DDP's into DiLoCo.
  ASSERT_EQ(mesh_run("ddp", "1", "ddp").exit_code, 0);
  // Each worker's bytes per step over all its groups: DiLoCo's dp part is a quarter of DDP's.
  EXPECT_LT(result_of("straight")["comm_bytes_per_step"].get<double>(),
            result_of("ddp")["comm_bytes_per_step"].get<double>());
  auto as_ddp = mesh_run("ddp", "3", "resumed");
  ASSERT_TRUE(resumed(as_ddp));
  EXPECT_EQ(result_of("resumed")["epochs"], 3);
  auto into_diloco = mesh_run("diloco:4", "2", "ddp");
  ASSERT_TRUE(resumed(into_diloco));
  EXPECT_EQ(result_of("ddp")["epochs"], 2);
  // Without a mesh: local SGD on two workers re-cuts DiLoCo's stages (rank 0's inner state).
  auto recut = train(small_run(
      "sgd", {"--model", "mlp", "--sync", "local-sgd:4", "--epochs", "3", "--name", "straight"}));
  ASSERT_EQ(recut.exit_code, 0) << recut.output;
  EXPECT_NE(cohort::testing::read_text((dir / "runs" / "straight" / "logs" / "rank-0.log").string())
                .find("re-cutting the optimizer state of checkpoint_000001 from --pp 2 --tp 1"),
            std::string::npos);
  EXPECT_EQ(result_of("straight")["epochs"], 3);
}

// DiLoCo with H = 1, an outer lr of 1 and no momentum trains as DDP; diloco:4 sends about a
// quarter of DDP's bytes per step, and a run stopped after one epoch resumes to the same result.
TEST_F(Cli, LocalSgdAndDiLoCoTrainAndResumeExactly) {
  auto with = [&](const std::vector<std::string>& extra) { return small_run("sgd", extra); };
  ASSERT_EQ(train(with({"--epochs", "1", "--name", "ddp"})).exit_code, 0);
  auto r = train(with({"--epochs", "1", "--sync", "diloco:1", "--outer-lr", "1", "--outer-momentum",
                       "0", "--name", "diloco1"}));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto ddp = result_of("ddp"), diloco1 = result_of("diloco1");
  EXPECT_NEAR(diloco1["train_loss"].get<double>(), ddp["train_loss"].get<double>(),
              1e-4 * ddp["train_loss"].get<double>());
  ASSERT_EQ(train(with({"--epochs", "2", "--sync", "diloco:4", "--name", "straight"})).exit_code,
            0);
  const auto straight = result_of("straight");
  EXPECT_EQ(straight["replica_spread"].get<double>(), 0.0) << "synchronised at the epoch's end";
  EXPECT_LT(straight["comm_bytes_per_step"].get<double>(),
            ddp["comm_bytes_per_step"].get<double>() / 3);
  ASSERT_EQ(
      train(with({"--epochs", "2", "--sync", "diloco:4", "--max-steps", "32", "--name", "resumed"}))
          .exit_code,
      0);
  auto again = train(with({"--epochs", "2", "--sync", "diloco:4", "--name", "resumed"}));
  ASSERT_TRUE(resumed(again));
  expect_same_end("resumed", "straight");
  // DDP from DiLoCo's checkpoint: every worker takes the same inner optimizer state (the workers'
  // momentum differs), so DDP's replicas stay equal.
  ASSERT_TRUE(resumed(train(with({"--epochs", "3", "--name", "straight"}))));
  EXPECT_EQ(result_of("straight")["replica_spread"].get<double>(), 0.0);
}

// The asynchronous parameter server: trains with two servers in the two workers, reports its
// staleness and bytes, checkpoints every server's shard, and resumes from them, also into
// another number of servers.
TEST_F(Cli, AsyncParameterServerTrainsReportsStalenessAndResumes) {
  auto with = [&](const std::vector<std::string>& extra) { return small_run("adam", extra); };
  ASSERT_EQ(train(with({"--epochs", "1", "--name", "ddp"})).exit_code, 0);
  const auto ddp = result_of("ddp");
  auto r = train(
      with({"--epochs", "1", "--sync", "async-ps:1", "--parameter-servers", "2", "--name", "ps"}));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto ps = result_of("ps");
  EXPECT_EQ(ps["replica_spread"].get<double>(), 0.0) << "synchronised at the epoch's end";
  EXPECT_GE(ps["staleness_mean"].get<double>(), 0.0);
  // Two workers, at most one push ahead: at most 3 updates between a pull and its push.
  EXPECT_LE(ps["staleness_max"].get<int64_t>(), 3);
  // A push of the gradients and a pull of the parameters per step, DDP's all-reduce twice.
  EXPECT_NEAR(ps["comm_bytes_per_step"].get<double>(), 2 * ddp["comm_bytes_per_step"].get<double>(),
              0.05 * ddp["comm_bytes_per_step"].get<double>());
  EXPECT_GT(ps["test_accuracy"].get<double>(), ddp["test_accuracy"].get<double>() - 0.15)
      << "ddp " << ddp["test_accuracy"] << ", async-ps " << ps["test_accuracy"];
  const auto checkpoint = dir / "runs" / "ps" / "checkpoint_000000";
  // The servers' optimizer state as ZeRO's shards, by parameter name.
  for (const char* file :
       {"zero_manifest.json", "zero-rank0-of-2.safetensors", "zero-rank1-of-2.safetensors"})
    EXPECT_TRUE(std::filesystem::exists(checkpoint / file)) << file;
  // Resumed, also with one server instead of two (the shards are read where they overlap).
  r = train(
      with({"--epochs", "2", "--sync", "async-ps:1", "--parameter-servers", "1", "--name", "ps"}));
  ASSERT_TRUE(resumed(r));
  const auto resumed = result_of("ps");
  EXPECT_EQ(resumed["steps"].get<int64_t>(), 2 * ps["steps"].get<int64_t>());
  EXPECT_LT(resumed["train_loss"].get<double>(), ps["train_loss"].get<double>());
}

// Seed 001's DeepSpeed JSON: as written it asks for fp16, which a CPU refuses naming bf16; with
// "bf16" instead it trains, at every ZeRO stage; bad configs name the key, exit code 2.
TEST_F(Cli, DeepSpeedConfigOfSeed001) {
  auto write = [&](const std::string& name, const std::string& text) {
    const auto path = dir / name;
    std::ofstream(path) << text;
    return path.string();
  };
  auto seed = [](const std::string& precision, const std::string& stage) {
    return R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8,
               "optimizer": {"type": "Adam", "params": {"lr": 0.001}},
               ")" +
           precision + R"(": {"enabled": true},
               "zero_optimization": {"stage": )" +
           stage + "}}";
  };
  const std::vector<std::string> common{"--data-dir", data.string(), "--workers", "2",
                                        "--epochs",   "1",           "--quiet"};
  auto with = [&](std::vector<std::string> extra) {
    auto args = common;
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  };
  if (!torch::cuda::is_available()) {
    auto r = train(with({"--deepspeed", write("fp16.json", seed("fp16", "2")), "--name", "f"}));
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find("precision fp16 needs a GPU"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("Use bf16 instead"), std::string::npos) << r.output;
  }
  for (const char* stage : {"0", "1", "2", "3"}) {
    const auto name = std::string("bf16_stage") + stage;
    auto r =
        train(with({"--deepspeed", write(name + ".json", seed("bf16", stage)), "--name", name}));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const auto result = result_of(name);
    // 512 examples, 2 workers, micro-batches of 8, 2 per step: 16 steps.
    EXPECT_EQ(result["steps"], 16) << name;
    EXPECT_EQ(result["replica_spread"].get<double>(), 0.0) << name;
  }
  const std::vector<std::pair<std::string, std::string>> bad{
      {R"({"train_batch_size": 32, "zero_optimization": {"stage": 3,
          "stage3_prefetch_bucket_size": -1}})",
       "zero_optimization.stage3_prefetch_bucket_size must be >= 0, got -1"},
      {seed("bf16", "5"), "zero_optimization.stage 5 is not one of 0, 1, 2, 3"},
      {R"({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 8})",
       "train_batch_size 30 is not train_micro_batch_size_per_gpu 8 x gradient_accumulation_steps"},
      {R"({"train_batch_size": 32, "zero_optimization": {"stage": 2, "reduce_bucket_size": 0}})",
       "zero_optimization.reduce_bucket_size must be > 0, got 0"},
      {R"({"train_batch_size": "32"})", "train_batch_size must be an integer, got \"32\""},
      {"{not json", "is not valid JSON"},
  };
  for (size_t k = 0; k < bad.size(); ++k) {
    auto r = train(with({"--deepspeed", write("bad" + std::to_string(k) + ".json", bad[k].first),
                         "--name", "bad"}));
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find(bad[k].second), std::string::npos) << r.output;
  }
  // Unknown keys: one warning listing them, and the run goes on.
  auto r =
      train(with({"--deepspeed", write("unknown.json", R"({"train_micro_batch_size_per_gpu": 16,
                                                  "flops_profiler": {}, "bf16": {"enabled": true,
                                                  "loss_scale": 1}})"),
                  "--name", "unknown"}));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("ignoring keys cohort does not know or cannot honour: flops_profiler, "
                          "bf16.loss_scale"),
            std::string::npos)
      << r.output;
  // DeepSpeed's activation_checkpointing block (its Megatron examples' settings) checkpoints every
  // unit; what cohort cannot honour is named in the same one warning.
  r = train(
      with({"--deepspeed", write("checkpointing.json", R"({"train_micro_batch_size_per_gpu": 16,
                  "activation_checkpointing": {"partition_activations": true,
                  "contiguous_memory_optimization": false, "cpu_checkpointing": true}})"),
            "--model", "cnn", "--name", "checkpointing", "--max-steps", "4"}));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("cannot honour: activation_checkpointing.partition_activations (not "
                          "honoured), activation_checkpointing.cpu_checkpointing (not honoured)"),
            std::string::npos)
      << r.output;
  // Rank 0's log says what its plan did with the model.
  const auto log =
      cohort::testing::read_text((dir / "runs" / "checkpointing" / "logs" / "rank-0.log").string());
  EXPECT_NE(log.find("DDP, activation checkpointing every:1 (3 units)"), std::string::npos) << log;
}

// Whether the driver said that the loop honours stop requests (before or after its first step).
bool accepts_stop_requests(cohort::testing::Process& driver) {
  const std::string line = "Ctrl-C stops the run after its next checkpoint";
  return driver.output().find(line) != std::string::npos ||
         driver.wait_for_line(line, std::chrono::seconds(30)).has_value();
}

// The first Ctrl-C stops the run after a checkpoint, which resumes where it stopped; the second
// stops every process at once.
TEST_F(Cli, CtrlCStopsAfterACheckpointThatResumesAndTwiceStopsAtOnce) {
  {
    cohort::testing::Process driver(endless_run("graceful"));
    auto pids = wait_until_training(driver);
    ASSERT_EQ(pids.size(), 2u);
    ASSERT_TRUE(accepts_stop_requests(driver)) << driver.output();
    driver.send_signal(SIGINT);
    auto r = driver.wait(std::chrono::seconds(60));
    EXPECT_FALSE(r.timed_out) << r.output;
    EXPECT_EQ(r.exit_code, 128 + SIGINT) << r.output;
    const auto run_dir = dir / "runs" / "graceful";
    for (const char* line :
         {"cohort: stopping after the next checkpoint (Ctrl-C again stops the workers at once)",
          "cohort: stopped at your request after ",
          "run it again with the same storage path and name to resume"}) {
      EXPECT_NE(r.output.find(line), std::string::npos) << line << " in " << r.output;
    }
    EXPECT_NE(
        r.output.find("resume with: cohort train --config " + (run_dir / "config.json").string()),
        std::string::npos)
        << r.output;
    for (int pid : pids)
      EXPECT_FALSE(cohort::testing::process_alive(pid)) << "worker " << pid << " survived";
    const auto result = result_of("graceful");
    EXPECT_TRUE(result["error"].is_null()) << result.dump();
    EXPECT_EQ(result["interrupted"], true) << result.dump();
    const int64_t steps = result["steps"].get<int64_t>();
    ASSERT_GT(steps, 0);

    // The printed command continues from that checkpoint (inside an epoch: after its step).
    const int64_t in_epoch = result.value("epoch_step", int64_t{0});
    r = train(
        {"--config", (run_dir / "config.json").string(), "--max-steps", std::to_string(steps + 3)});
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find(in_epoch > 0 ? "after step " + std::to_string(in_epoch)
                                         : std::string("resuming after epoch")),
              std::string::npos)
        << r.output;
    EXPECT_EQ(result_of("graceful")["steps"], steps + 3);
    EXPECT_EQ(result_of("graceful")["interrupted"], false);
    // Exactly where a run never stopped is after as many steps.
    auto straight = endless_run("straight");
    straight.insert(straight.end(), {"--max-steps", std::to_string(steps + 3)});
    r = run_command(straight, std::chrono::seconds(120));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(result_of("straight")["test_loss"], result_of("graceful")["test_loss"]);
  }
  {
    cohort::testing::Process driver(endless_run("at_once"));
    auto pids = wait_until_training(driver);
    ASSERT_EQ(pids.size(), 2u);
    ASSERT_TRUE(accepts_stop_requests(driver)) << driver.output();
    // Rank 1 stopped: the group cannot reach a checkpoint, so only the second Ctrl-C ends it.
    ::kill(pids[1], SIGSTOP);
    driver.send_signal(SIGINT);
    ASSERT_TRUE(
        driver.wait_for_line("stopping after the next checkpoint", std::chrono::seconds(30)))
        << driver.output();
    driver.send_signal(SIGINT);
    auto r = driver.wait(std::chrono::seconds(30));
    EXPECT_FALSE(r.timed_out) << r.output;
    EXPECT_EQ(r.signal, SIGINT) << r.output;
    for (int pid : pids)
      EXPECT_FALSE(cohort::testing::process_alive(pid)) << "worker " << pid << " survived";
    auto result = result_of("at_once");
    EXPECT_NE(result["error"].get<std::string>().find("interrupted"), std::string::npos)
        << result.dump();
  }
}

// While a driver runs, a second one for its run directory is refused naming it; killed, its
// workers end by themselves, and the next driver takes the directory over saying so.
TEST_F(Cli, WorkersDieWithAKilledDriverAndItsRunDirectoryIsTakenOver) {
  cohort::testing::Process driver(endless_run("killed"));
  auto pids = wait_until_training(driver);
  ASSERT_EQ(pids.size(), 2u);
  const std::vector<std::string> again{"--data-dir",   data.string(), "--name",   "killed",
                                       "--batch-size", "8",           "--epochs", "1",
                                       "--no-resume",  "--quiet"};
  auto second = train(again);
  EXPECT_EQ(second.exit_code, 2) << second.output;
  EXPECT_NE(second.output.find("is in use by the driver with pid " + std::to_string(driver.pid()) +
                               " on host "),
            std::string::npos)
      << second.output;
  // SIGKILL gives the driver no chance to clean up: the workers must notice by themselves.
  ::kill(driver.pid(), SIGKILL);
  driver.wait(std::chrono::seconds(10));
  for (int pid : pids) {
    EXPECT_TRUE(cohort::testing::wait_for_exit(pid, std::chrono::seconds(10)))
        << "worker " << pid << " outlived its driver";
  }
  auto third = train(again);
  EXPECT_EQ(third.exit_code, 0) << third.output;
  EXPECT_NE(third.output.find("taking over the run directory from a driver that is gone (pid " +
                              std::to_string(driver.pid())),
            std::string::npos)
      << third.output;
}

// The driver itself killed mid-run: the same command again continues from the latest checkpoint
// (a driver's death is not a worker failure) and ends exactly where an uninterrupted run ends.
TEST_F(Cli, AKilledDriverResumesWhenRunAgain) {
  const std::vector<std::string> common{"--data-dir",   data.string(), "--workers", "2",
                                        "--batch-size", "16",          "--epochs",  "3",
                                        "--optimizer",  "adam"};
  auto args = [&](const std::string& name, bool quiet) {
    std::vector<std::string> argv{cli_path(), "train", "--storage-path", (dir / "runs").string(),
                                  "--name",   name};
    argv.insert(argv.end(), common.begin(), common.end());
    if (quiet) argv.push_back("--quiet");
    return argv;
  };
  ASSERT_EQ(run_command(args("straight", true), std::chrono::seconds(120)).exit_code, 0);
  {
    cohort::testing::Process driver(args("killed", false));
    ASSERT_TRUE(driver.wait_for_line("[report 1]", std::chrono::seconds(60))) << driver.output();
    ::kill(driver.pid(), SIGKILL);
    driver.wait(std::chrono::seconds(10));
  }
  auto again = run_command(args("killed", false), std::chrono::seconds(120));
  ASSERT_EQ(again.exit_code, 0) << again.output;
  EXPECT_NE(again.output.find("cohort: resuming from "), std::string::npos) << again.output;
  auto straight = result_of("straight"), resumed = result_of("killed");
  EXPECT_EQ(resumed["epochs"], 3);
  EXPECT_TRUE(resumed["failures"].empty()) << resumed.dump();
  EXPECT_EQ(resumed["train_loss"].get<double>(), straight["train_loss"].get<double>());
}

// Checkpoints every 3 steps, saved asynchronously: the driver killed after a few, the same command
// again resumes inside the epoch from the latest committed one (every checkpoint left verifies:
// a save cut short is never taken for one), and ends exactly where a run with synchronous saves
// and no kill ends.
TEST_F(Cli, AsynchronousCheckpointsInsideAnEpochResumeAKilledRunExactly) {
  auto args = [&](const std::string& name, bool async) {
    auto argv =
        named_run(name, {"--batch-size", "16", "--epochs", "2", "--checkpoint-every-steps", "3"});
    if (async) argv.push_back("--async-checkpoint");
    return argv;
  };
  ASSERT_EQ(run_command(args("straight", false), std::chrono::seconds(120)).exit_code, 0);
  {
    cohort::testing::Process driver(args("killed", true));
    ASSERT_TRUE(
        driver.wait_for_line("committed (written behind the loop)", std::chrono::seconds(60)))
        << driver.output();
    ASSERT_TRUE(driver.wait_for_line("[report 3]", std::chrono::seconds(60))) << driver.output();
    ::kill(driver.pid(), SIGKILL);
    driver.wait(std::chrono::seconds(10));
  }
  const auto run = dir / "runs" / "killed";
  int checkpoints = 0;
  for (const auto& entry : std::filesystem::directory_iterator(run)) {
    if (!entry.is_directory() || entry.path().filename().string().rfind("checkpoint_", 0) != 0)
      continue;
    ++checkpoints;
    EXPECT_NO_THROW(Checkpoint::from_directory(entry.path()).verify()) << entry.path();
  }
  EXPECT_GE(checkpoints, 1);
  auto again = run_command(args("killed", true), std::chrono::seconds(120));
  ASSERT_EQ(again.exit_code, 0) << again.output;
  EXPECT_NE(again.output.find("resuming epoch 1 after step "), std::string::npos) << again.output;
  auto straight = result_of("straight"), resumed = result_of("killed");
  EXPECT_EQ(resumed["steps"], straight["steps"]);
  EXPECT_EQ(resumed["test_loss"].get<double>(), straight["test_loss"].get<double>());
  EXPECT_TRUE(resumed.contains("checkpoint_snapshot_s")) << resumed.dump();
}

// Asynchronous checkpoints every step that skip rather than wait for a save still in flight: every
// report either came with its checkpoint or says it skipped it, and the latest checkpoint
// verifies.
TEST_F(Cli, AsynchronousCheckpointsThatSkipWhenBusySayWhichTheySkipped) {
  auto r =
      run_command(named_run("skipping", {"--batch-size", "1", "--epochs", "1", "--max-steps", "60",
                                         "--checkpoint-every-steps", "1", "--async-checkpoint",
                                         "--checkpoint-when-busy", "skip"}),
                  std::chrono::seconds(180));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto run = dir / "runs" / "skipping";
  std::ifstream lines(run / "metrics.jsonl");
  int saved = 0, skipped = 0, reports = 0;
  for (std::string line; std::getline(lines, line);) {
    const Json record = Json::parse(line);
    ++reports;
    if (record.value("checkpoint_skipped", false)) {
      ++skipped;
      EXPECT_FALSE(record.contains("checkpoint_snapshot_s")) << line;
    } else {
      ++saved;
      EXPECT_TRUE(record.contains("checkpoint_snapshot_s")) << line;
    }
  }
  EXPECT_GE(reports, 60);
  EXPECT_GE(saved, 1);
  std::cout << "checkpoints every step: " << saved << " saved, " << skipped
            << " skipped while the one before was still being written\n";
  std::optional<std::filesystem::path> latest;
  for (const auto& entry : std::filesystem::directory_iterator(run)) {
    if (entry.is_directory() && entry.path().filename().string().rfind("checkpoint_", 0) == 0 &&
        (!latest || entry.path() > *latest))
      latest = entry.path();
  }
  ASSERT_TRUE(latest);
  EXPECT_NO_THROW(Checkpoint::from_directory(*latest).verify()) << *latest;
}

// A worker killed with SIGKILL inside the first epoch, after an in-memory snapshot and before any
// checkpoint: the restarted group restores from the snapshot, not from the beginning, says so,
// and ends with the model of the run never killed, bit for bit. A run that ends leaves no
// snapshot behind.
TEST_F(Cli, AWorkerKilledAfterASnapshotRestartsFromItAndEndsAsTheStraightRun) {
  const auto snapshots = dir / "snapshots";
  auto args = [&](const std::string& name) {
    return named_run(
        name, {"--batch-size", "4", "--epochs", "1", "--seed", "4", "--snapshot-every-steps", "4",
               "--snapshot-dir", snapshots.string(), "--max-failures", "1"});
  };
  ASSERT_EQ(run_command(args("straight"), std::chrono::seconds(120)).exit_code, 0);
  const auto snapshot_folders = [&] {
    std::vector<std::filesystem::path> whole;
    std::error_code error;
    for (const auto& run : std::filesystem::directory_iterator(snapshots, error)) {
      for (const auto& s : std::filesystem::directory_iterator(run.path(), error)) {
        if (s.path().filename().string().rfind("snapshot_", 0) == 0 &&
            std::filesystem::exists(s.path() / "checkpoint" / "meta.json", error))
          whole.push_back(s.path());
      }
    }
    return whole;
  };
  EXPECT_TRUE(snapshot_folders().empty());
  cohort::testing::Process driver(args("killed"));
  const auto pids = wait_until_training(driver);
  ASSERT_EQ(pids.size(), 2u);
  // Polled, with a deadline: a snapshot is whole on the node once its meta.json is in.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (snapshot_folders().empty() && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ASSERT_FALSE(snapshot_folders().empty()) << driver.output();
  ::kill(pids[1], SIGKILL);
  const auto killed = driver.wait(std::chrono::seconds(120));
  ASSERT_EQ(killed.exit_code, 0) << killed.output;
  EXPECT_NE(killed.output.find("cohort: restoring from the in-memory snapshot snapshot_"),
            std::string::npos)
      << killed.output;
  const auto result = result_of("killed");
  ASSERT_EQ(result["failures"].size(), 1u) << result.dump();
  EXPECT_EQ(result["failures"][0]["restored_from"], "snapshot") << result.dump();
  // The epoch's train loss counts the steps after the restore only; the model is the same.
  const auto straight = result_of("straight");
  EXPECT_EQ(result["steps"], straight["steps"]);
  EXPECT_EQ(result["test_loss"].get<double>(), straight["test_loss"].get<double>());
  EXPECT_EQ(result["test_accuracy"].get<double>(), straight["test_accuracy"].get<double>());
  EXPECT_TRUE(snapshot_folders().empty());
}

TEST_F(Cli, TuneSearchesTheParamSpaceAndNamesTheBestTrial) {
  auto r = run_command({cli_path(),
                        "tune",
                        "--storage-path",
                        (dir / "runs").string(),
                        "--name",
                        "search",
                        "--data-dir",
                        data.string(),
                        "--workers",
                        "1",
                        "--epochs",
                        "2",
                        "--batch-size",
                        "16",
                        "--param",
                        "lr=loguniform:1e-3:1e-1",
                        "--param",
                        "optimizer=choice:sgd,adam",
                        "--samples",
                        "3",
                        "--scheduler",
                        "asha",
                        "--reduction-factor",
                        "2",
                        "--max-concurrent",
                        "2",
                        "--cpus",
                        "2",
                        "--quiet"},
                       std::chrono::seconds(240));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("trials 3 | terminated 3"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("best test_accuracy "), std::string::npos) << r.output;
  const auto state = Json::parse(
      cohort::testing::read_text((dir / "runs" / "search" / "experiment_state.json").string()));
  ASSERT_EQ(state["trials"].size(), 3u);
  for (const auto& trial : state["trials"]) {
    const double lr = trial["config"]["lr"].get<double>();
    EXPECT_GE(lr, 1e-3);
    EXPECT_LE(lr, 1e-1);
    EXPECT_TRUE(trial["config"]["optimizer"] == "sgd" || trial["config"]["optimizer"] == "adam")
        << trial.dump();
    // Each trial is a run of its own, with the sampled lr in its train_loop_config.
    const auto result = Json::parse(cohort::testing::read_text(
        (dir / "runs" / "search" / trial["name"].get<std::string>() / "result.json").string()));
    EXPECT_EQ(result["config"]["lr"], trial["config"]["lr"]);
  }
  EXPECT_TRUE(std::filesystem::exists(dir / "runs" / "search" / "trials.csv"));
}

TEST_F(Cli, TuneRejectsABadSearchWithAUsageError) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases{
      {{"--param", "depth=uniform:0:1"},
       "--param depth: not a tunable option; tunable are model, epochs"},
      {{"--param", "lr=loguniform:0:1"}, "loguniform needs 0 < lower"},
      {{"--param", "lr"}, "must be NAME=DOMAIN"},
      {{"--param", "lr=uniform:0:1", "--scheduler", "pbt"}, "unknown --scheduler 'pbt'"},
      {{"--param", "lr=uniform:0:1", "--mode", "best"}, "--mode 'best' must be max or min"},
      {{}, "give at least one --param"},
  };
  for (const auto& [args, fragment] : cases) {
    std::vector<std::string> argv{
        cli_path(), "tune", "--storage-path", (dir / "runs").string(), "--data-dir", data.string()};
    argv.insert(argv.end(), args.begin(), args.end());
    auto r = run_command(argv, std::chrono::seconds(30));
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find(fragment), std::string::npos)
        << "expected '" << fragment << "' in: " << r.output;
  }
}

TEST_F(Cli, AKilledTuneResumesWhenRunAgain) {
  const std::vector<std::string> argv{
      cli_path(),         "tune",   "--storage-path", (dir / "runs").string(),
      "--name",           "killed", "--data-dir",     data.string(),
      "--workers",        "1",      "--epochs",       "3",
      "--batch-size",     "16",     "--param",        "lr=grid:0.01,0.02,0.03",
      "--max-concurrent", "1",      "--cpus",         "1"};
  const auto experiment = dir / "runs" / "killed";
  {
    cohort::testing::Process tuner(argv);
    // trial_00000 has finished, and trial_00001 has committed its first epoch's checkpoint.
    ASSERT_TRUE(tuner.wait_for_line("trial_00001 iter 1:", std::chrono::seconds(120)))
        << tuner.output();
    ::kill(tuner.pid(), SIGKILL);
    tuner.wait(std::chrono::seconds(10));
  }
  const std::string finished_before =
      cohort::testing::read_text((experiment / "trial_00000" / "metrics.jsonl").string());
  auto again = run_command(argv, std::chrono::seconds(240));
  ASSERT_EQ(again.exit_code, 0) << again.output;
  EXPECT_NE(again.output.find("restoring experiment " + experiment.string() +
                              ": 1 finished trial(s) kept, 1 to run or resume"),
            std::string::npos)
      << again.output;
  EXPECT_EQ(again.output.find("trial_00000 RUNNING"), std::string::npos)
      << again.output;  // not rerun
  EXPECT_EQ(cohort::testing::read_text((experiment / "trial_00000" / "metrics.jsonl").string()),
            finished_before);
  // The interrupted trial went on from its checkpoint, not from its first epoch.
  EXPECT_NE(
      cohort::testing::read_text((experiment / "trial_00001" / "logs" / "rank-0.log").string())
          .find("resuming after epoch 1"),
      std::string::npos);
  const auto state =
      Json::parse(cohort::testing::read_text((experiment / "experiment_state.json").string()));
  ASSERT_EQ(state["trials"].size(), 3u);
  for (const auto& trial : state["trials"]) {
    EXPECT_EQ(trial["status"], "TERMINATED") << trial.dump();
    EXPECT_EQ(trial["iterations"], 3) << trial.dump();
  }
}

TEST(CliFashionMnist, ShortRunOnTheRealDataSet) {
  if (!std::filesystem::exists("/usr/share/datasets/fashion-mnist"))
    GTEST_SKIP() << "no Fashion-MNIST";
  auto dir = cohort::testing::temp_dir("cli_fashion");
  auto r = run_command({cli_path(), "train", "--storage-path", dir.string(), "--name", "short",
                        "--max-steps", "40", "--test-examples", "2000"},
                       std::chrono::seconds(180));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto result = Json::parse(cohort::testing::read_text((dir / "short" / "result.json").string()));
  EXPECT_EQ(result["steps"], 40);
  // 40 steps of SGD on Fashion-MNIST already beat chance (0.1) by far.
  EXPECT_GT(result["test_accuracy"].get<double>(), 0.5);
  std::filesystem::remove_all(dir);
}

// --data: a user's own image folder (class per sub-folder) and CSV train the zoo's models, with a
// seeded held-out test split; bad data and conflicting flags are one line each, exit 2, before
// any worker starts.
TEST_F(Cli, YourOwnImageFolderAndCsvTrainAndBadDataIsNamed) {
  const auto images = cohort::testing::write_tiny_image_folder(dir / "images", 3, 60, 28);
  auto r = train({"--data", "images:" + images.string(), "--model", "cnn", "--workers", "2",
                  "--batch-size", "8", "--epochs", "3", "--seed", "1", "--name", "images"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // What was read, said once (the workers run the same command line).
  const std::string said = "data: images " + images.string() +
                           ": 162 train and 18 test rows, 3 classes, 3x28x28 (class0, class1, "
                           "class2)";
  ASSERT_NE(r.output.find(said), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find(said, r.output.find(said) + 1), std::string::npos) << r.output;
  Json result = result_of("images");
  EXPECT_EQ(result["epochs"], 3);
  EXPECT_GT(result["test_accuracy"].get<double>(), 0.6) << "3 classes: chance is 0.33";
  // The workers built the model for the data: 3 colour channels, 3 classes.
  const Json config = result["config"];
  EXPECT_EQ(config["model_options"]["in_channels"], 3);
  EXPECT_EQ(config["model_options"]["num_classes"], 3);

  const auto csv = cohort::testing::write_tiny_csv(dir / "rows.csv", 400, 6, 3);
  r = train({"--data", "csv:" + csv.string(), "--label", "label", "--model", "mlp", "--workers",
             "2", "--batch-size", "16", "--epochs", "3", "--optimizer", "adam", "--lr", "0.01",
             "--name", "csv", "--quiet"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_GT(result_of("csv")["test_accuracy"].get<double>(), 0.7) << "3 classes: chance is 0.33";

  std::filesystem::create_directories(dir / "no_classes");
  std::ofstream(dir / "ragged.csv") << "a,b,label\n1,2,0\n3,1\n";
  const std::string images_spec = "images:" + images.string(), csv_spec = "csv:" + csv.string();
  for (const auto& [args, fragment] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--data", "parquet:" + csv.string()}, "unknown scheme 'parquet'"},
           {{"--data", csv_spec, "--model", "mlp"}, "name its class column"},
           {{"--data", csv_spec, "--label", "label"}, "only the mlp reads; use --model mlp"},
           {{"--data", csv_spec, "--label", "y", "--model", "mlp"}, "has no column 'y'"},
           {{"--data", "csv:" + (dir / "ragged.csv").string(), "--label", "label", "--model",
             "mlp"},
            "ragged.csv:3 has 2 fields where the header has 3"},
           {{"--data", "images:" + (dir / "no_classes").string()}, "has no class sub-folders"},
           {{"--data", images_spec, "--data-dir", data.string()}, "both name the data: give one"},
           {{"--data", images_spec, "--label", "label"}, "use it with --data csv:FILE"},
           {{"--data", images_spec, "--model", "cnn", "--image-size", "30"},
            "choose another --image-size"},
           {{"--data-dir", data.string(), "--image-size", "32"},
            "MNIST-format data has 28x28 images"},
           {{"--data", images_spec, "--test-size", "1.5"}, "must be a fraction between 0 and 1"}}) {
    auto bad = train(args, std::chrono::seconds(60));
    EXPECT_EQ(bad.exit_code, 2) << bad.output;
    EXPECT_NE(bad.output.find(fragment), std::string::npos) << bad.output;
    EXPECT_EQ(bad.output.find("started"), std::string::npos) << "no worker starts on bad input";
  }
}

// The GPT on a file's bytes: it learns the text under ZeRO-3, reports tokens/s, cuts its heads
// over a tensor-parallel group as one worker trains, and pipelines with its embeddings tied (the
// first and the last stage each step a copy) and untied.
TEST_F(Cli, AGptLearnsATextUnderEveryPlanFamily) {
  std::string text;
  for (int i = 0; i < 400; ++i) text += "the quick brown fox jumps over the lazy dog. ";
  const auto file = dir / "book.txt";
  std::ofstream(file, std::ios::binary) << text;
  const std::vector<std::string> gpt{
      "--model", "gpt",  "--data", "text:" + file.string(), "--seed", "5", "--quiet", "--optimizer",
      "adamw",   "--lr", "0.01",   "--batch-size",          "8"};
  const std::vector<std::string> sizes{"--layers", "2", "--width",   "32",
                                       "--heads",  "4", "--context", "32"};
  // A run of the GPT of `shape` (the small one unless given) with `extra`.
  auto run = [&](const std::string& name, std::vector<std::string> extra,
                 const std::vector<std::string>& shape = {}) {
    auto args = gpt;
    args.insert(args.end(), {"--name", name});
    args.insert(args.end(), extra.begin(), extra.end());
    const auto& chosen = shape.empty() ? sizes : shape;
    args.insert(args.end(), chosen.begin(), chosen.end());
    return train(args, std::chrono::seconds(300));
  };
  auto r = run("zero3", {"--workers", "2", "--epochs", "3", "--zero-stage", "3"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const Json result = result_of("zero3");
  // From log(256) = 5.5 nats a byte (uniform) to a text of 28 distinct bytes in a 45-byte cycle.
  EXPECT_LT(result["train_loss"].get<double>(), 2.5);
  EXPECT_LT(result["test_loss"].get<double>(), 2.5);
  // Next-byte accuracy over the held-out end of the text (chance: 1 in 256).
  EXPECT_GT(result["test_accuracy"].get<double>(), 0.5);
  EXPECT_DOUBLE_EQ(result["tokens_per_second"].get<double>(),
                   result["samples_per_second"].get<double>() * 32);
  EXPECT_EQ(result["config"]["model_options"]["context"], 32);
  // Deferred initialisation: each worker initialises its shards only, to the same weights, and
  // trains as the run that built the whole model.
  r = run("zero3_deferred",
          {"--workers", "2", "--epochs", "3", "--zero-stage", "3", "--deferred-init"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const Json deferred = result_of("zero3_deferred");
  EXPECT_EQ(deferred["train_loss"].get<double>(), result["train_loss"].get<double>());
  EXPECT_EQ(deferred["test_loss"].get<double>(), result["test_loss"].get<double>());

  const std::vector<std::string> short_run{"--epochs", "1", "--max-steps", "4"};
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.end(), short_run.begin(), short_run.end());
    return extra;
  };
  ASSERT_EQ(run("one", with({"--workers", "1"})).exit_code, 0);
  r = run("tp", with({"--workers", "2", "--tp", "2"}));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NEAR(result_of("tp")["train_loss"].get<double>(),
              result_of("one")["train_loss"].get<double>(),
              1e-4 * result_of("one")["train_loss"].get<double>());
  r = run("pp_tied", with({"--workers", "2", "--pp", "2"}));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NEAR(result_of("pp_tied")["train_loss"].get<double>(),
              result_of("one")["train_loss"].get<double>(),
              1e-4 * result_of("one")["train_loss"].get<double>());
  // The checkpoint's embedding (the first stage's copy) is one worker's, to float rounding. (Not
  // every tensor: AdamW turns the float noise of the attention's key bias, whose true gradient
  // is 0, into whole steps of either sign.)
  const auto model_file = [&](const char* name) {
    return safetensors::read(dir / "runs" / name / "checkpoint_000000" / "model.safetensors");
  };
  const auto tied_pp = model_file("pp_tied"), tied_one = model_file("one");
  ASSERT_EQ(tied_pp.size(), tied_one.size());
  EXPECT_EQ(tied_pp.count("head.weight"), 0u);
  EXPECT_TRUE(torch::allclose(tied_pp.at("token_embedding.weight"),
                              tied_one.at("token_embedding.weight"), 1e-3, 1e-5));
  // One worker resumes it: the embedding's optimizer state, in both stages' parts, is found once.
  r = run("pp_tied", {"--workers", "1", "--epochs", "2", "--max-steps", "8"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(cohort::testing::read_text((dir / "runs" / "pp_tied" / "logs" / "rank-0.log").string())
                .find("re-cutting the optimizer state of checkpoint_000000 from --pp 2 --tp 1 "
                      "--schedule 1f1b to a run without a mesh"),
            std::string::npos);
  // Under ZeRO the stages sum their shards' gradients: the same training again.
  r = run("pp_tied_zero", with({"--workers", "2", "--pp", "2", "--zero-stage", "2"}));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NEAR(result_of("pp_tied_zero")["train_loss"].get<double>(),
              result_of("one")["train_loss"].get<double>(),
              1e-4 * result_of("one")["train_loss"].get<double>());
  ASSERT_EQ(run("one_untied", with({"--workers", "1", "--untie-embeddings"})).exit_code, 0);
  r = run("pp", with({"--workers", "2", "--pp", "2", "--untie-embeddings"}));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NEAR(result_of("pp")["train_loss"].get<double>(),
              result_of("one_untied")["train_loss"].get<double>(),
              1e-4 * result_of("one_untied")["train_loss"].get<double>());

  for (const auto& [args, fragment] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--width", "100", "--heads", "3"}, "width 100 is not divisible by heads 3"},
           {{"--workers", "2", "--tp", "2", "--heads", "3", "--width", "96"},
            "--tp 2 must divide the gpt's 3 heads"},
           {{"--context", "10000"}, "too few for 2 rows of 10000 tokens"}}) {
    // The flags given replace the small GPT's sizes.
    auto bad = run("bad", {}, [&] {
      auto shape = args;
      for (size_t i = 0; i + 1 < sizes.size(); i += 2)
        if (std::find(args.begin(), args.end(), sizes[i]) == args.end())
          shape.insert(shape.end(), {sizes[i], sizes[i + 1]});
      return shape;
    }());
    EXPECT_EQ(bad.exit_code, 2) << bad.output;
    EXPECT_NE(bad.output.find(fragment), std::string::npos) << bad.output;
  }
  auto bad = train({"--model", "gpt", "--data-dir", data.string()});
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.output.find("--model gpt reads tokens: give --data text:FILE"), std::string::npos)
      << bad.output;
  bad = train({"--model", "mlp", "--data", "text:" + file.string()});
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.output.find("only the language model reads"), std::string::npos) << bad.output;
}

}  // namespace
}  // namespace cohort

#include "cohort/train/checkpoint.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <fstream>
#include <sstream>
#include <string>
#include <type_traits>

#include "cohort/error.h"
#include "cohort/models/zoo.h"
#include "cohort/optim/flat_optimizer.h"
#include "cohort/optim/state_dict.h"
#include "cohort/train/memory_estimate.h"
#include "support/expect.h"
#include "support/subprocess.h"
#include "support/tiny_mnist.h"
#include "train/checkpoint_manager.h"
#include "train/progress.h"
#include "train/run_files.h"
#include "train/run_recorder.h"

namespace cohort {
namespace {

// The key of a parameter's optimizer state: its TensorImpl, printed in libtorch 1.13, the pointer
// itself in 2.x.
template <typename StateMap>
typename StateMap::key_type state_key(const StateMap&, const torch::Tensor& parameter) {
  if constexpr (std::is_same_v<typename StateMap::key_type, std::string>) {
    std::ostringstream key;
    key << parameter.unsafeGetTensorImpl();
    return key.str();
  } else {
    return parameter.unsafeGetTensorImpl();
  }
}

using cohort::testing::expect_error;

class CheckpointTest : public ::testing::Test {
 protected:
  std::filesystem::path dir = cohort::testing::temp_dir("checkpoint");
  void TearDown() override { std::filesystem::remove_all(dir); }

  std::filesystem::path make_checkpoint(int64_t index, const Json& metrics) {
    auto path = dir / checkpoint_name(index);
    std::filesystem::create_directories(path);
    write_atomically(path / "weights.bin", std::string(100, static_cast<char>('a' + index)));
    write_atomically(path / kMetaFile, Json{{"metrics", metrics}}.dump());
    write_manifest(path);
    return path;
  }
};

TEST_F(CheckpointTest, SafetensorsRoundTripEveryDtype) {
  std::map<std::string, at::Tensor> tensors{
      {"f32", torch::randn({3, 4})},
      {"f64", torch::randn({2}, torch::kDouble)},
      {"f16", torch::randn({5}).to(torch::kHalf)},
      {"bf16", torch::randn({5}).to(torch::kBFloat16)},
      {"i64", torch::arange(7, torch::kLong)},
      {"u8", torch::arange(9, torch::kLong).to(torch::kByte).view({3, 3})},
      {"scalar", torch::tensor(3.5)}};
  safetensors::write(dir / "t.safetensors", tensors, {{"format", "pt"}});
  auto back = safetensors::read(dir / "t.safetensors");
  ASSERT_EQ(back.size(), tensors.size());
  for (const auto& [name, t] : tensors) {
    EXPECT_EQ(back[name].scalar_type(), t.scalar_type()) << name;
    EXPECT_TRUE(torch::equal(back[name], t)) << name;
  }
}

TEST_F(CheckpointTest, PlainNumpyReadsTheModelFile) {
  if (!std::filesystem::exists("/usr/bin/python3")) GTEST_SKIP() << "no python3";
  auto model = models::create_model("cnn");
  train::save_model(*model, dir / "model.safetensors");
  // The format as Python users read it without torch: 8-byte length, JSON header, raw data.
  const std::string script =
      "import json, struct, sys, numpy as np\n"
      "b = open(sys.argv[1], 'rb').read()\n"
      "n = struct.unpack('<Q', b[:8])[0]\n"
      "h = json.loads(b[8:8 + n])\n"
      "info = h['fc2.weight']\n"
      "s, e = info['data_offsets']\n"
      "a = np.frombuffer(b[8 + n + s:8 + n + e], dtype='<f4').reshape(info['shape'])\n"
      "print(repr(float(a.astype(np.float64).sum())), a.shape)\n";
  write_atomically(dir / "read.py", script);
  auto r = cohort::testing::run_command(
      {"/usr/bin/python3", (dir / "read.py").string(), (dir / "model.safetensors").string()},
      std::chrono::seconds(60));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto named = model->named_parameters();
  const double expected = named["fc2.weight"].to(torch::kDouble).sum().item<double>();
  EXPECT_NEAR(std::stod(r.output), expected, 1e-9) << r.output;
  EXPECT_NE(r.output.find("(10, 128)"), std::string::npos) << r.output;
}

TEST_F(CheckpointTest, LoadModelRestoresWeightsAndBuffersAndNamesMismatches) {
  auto a = models::create_model("resnet18");
  auto b = models::create_model("resnet18");
  a->named_buffers()["stem.1.running_mean"].fill_(0.25);
  train::save_model(*a, dir / "model.safetensors");
  train::load_model(*b, dir / "model.safetensors");
  auto pb = b->named_parameters();
  for (const auto& p : a->named_parameters())
    EXPECT_TRUE(torch::equal(p.value(), pb[p.key()])) << p.key();
  EXPECT_TRUE(torch::equal(b->named_buffers()["stem.1.running_mean"],
                           a->named_buffers()["stem.1.running_mean"]));

  auto other = models::create_model("cnn");
  expect_error<UsageError>([&] { train::load_model(*other, dir / "model.safetensors"); },
                           "has no tensor 'conv1.weight'");
  auto truncated = dir / "cut.safetensors";
  std::filesystem::copy_file(dir / "model.safetensors", truncated);
  std::filesystem::resize_file(truncated, std::filesystem::file_size(truncated) / 2);
  expect_error<UsageError>([&] { train::load_model(*b, truncated); }, "whose 'data_offsets' [");
  expect_error<UsageError>([&] { train::load_model(*b, truncated); },
                           "is no byte range inside the");
}

// Loading reads each tensor straight into the model's own; a model of another dtype (bf16
// weights from an fp32 checkpoint) takes the file's values converted, as copy_ converts them.
TEST_F(CheckpointTest, LoadModelConvertsIntoAModelOfAnotherDtype) {
  auto a = models::create_model("cnn");
  train::save_model(*a, dir / "model.safetensors");
  auto b = models::create_model("cnn");
  b->to(torch::kBFloat16);
  train::load_model(*b, dir / "model.safetensors");
  auto pb = b->named_parameters();
  for (const auto& p : a->named_parameters()) {
    ASSERT_EQ(pb[p.key()].scalar_type(), torch::kBFloat16) << p.key();
    EXPECT_TRUE(torch::equal(pb[p.key()], p.value().to(torch::kBFloat16))) << p.key();
  }
  auto c = models::create_model("cnn");
  train::load_model(*c, dir / "model.safetensors");
  auto pc = c->named_parameters();
  for (const auto& p : a->named_parameters())
    EXPECT_TRUE(torch::equal(pc[p.key()], p.value())) << p.key();
}

// A safetensors file whose header lies (a checkpoint altered, or a file from elsewhere) is a
// UsageError naming the file and the field, read before anything is allocated for it.
TEST_F(CheckpointTest, AMalformedSafetensorsHeaderNamesTheFieldBeforeAnyAllocation) {
  const auto file = dir / "bad.safetensors";
  const auto write_file = [&](const std::string& header, uint64_t announced) {
    std::ofstream out(file, std::ios::binary | std::ios::trunc);
    for (int i = 0; i < 8; ++i) out.put(static_cast<char>((announced >> (8 * i)) & 0xff));
    out << header << std::string(16, '\0');
  };
  const std::string f32 = R"("dtype": "F32", )";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"[1, 2]", "has a header that is no JSON object"},
      {"{\"w\": 5}", "has tensor 'w' described by no object"},
      {R"({"w": {"dtype": 7, "shape": [2], "data_offsets": [0, 8]}})",
       "has tensor 'w' whose 'dtype' is missing or no string"},
      {R"({"w": {"dtype": "X9", "shape": [2], "data_offsets": [0, 8]}})", "unsupported dtype X9"},
      {"{\"w\": {" + f32 + R"("shape": [-1], "data_offsets": [0, 4]}})",
       "whose 'shape' holds -1, not a size"},
      {"{\"w\": {" + f32 + R"("shape": 2, "data_offsets": [0, 8]}})",
       "whose 'shape' is missing or no array"},
      {"{\"w\": {" + f32 + R"("shape": [4611686018427387904, 4], "data_offsets": [0, 16]}})",
       "whose 'data_offsets' [0, 16] does not hold its shape [4611686018427387904, 4] of F32"},
      {"{\"w\": {" + f32 + R"("shape": [2], "data_offsets": [8, 0]}})",
       "whose 'data_offsets' [8, 0] is no byte range inside the 16 bytes of data"},
      {"{\"w\": {" + f32 + R"("shape": [2], "data_offsets": [0, 9000]}})",
       "[0, 9000] is no byte range inside the 16 bytes"},
      {"{\"w\": {" + f32 + R"("shape": [2], "data_offsets": "0-8"}})",
       "whose 'data_offsets' is missing or not two integers"},
      {R"({"__metadata__": {"format": 1}})", "has '__metadata__' entry 'format' that is no string"},
  };
  for (const auto& [header, fragment] : cases) {
    write_file(header, header.size());
    expect_error<UsageError>([&] { safetensors::read_header(file); }, fragment);
    expect_error<UsageError>([&] { safetensors::read(file); }, fragment);
  }
  write_file("{}", uint64_t{1} << 60);
  expect_error<UsageError>([&] { safetensors::read(file); },
                           "announces a header of 1152921504606846976 bytes, over the cap of "
                           "104857600 (kMaxSafetensorsHeader)");
  write_file("{}", 4000);
  expect_error<UsageError>([&] { safetensors::read(file); },
                           "announces a header of 4000 bytes in a file of 26");
  const std::string good = R"({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}})";
  write_file(good, good.size());
  EXPECT_EQ(safetensors::read(file).at("w").sizes(), (std::vector<int64_t>{2, 2}));
}

TEST_F(CheckpointTest, LoadOptimizerRestoresStateAndHyperparameters) {
  auto model = torch::nn::Linear(3, 1);
  torch::optim::SGD saved(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  model->forward(torch::ones({2, 3})).sum().backward();
  saved.step();
  // A schedule lowered the lr: the resumed optimizer must go on with the lowered one.
  saved.param_groups()[0].options().set_lr(0.025);
  train::save_optimizer(saved, dir / "optimizer.pt");

  torch::optim::SGD loaded(model->parameters(), torch::optim::SGDOptions(0.5).momentum(0.1));
  train::load_optimizer(loaded, dir / "optimizer.pt");
  const auto& options =
      static_cast<const torch::optim::SGDOptions&>(loaded.param_groups()[0].options());
  EXPECT_DOUBLE_EQ(options.lr(), 0.025);
  EXPECT_DOUBLE_EQ(options.momentum(), 0.9);
  const auto key = state_key(loaded.state(), model->weight);
  ASSERT_TRUE(loaded.state().count(key));
  EXPECT_TRUE(torch::equal(
      static_cast<torch::optim::SGDParamState&>(*loaded.state()[key]).momentum_buffer(),
      static_cast<torch::optim::SGDParamState&>(*saved.state()[key]).momentum_buffer()));

  train::linear_lr_scaling(loaded, 4, 2);
  EXPECT_DOUBLE_EQ(loaded.param_groups()[0].options().get_lr(), 0.0125);
  expect_error<UsageError>([&] { train::linear_lr_scaling(loaded, 0, 2); },
                           "world sizes must be >= 1");
}

// A flat optimizer's checkpoint is its state as state files, read back a parameter at a time
// into the buffers the optimizer holds: a resumed DDP worker does not hold its state twice while
// it loads (libtorch's archive optimizer.pt is read whole beside them: the 28.6 M GPT's resumed
// workers peaked 10% above their training peak). The state still moves bit for bit.
TEST_F(CheckpointTest, AFlatOptimizersStateLoadsIntoItsBuffersWithoutASecondCopy) {
  const auto make = [](int64_t seed) {
    torch::manual_seed(seed);
    return torch::nn::Sequential(torch::nn::Linear(512, 512), torch::nn::Linear(512, 512),
                                 torch::nn::Linear(512, 512), torch::nn::Linear(512, 512));
  };
  const auto step = [](torch::nn::Sequential& net, torch::optim::Optimizer& optimizer) {
    torch::manual_seed(7);
    optimizer.zero_grad();
    net->forward(torch::randn({4, 512})).square().mean().backward();
    optimizer.step();
  };
  // The whole checkpoint, and the optimizer's part alone (a pipeline stage's).
  for (const bool alone : {false, true}) {
    SCOPED_TRACE(alone ? "save_optimizer_state" : "save_checkpoint");
    auto saved = make(1);
    optim::FlatAdamW saved_optimizer(saved->parameters(), torch::optim::AdamWOptions(1e-3));
    step(saved, saved_optimizer);
    const auto folder = dir / (alone ? "flat-alone" : "flat");
    if (alone) {
      train::save_optimizer_state(folder, saved_optimizer, *saved);
    } else {
      train::save_checkpoint(folder, *saved, saved_optimizer);
    }
    EXPECT_FALSE(std::filesystem::exists(folder / "optimizer.pt"));
    EXPECT_TRUE(train::holds_state(folder, optim::kOptimizerShardsPart));

    auto loaded = make(2);
    optim::FlatAdamW loaded_optimizer(loaded->parameters(), torch::optim::AdamWOptions(1e-3));
    step(loaded, loaded_optimizer);  // its state is allocated, as a resumed worker's is
    int64_t state_bytes = 0;
    for (const auto& p : loaded->parameters()) state_bytes += 2 * p.numel() * 4;  // Adam's m, v
    const int64_t added = train::measure_step_memory(*loaded, [&] {
      if (alone) {
        train::load_optimizer_state(folder, loaded_optimizer, *loaded);
        torch::NoGradGuard no_grad;  // the parameters come from another file (the stages')
        const auto to = loaded->parameters();
        const auto from = saved->parameters();
        for (size_t i = 0; i < to.size(); ++i) to[i].copy_(from[i]);
      } else {
        train::load_checkpoint(Checkpoint::from_directory(folder), *loaded, loaded_optimizer);
      }
    });
    EXPECT_LT(added, state_bytes / 2)
        << "loading a state of " << state_bytes << " bytes added " << added << " bytes at its peak";

    step(saved, saved_optimizer);
    step(loaded, loaded_optimizer);
    const auto a = saved->parameters();
    const auto b = loaded->parameters();
    for (size_t i = 0; i < a.size(); ++i)
      EXPECT_TRUE(torch::equal(a[i], b[i])) << "parameter " << i;
  }
}

TEST_F(CheckpointTest, ManifestNamesTheBrokenFile) {
  auto path = make_checkpoint(0, {{"loss", 1.0}});
  Checkpoint::from_directory(path).verify();
  {
    std::fstream f(path / "weights.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(10);
    f.put('Z');
  }
  expect_error<UsageError>([&] { Checkpoint::from_directory(path).verify(); },
                           "file weights.bin has checksum");
  std::filesystem::resize_file(path / "weights.bin", 40);
  expect_error<UsageError>([&] { Checkpoint::from_directory(path).verify(); },
                           "has 40 bytes, the manifest says 100 (truncated)");
  std::filesystem::remove(path / "weights.bin");
  expect_error<UsageError>([&] { Checkpoint::from_directory(path).verify(); },
                           "file weights.bin is missing");
  // A manifest that lies: each a UsageError naming it, never another exception.
  for (const auto& [manifest, fragment] : std::vector<std::pair<std::string, std::string>>{
           {"[]", "manifest.json lists no files (no object \"files\")"},
           {R"({"files": []})", "lists no files"},
           {R"({"files": {"meta.json": 5}})", "describes meta.json without a size"},
           {R"({"files": {"meta.json": {"size": -1, "crc32": "0"}}})", "without a size"},
           {R"({"files": {"../weights.bin": {"size": 1, "crc32": "0"}}})",
            "names '../weights.bin', which is no file inside the checkpoint"},
           {R"({"files": {"/etc/hostname": {"size": 1, "crc32": "0"}}})", "names '/etc/hostname'"},
       }) {
    std::ofstream(path / kManifestFile) << manifest;
    expect_error<UsageError>([&] { Checkpoint::from_directory(path).verify(); }, fragment);
  }
  std::filesystem::remove(path / kManifestFile);
  expect_error<UsageError>([&] { Checkpoint::from_directory(path).verify(); },
                           "not completely written");
}

// A folder renamed durably arrives whole under its new name; what cannot be flushed is named.
TEST_F(CheckpointTest, ADurableRenameMovesAFolderWholeAndNamesWhatFails) {
  const auto staging = dir / "staging";
  std::filesystem::create_directories(staging / "inner");
  std::ofstream(staging / "inner" / "part.bin") << "payload";
  rename_durably(staging, dir / "committed");
  EXPECT_FALSE(std::filesystem::exists(staging));
  EXPECT_EQ(cohort::testing::read_text((dir / "committed" / "inner" / "part.bin").string()),
            "payload");
  expect_error<RuntimeError>([&] { rename_durably(dir / "absent", dir / "elsewhere"); },
                             "cannot open " + (dir / "absent").string() + " to flush it to disk");
  std::filesystem::create_directories(dir / "full" / "x");
  std::ofstream(dir / "file") << "f";
  expect_error<RuntimeError>(
      [&] { rename_durably(dir / "file", dir / "full"); },
      "cannot rename " + (dir / "file").string() + " to " + (dir / "full").string());
}

// A history appended line by line keeps every line whole; what cannot be appended to is named.
TEST_F(CheckpointTest, AppendedLinesOnlyGrowTheFileAndAFailureIsNamed) {
  const auto log = dir / "history.jsonl";
  append_line(log, R"({"a":1})");
  append_line(log, R"({"a":2})");
  EXPECT_EQ(cohort::testing::read_text(log.string()), "{\"a\":1}\n{\"a\":2}\n");
  EXPECT_EQ(read_jsonl(log).size(), 2u);
  expect_error<RuntimeError>([&] { append_line(dir, "x"); },
                             "cannot open " + dir.string() + " to append to it");
}

// A process killed while it appends to a run's metrics.jsonl (rank 0's driver, say) leaves every
// line it had appended before; a resumed run ends the cut line and goes on after them.
TEST_F(CheckpointTest, AKillDuringAnAppendLeavesEveryEarlierLineAndAResumeGoesOnAfterThem) {
  const auto run_dir = dir / "run";
  std::filesystem::create_directories(run_dir);
  const auto log = run_dir / "metrics.jsonl";
  // Long lines, so that the kill is likely to land inside one's write or fsync.
  const std::string padding(256 * 1024, 'x');
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    for (int64_t i = 0;; ++i)
      append_line(log, Json{{"training_iteration", i + 1}, {"pad", padding}}.dump());
  }
  // Killed once it has appended at least 20 lines (or at the deadline, which fails below).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < deadline) {
    std::error_code error;
    if (std::filesystem::file_size(log, error) > 20 * (padding.size() + 40) && !error) break;
    ::usleep(1000);  // polling the file's size, not waiting for the child
  }
  ::kill(child, SIGKILL);
  int status = 0;
  ::waitpid(child, &status, 0);
  ASSERT_TRUE(WIFSIGNALED(status));
  // Every whole line is the one appended in its place; what follows the last is at most a part.
  const std::string text = cohort::testing::read_text(log.string());
  std::vector<std::string> whole;
  size_t begin = 0;
  for (size_t end; (end = text.find('\n', begin)) != std::string::npos; begin = end + 1)
    whole.push_back(text.substr(begin, end - begin));
  ASSERT_GE(whole.size(), 20u);
  for (size_t i = 0; i < whole.size(); ++i) {
    const auto record = Json::parse(whole[i]);
    EXPECT_EQ(record.at("training_iteration"), static_cast<int64_t>(i) + 1);
    EXPECT_EQ(record.at("pad"), padding);
  }
  // The run's reader (not this file's strict one) takes the whole lines and skips a cut one.
  EXPECT_EQ(cohort::read_jsonl(log).size(), whole.size());
  // Whether or not the kill landed inside a write, the file now ends inside the last line, as it
  // does when it does (a partial write).
  std::filesystem::resize_file(log, begin - padding.size() / 2);
  whole.pop_back();
  EXPECT_EQ(cohort::read_jsonl(log).size(), whole.size());
  // A later start of the same run (a launcher's restart) ends the cut line, keeps the history
  // before it and goes on after it.
  train::Console console(0);
  train::RunRecorder recorder(RunConfig{.name = "run", .storage_path = dir, .verbose = 0}, "run",
                              Json::object(), console);
  recorder.resume_point(/*restarted=*/true);
  std::string driver_error;
  recorder.on_report(Json{{"type", "report"}, {"rank", 0}, {"metrics", {{"loss", 0.5}}}},
                     driver_error);
  const auto records = cohort::read_jsonl(log);
  ASSERT_EQ(records.size(), whole.size() + 1);
  EXPECT_EQ(records.back().at("training_iteration"), static_cast<int64_t>(whole.size()) + 1);
  EXPECT_EQ(records.back().at("loss"), 0.5);
}

TEST_F(CheckpointTest, KeepsTheBestByScoreAndAlwaysTheLatest) {
  train::CheckpointManager manager(dir, {.num_to_keep = 2, .checkpoint_score_attribute = "acc"});
  const std::vector<double> scores{0.5, 0.9, 0.7, 0.8, 0.6};
  for (size_t i = 0; i < scores.size(); ++i) {
    manager.add(make_checkpoint(static_cast<int64_t>(i), {{"acc", scores[i]}}),
                {{"acc", scores[i]}});
  }
  // Best two (0.9 and 0.8) plus the latest (0.6); the worse newer ones never pushed out a better.
  std::vector<int64_t> kept;
  for (const auto& [c, m] : manager.best()) kept.push_back(checkpoint_index(c.path()));
  EXPECT_EQ(kept, (std::vector<int64_t>{1, 3, 4}));
  EXPECT_FALSE(std::filesystem::exists(dir / checkpoint_name(0)));
  EXPECT_FALSE(std::filesystem::exists(dir / checkpoint_name(2)));
  EXPECT_EQ(checkpoint_index(manager.latest()->path()), 4);
  EXPECT_EQ(manager.next_index(), 5);
  auto snapshot = read_json(dir / kCheckpointManagerFile);
  EXPECT_EQ(snapshot["checkpoints"].size(), 3u);
}

TEST_F(CheckpointTest, MinOrderAndRecencyWithoutAScore) {
  train::CheckpointManager by_loss(
      dir,
      {.num_to_keep = 1, .checkpoint_score_attribute = "loss", .checkpoint_score_order = "min"});
  by_loss.add(make_checkpoint(0, {{"loss", 0.3}}), {{"loss", 0.3}});
  by_loss.add(make_checkpoint(1, {{"loss", 0.1}}), {{"loss", 0.1}});
  by_loss.add(make_checkpoint(2, {{"loss", 0.2}}), {{"loss", 0.2}});
  EXPECT_EQ(checkpoint_index(by_loss.best().front().first.path()), 1);
  EXPECT_FALSE(std::filesystem::exists(dir / checkpoint_name(0)));
  EXPECT_THROW(train::CheckpointManager(dir, {.checkpoint_score_order = "best"}), UsageError);
  expect_error<UsageError>(
      [&] {
        by_loss.check_score_attribute({{"acc", 1}});
      },
      "'loss' is not among the reported metrics [acc]");
}

TEST_F(CheckpointTest, AdoptingSkipsACorruptLatestWithAWarning) {
  make_checkpoint(0, {{"step", 1}});
  make_checkpoint(1, {{"step", 2}});
  auto broken = make_checkpoint(2, {{"step", 3}});
  std::filesystem::resize_file(broken / "weights.bin", 3);
  std::filesystem::create_directories(dir / checkpoint_name(3));  // a crash before the manifest
  train::CheckpointManager manager(dir, {});
  auto warnings = manager.adopt_existing();
  EXPECT_EQ(warnings.size(), 2u);
  EXPECT_EQ(checkpoint_index(manager.latest()->path()), 1);
  EXPECT_EQ(manager.latest()->metrics()["step"], 2);
  // New checkpoints never reuse a number that is on disk.
  EXPECT_EQ(manager.next_index(), 4);
}

}  // namespace
}  // namespace cohort

// The checkpointer of parts with state (train::save_state, load_state): a part sharded over N
// ranks loads into the pieces M ranks hold; what the files lack, or a part refuses, is named.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "cohort/error.h"
#include "cohort/optim/flat_optimizer.h"
#include "cohort/optim/loss_scaler.h"
#include "cohort/optim/lr_scheduler.h"
#include "cohort/optim/state_dict.h"
#include "cohort/train/checkpoint.h"
#include "support/expect.h"
#include "support/local_group.h"
#include "support/tiny_mnist.h"

namespace cohort::train {
namespace {

// Rank `rank` of `ranks`' piece of two vectors ("w" of 10 elements, "b/m" of 7: the pieces split
// them unevenly), and a step count: the state of a part that shards its tensors as ZeRO does.
class ShardedVectors : public optim::Stateful {
 public:
  ShardedVectors(int rank, int ranks) : rank_(rank), ranks_(ranks) {
    for (const auto& [name, numel] : kTensors) {
      const auto [begin, end] = range(numel);
      pieces_[name] = at::zeros({end - begin});
    }
  }
  // Sets every element to its index in the whole tensor plus `base` (by tensor).
  void fill(double base) {
    for (auto& [name, piece] : pieces_) {
      const auto [begin, end] = range(kTensors.at(name));
      piece.copy_(at::arange(begin, end, at::kFloat) + base + (name == "w" ? 0 : 100));
    }
    steps_ = static_cast<int64_t>(base);
  }

  optim::StateDict state_dict() const override {
    optim::StateDict out;
    for (const auto& [name, piece] : pieces_) {
      out.tensors[name] = {
          .values = piece, .offset = range(kTensors.at(name)).first, .numel = kTensors.at(name)};
    }
    out.values = {{"steps", steps_}, {"kind", "vectors"}};
    out.shard = rank_;
    out.shards = ranks_;
    return out;
  }
  void check_state(const Json& values) const override {
    if (values.value("kind", "") != "vectors") {
      throw UsageError("the checkpoint holds " + values.value("kind", std::string("?")) +
                       ", not vectors");
    }
  }
  void load_state_dict(const optim::StateDict& state) override {
    for (auto& [name, piece] : pieces_) piece.copy_(state.tensors.at(name).values);
    steps_ = state.values.at("steps").get<int64_t>();
  }

  int64_t steps() const { return steps_; }
  const at::Tensor& piece(const std::string& name) const { return pieces_.at(name); }
  std::pair<int64_t, int64_t> range(int64_t numel) const {
    return {numel * rank_ / ranks_, numel * (rank_ + 1) / ranks_};
  }

  static inline const std::map<std::string, int64_t> kTensors = {{"w", 10}, {"b/m", 7}};

 private:
  int rank_, ranks_;
  std::map<std::string, at::Tensor> pieces_;
  int64_t steps_ = 0;
};

TEST(StateFiles, APartWrittenByNRanksLoadsIntoThePiecesOfM) {
  const auto dir = cohort::testing::temp_dir("state_files");
  for (int r = 0; r < 3; ++r) {
    ShardedVectors part(r, 3);
    part.fill(5);
    save_state(dir, "vectors", part.state_dict());
  }
  EXPECT_TRUE(std::filesystem::exists(dir / "vectors_manifest.json"));
  EXPECT_TRUE(std::filesystem::exists(dir / "vectors-rank2-of-3.safetensors"));
  for (const int ranks : {1, 2, 4}) {
    for (int r = 0; r < ranks; ++r) {
      ShardedVectors loaded(r, ranks);
      load_state(dir, "vectors", loaded);
      ShardedVectors expected(r, ranks);
      expected.fill(5);
      EXPECT_EQ(loaded.steps(), 5);
      for (const auto& [name, numel] : ShardedVectors::kTensors) {
        EXPECT_TRUE(loaded.piece(name).equal(expected.piece(name)))
            << name << " of rank " << r << " of " << ranks << ": " << loaded.piece(name);
      }
    }
  }
  std::filesystem::remove_all(dir);
}

TEST(StateFiles, WhatTheFilesLackOrThePartRefusesIsNamed) {
  using cohort::testing::expect_error;
  const auto dir = cohort::testing::temp_dir("state_files_bad");
  for (int r = 0; r < 2; ++r) {
    ShardedVectors part(r, 2);
    part.fill(1);
    save_state(dir, "vectors", part.state_dict());
  }
  ShardedVectors whole(0, 1);
  expect_error<UsageError>([&] { load_state(dir, "other", whole); },
                           "has no other_manifest.json: it holds no other state");
  // A part that refuses the values is asked before any tensor is read.
  struct Refusing : ShardedVectors {
    Refusing() : ShardedVectors(0, 1) {}
    void check_state(const Json&) const override { throw UsageError("not mine"); }
    optim::StateDict state_dict() const override {
      ADD_FAILURE() << "state_dict() was asked before check_state()";
      return ShardedVectors::state_dict();
    }
  } refusing;
  expect_error<UsageError>([&] { load_state(dir, "vectors", refusing); }, "not mine");
  // One piece gone: the elements of its range are named.
  const auto second = dir / "vectors-rank1-of-2.safetensors";
  auto tensors = safetensors::read(second);
  ASSERT_EQ(tensors.erase("w/5"), 1u);
  safetensors::write(second, tensors);
  expect_error<UsageError>([&] { load_state(dir, "vectors", whole); },
                           "its vectors state covers 5 of the 10 elements [0, 10) of 'w'");
  // Pieces that overlap (the second moved onto the first): each element is read once, and the
  // elements no piece holds are named, not left as they were.
  tensors["w/0"] = at::full({5}, 7.0);
  safetensors::write(second, tensors);
  expect_error<UsageError>([&] { load_state(dir, "vectors", whole); },
                           "its vectors state covers 5 of the 10 elements [0, 10) of 'w'");
  std::filesystem::remove(second);
  expect_error<UsageError>([&] { load_state(dir, "vectors", whole); },
                           "the shard file vectors-rank1-of-2.safetensors named by "
                           "vectors_manifest.json is missing");
  // A manifest that names a file outside the checkpoint, or no file, is refused.
  const auto manifest_file = dir / "vectors_manifest.json";
  for (const auto& [files, fragment] : std::vector<std::pair<Json, std::string>>{
           {Json::array({"../../etc/passwd"}),
            "names \"../../etc/passwd\", which is no file inside"},
           {Json::array({7}), "names 7, which is no file inside the checkpoint"},
           {Json::object(), "lists no files"}}) {
    auto manifest = Json::parse(std::ifstream(manifest_file));
    manifest["files"] = files;
    std::ofstream(manifest_file) << manifest.dump();
    expect_error<UsageError>([&] { load_state(dir, "vectors", whole); },
                             "vectors_manifest.json " + fragment);
  }
  // A piece that does not lie inside its tensor is not written.
  optim::StateDict outside;
  outside.tensors["w"] = {.values = at::zeros({4}), .offset = 8, .numel = 10};
  expect_error<UsageError>([&] { save_state(dir, "outside", outside); },
                           "tensor 'w' of part 'outside' is a piece of 4 elements at 8 of a "
                           "tensor of 10");
  std::filesystem::remove_all(dir);
}

// A part of values only (a loss scaler's) is its manifest alone, and loads as any other.
TEST(StateFiles, APartOfValuesOnlyIsItsManifest) {
  const auto dir = cohort::testing::temp_dir("state_files_values");
  optim::LossScaler written({.initial_scale = 64});
  written.load_state_dict(
      {.values = {
           {"scale", 512.0}, {"clean_steps", 7}, {"hysteresis_left", 1}, {"skipped_steps", 3}}});
  save_state(dir, optim::kLossScalerPart, written.state_dict());
  EXPECT_TRUE(holds_state(dir, optim::kLossScalerPart));
  EXPECT_FALSE(holds_state(dir, optim::kLrSchedulePart));
  size_t files = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator(dir)) ++files;
  EXPECT_EQ(files, 1u);
  optim::LossScaler loaded({.initial_scale = 64});
  load_state(dir, optim::kLossScalerPart, loaded);
  EXPECT_EQ(loaded.get_scale(), 512.0);
  EXPECT_EQ(loaded.skipped_steps(), 3);
  // Another part's values are refused before anything changes.
  torch::optim::SGD sgd({torch::zeros({1}, torch::requires_grad())}, torch::optim::SGDOptions(0.1));
  optim::LrScheduler schedule(sgd, {});
  save_state(dir, optim::kLrSchedulePart, schedule.state_dict());
  std::filesystem::copy_file(dir / "lr_schedule_manifest.json", dir / "swapped_manifest.json");
  cohort::testing::expect_error<UsageError>([&] { load_state(dir, "swapped", loaded); },
                                            "loss scaler state is malformed");
  EXPECT_EQ(loaded.get_scale(), 512.0);
  std::filesystem::remove_all(dir);
}

// A whole optimizer's state moves between torch::optim's and the flat one through the
// checkpointer, and another algorithm's is refused by name.
TEST(StateFiles, AWholeOptimizersStateMovesBetweenTorchsAndTheFlatOne) {
  const auto dir = cohort::testing::temp_dir("state_files_optimizer");
  auto make_net = [] {
    std::lock_guard lock(cohort::testing::generator_mutex());
    torch::manual_seed(3);
    return torch::nn::Linear(5, 4);
  };
  auto step = [](torch::nn::Linear& net, torch::optim::Optimizer& optimizer, int seed) {
    at::Tensor x;
    {
      std::lock_guard lock(cohort::testing::generator_mutex());
      torch::manual_seed(seed);
      x = torch::randn({8, 5});
    }
    optimizer.zero_grad();
    net->forward(x).pow(2).mean().backward();
    optimizer.step();
  };
  auto names = [](torch::nn::Linear& net) {
    std::vector<std::string> out;
    for (const auto& p : net->named_parameters()) out.push_back(p.key());
    return out;
  };
  auto written = make_net();
  torch::optim::AdamW adamw(written->parameters(), torch::optim::AdamWOptions(0.02));
  step(written, adamw, 1);
  step(written, adamw, 2);
  save_state(dir, "optimizer", optim::OptimizerState(adamw, names(written)).state_dict());
  step(written, adamw, 3);

  // The same parameters after step 2, stepped by an optimizer whose state is dropped.
  auto resumed = make_net();
  {
    torch::optim::AdamW dropped(resumed->parameters(), torch::optim::AdamWOptions(0.02));
    step(resumed, dropped, 1);
    step(resumed, dropped, 2);
  }
  optim::FlatAdamW flat(resumed->parameters(), torch::optim::AdamWOptions(0.5));
  optim::OptimizerState flat_state(flat, names(resumed));
  load_state(dir, "optimizer", flat_state);
  EXPECT_DOUBLE_EQ(flat.param_groups()[0].options().get_lr(), 0.02);
  step(resumed, flat, 3);
  for (size_t i = 0; i < resumed->parameters().size(); ++i) {
    EXPECT_TRUE(torch::allclose(resumed->parameters()[i], written->parameters()[i], 1e-6, 1e-7))
        << "parameter " << i << " after the resumed step";
  }
  torch::optim::SGD sgd(resumed->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  optim::OptimizerState sgd_state(sgd, names(resumed));
  cohort::testing::expect_error<UsageError>(
      [&] { load_state(dir, "optimizer", sgd_state); },
      "the checkpoint holds adamw state ([\"exp_avg\",\"exp_avg_sq\"]); this optimizer is sgd");
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace cohort::train

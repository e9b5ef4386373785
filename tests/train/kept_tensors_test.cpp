// A live regroup's own state kept as its tensors (kept_tensors.h): saved without a file or a
// copy, and read back from those tensors only where the worker's session says they are kept.
#include "train/kept_tensors.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "cohort/error.h"
#include "cohort/optim/flat_optimizer.h"
#include "cohort/optim/state_dict.h"
#include "cohort/train/checkpoint.h"
#include "support/local_group.h"
#include "support/tiny_mnist.h"
#include "train/run_files.h"
#include "train/worker_session.h"

namespace cohort::train {
namespace {

torch::nn::Linear seeded_net(int seed) {
  std::lock_guard lock(cohort::testing::generator_mutex());
  torch::manual_seed(seed);
  return torch::nn::Linear(5, 4);
}

std::vector<std::string> names_of(const torch::nn::Linear& net) {
  std::vector<std::string> out;
  for (const auto& p : net->named_parameters()) out.push_back(p.key());
  return out;
}

void adam_step(torch::nn::Linear& net, torch::optim::Optimizer& optimizer) {
  optimizer.zero_grad();
  net->forward(torch::ones({3, 5})).pow(2).mean().backward();
  optimizer.step();
}

TEST(KeptTensors, AStateKeptAsItsTensorsLoadsFromThemInTheSessionThatKeepsThem) {
  const auto dir = cohort::testing::temp_dir("kept_tensors") / "state";
  std::filesystem::create_directories(dir);
  auto saved = seeded_net(1);
  optim::FlatAdam adam(saved->parameters(), torch::optim::AdamOptions(0.1));
  adam_step(saved, adam);
  adam_step(saved, adam);
  auto kept = std::make_shared<KeptTensorFiles>();
  {
    // What a regroup captures: the safetensors files kept, the rest written as ever.
    TensorKeeping keeping(dir, *kept);
    save_model(*saved, dir / "model.safetensors");
    save_state(dir, "optimizer", optim::OptimizerState(adam, names_of(saved)).state_dict());
  }
  EXPECT_FALSE(std::filesystem::exists(dir / "model.safetensors"));
  EXPECT_TRUE(std::filesystem::exists(dir / "optimizer_manifest.json"))
      << "a part's manifest is JSON, written as ever";
  ASSERT_EQ(kept->count("model.safetensors"), 1u);
  EXPECT_EQ(kept->at("model.safetensors").tensors.at("weight").data_ptr(), saved->weight.data_ptr())
      << "kept, not copied";

  auto loaded = seeded_net(2);
  // Outside a session that keeps them, the files are missing.
  EXPECT_THROW(load_model(*loaded, dir / "model.safetensors"), UsageError);
  auto session = std::make_unique<WorkerSession>();
  session->kept_state = {.root = std::filesystem::absolute(dir), .files = kept};
  SessionScope scope(std::move(session));
  load_model(*loaded, dir / "model.safetensors");
  optim::FlatAdam resumed(loaded->parameters(), torch::optim::AdamOptions(0.5));
  optim::OptimizerState resumed_state(resumed, names_of(loaded));
  load_state(dir, "optimizer", resumed_state);
  EXPECT_DOUBLE_EQ(resumed.param_groups()[0].options().get_lr(), 0.1);
  for (size_t i = 0; i < loaded->parameters().size(); ++i)
    EXPECT_TRUE(torch::equal(loaded->parameters()[i], saved->parameters()[i])) << "parameter " << i;
  // The next step is the same from the kept state as from the one that was kept.
  adam_step(saved, adam);
  adam_step(loaded, resumed);
  for (size_t i = 0; i < loaded->parameters().size(); ++i) {
    EXPECT_TRUE(torch::equal(loaded->parameters()[i], saved->parameters()[i]))
        << "parameter " << i << " after a step";
  }
  std::filesystem::remove_all(dir.parent_path());
}

TEST(KeptTensors, APeerIsSentThemAsTheBytesOfTheirFiles) {
  const auto dir = cohort::testing::temp_dir("kept_tensors_sent");
  auto net = seeded_net(3);
  KeptTensorFiles kept;
  CapturedFiles captured;
  {
    FileCapture capture(dir / "state", captured);
    TensorKeeping keeping(dir / "state", kept);
    save_model(*net, dir / "state" / "model.safetensors");
    write_atomically(dir / "state" / "meta.json", "{}\n");
  }
  ASSERT_EQ(captured.files().size(), 1u) << "meta.json only";
  CapturedFiles sent;
  capture_with_kept(captured, kept, sent);
  // Written out, the bytes are a model file as save_model writes it.
  merge_captured(sent, dir / "received", 0, 077);
  EXPECT_TRUE(std::filesystem::exists(dir / "received" / "meta.json"));
  auto loaded = seeded_net(4);
  load_model(*loaded, dir / "received" / "model.safetensors");
  for (size_t i = 0; i < loaded->parameters().size(); ++i)
    EXPECT_TRUE(torch::equal(loaded->parameters()[i], net->parameters()[i])) << "parameter " << i;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace cohort::train

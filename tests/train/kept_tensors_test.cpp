// A live regroup's own state kept as its tensors (kept_tensors.h): saved without a file or a
// copy, and read back from those tensors only where the worker's session says they are kept.
#include "train/kept_tensors.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "cohort/error.h"
#include "cohort/optim/flat_optimizer.h"
#include "cohort/optim/state_dict.h"
#include "cohort/train/checkpoint.h"
#include "support/local_group.h"
#include "support/tiny_mnist.h"
#include "train/live_recovery.h"
#include "train/run_files.h"
#include "train/snapshots.h"
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

// Every parameter of `a` equals `b`'s, bit for bit (`when` says after what).
void expect_same_parameters(const torch::nn::Linear& a, const torch::nn::Linear& b,
                            const std::string& when = "") {
  for (size_t i = 0; i < a->parameters().size(); ++i)
    EXPECT_TRUE(torch::equal(a->parameters()[i], b->parameters()[i])) << "parameter " << i << when;
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
  expect_same_parameters(loaded, saved);
  // The next step is the same from the kept state as from the one that was kept.
  adam_step(saved, adam);
  adam_step(loaded, resumed);
  expect_same_parameters(loaded, saved, " after a step");
  std::filesystem::remove_all(dir.parent_path());
}

// A survivor of a live regroup builds its model and optimizer again and loads its own kept state
// into them: they take the kept memory (their predecessors') as theirs, so the load copies
// nothing and touches no fresh memory (1.2 GB a rank for a 100 M-parameter Adam), and training
// goes on as from the saved ones.
TEST(KeptTensors, ASurvivorsNewModelAndOptimizerTakeTheKeptMemoryInsteadOfACopy) {
  const auto dir = cohort::testing::temp_dir("kept_tensors_adopted") / "state";
  std::filesystem::create_directories(dir);
  auto reference = seeded_net(3);
  optim::FlatAdam reference_adam(reference->parameters(), torch::optim::AdamOptions(0.1));
  for (int step = 0; step < 3; ++step) adam_step(reference, reference_adam);

  auto kept = std::make_shared<KeptTensorFiles>();
  std::vector<const void*> memory;
  {
    auto saved = seeded_net(3);
    optim::FlatAdam adam(saved->parameters(), torch::optim::AdamOptions(0.1));
    adam_step(saved, adam);
    adam_step(saved, adam);
    TensorKeeping keeping(dir, *kept);
    save_live_state(dir, *saved, adam, 0, 1, /*whole=*/true);  // DDP's: model and state shard
    for (size_t i = 0; i < saved->parameters().size(); ++i) {
      memory.push_back(saved->parameters()[i].data_ptr());
      for (const auto& value : adam.parameter_state_views(0, i).values)
        memory.push_back(value.data_ptr());
    }
  }  // the regroup ends the loop: its model and optimizer are gone, the kept tensors stay

  auto session = std::make_unique<WorkerSession>();
  session->kept_state = {.root = std::filesystem::absolute(dir), .files = kept};
  SessionScope scope(std::move(session));
  auto loaded = seeded_net(4);
  optim::FlatAdam resumed(loaded->parameters(), torch::optim::AdamOptions(0.5));
  load_checkpoint(Checkpoint::from_directory(dir), *loaded, resumed);
  std::vector<const void*> now;
  for (size_t i = 0; i < loaded->parameters().size(); ++i) {
    now.push_back(loaded->parameters()[i].data_ptr());
    for (const auto& value : resumed.parameter_state_views(0, i).values)
      now.push_back(value.data_ptr());
  }
  EXPECT_EQ(now, memory) << "the parameters and the state are the kept memory, not copies of it";
  EXPECT_DOUBLE_EQ(resumed.param_groups()[0].options().get_lr(), 0.1);
  adam_step(loaded, resumed);
  expect_same_parameters(loaded, reference, " after the third step");
  std::filesystem::remove_all(dir.parent_path());
}

// A replacement is sent a survivor's kept state straight from its memory, as the files a save
// would write but with each file's tensors in the order they lay in memory: the model and the
// optimizer state as their flat buffers, which the replacement's new model and optimizer then take
// as their own memory (no copy of what it received), and train on from exactly as the sender.
TEST(KeptTensors, APeerIsSentThemAsTheirBuffersAndTakesThemAsItsOwn) {
  const auto dir = cohort::testing::temp_dir("kept_tensors_sent");
  const auto trained = [](int steps, torch::nn::Linear& net) {
    net = seeded_net(3);
    auto adam =
        std::make_unique<optim::FlatAdam>(net->parameters(), torch::optim::AdamOptions(0.1));
    for (int step = 0; step < steps; ++step) adam_step(net, *adam);
    return adam;
  };
  cohort::testing::run_ranks(2, [&](comm::ProcessGroup& group) {
    if (group.rank() == 0) {
      torch::nn::Linear net{nullptr};
      auto adam = trained(2, net);
      KeptTensorFiles kept;
      CapturedFiles captured;
      {
        FileCapture capture(dir / "state", captured);
        TensorKeeping keeping(dir / "state", kept);
        save_live_state(dir / "state", *net, *adam, 0, 1, /*whole=*/true);
      }
      ASSERT_EQ(kept.size(), 2u) << "the model and the optimizer state's shard";
      send_files_async(group, 1, captured, {}, &kept).wait();
      return;
    }
    // As heal_from_peer takes them: safetensors files kept as tensors, the rest written.
    const auto root = std::filesystem::absolute(dir / "received");
    std::filesystem::create_directories(root);
    auto received = std::make_shared<KeptTensorFiles>();
    for (auto& [name, bytes] : receive_files(group, 0)) {
      if (std::filesystem::path(name).extension() == ".safetensors") {
        (*received)[name] = kept_from_bytes(std::move(bytes), root / name);
      } else {
        write_atomically(root / name, bytes);
      }
    }
    ASSERT_EQ(received->count("model.safetensors"), 1u);
    const auto& weight = received->at("model.safetensors").tensors.at("weight");
    const auto& bias = received->at("model.safetensors").tensors.at("bias");
    EXPECT_EQ(static_cast<const char*>(bias.data_ptr()),
              static_cast<const char*>(weight.data_ptr()) + weight.numel() * 4)
        << "the bias follows the weight, as in the sender's flat buffer";

    auto session = std::make_unique<WorkerSession>();
    session->kept_state = {.root = root, .files = received};
    SessionScope scope(std::move(session));
    auto loaded = seeded_net(4);
    optim::FlatAdam resumed(loaded->parameters(), torch::optim::AdamOptions(0.5));
    load_checkpoint(Checkpoint::from_directory(root), *loaded, resumed);
    EXPECT_EQ(loaded->weight.data_ptr(), weight.data_ptr()) << "the received bytes, not a copy";
    EXPECT_EQ(resumed.parameter_state_views(0, 0).steps, 2);
    torch::nn::Linear reference{nullptr};
    auto reference_adam = trained(3, reference);
    adam_step(loaded, resumed);
    expect_same_parameters(loaded, reference, " after the third step");
  });
  std::filesystem::remove_all(dir);
}

TEST(KeptTensors, ReceivedBytesAreKeptAsTheTensorsOfTheirFileAndCheckedFirst) {
  const auto dir = cohort::testing::temp_dir("kept_tensors_bytes");
  auto net = seeded_net(5);
  save_model(*net, dir / "model.safetensors");
  std::ifstream in(dir / "model.safetensors", std::ios::binary);
  const std::string bytes(std::istreambuf_iterator<char>(in), {});
  const auto kept = kept_from_bytes(bytes, "sent/model.safetensors");
  ASSERT_EQ(kept.tensors.size(), 2u);
  EXPECT_TRUE(torch::equal(kept.tensors.at("weight"), net->weight));
  EXPECT_TRUE(torch::equal(kept.tensors.at("bias"), net->bias));
  // Cut short: the file named, nothing read past the bytes.
  try {
    (void)kept_from_bytes(bytes.substr(0, bytes.size() - 4), "sent/model.safetensors");
    ADD_FAILURE() << "no error for a cut file";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("sent/model.safetensors"), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace cohort::train

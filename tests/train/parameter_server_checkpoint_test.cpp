// Parameter-server checkpoints: the servers' optimizer state as ZeRO's shards (by parameter
// name), which load at any number of servers, into ZeRO and into a whole optimizer (DDP's); and
// the first format (one flat range per server) still loads.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "cohort/error.h"
#include "cohort/optim/state_dict.h"
#include "cohort/parallel/parameter_server.h"
#include "cohort/train/checkpoint.h"
#include "support/expect.h"
#include "support/local_group.h"

namespace cohort::train {
namespace {

using cohort::testing::run_ranks;
using parallel::ParameterServerOptimizer;

// Sizes that split unevenly over 2 and 3 servers.
torch::nn::Sequential make_ps_net() {
  std::lock_guard lock(cohort::testing::generator_mutex());
  torch::manual_seed(33);
  return torch::nn::Sequential(torch::nn::Linear(5, 9), torch::nn::ReLU(), torch::nn::Linear(9, 2));
}

void ps_train_step(torch::nn::Sequential& net, torch::optim::Optimizer& optimizer, int seed) {
  torch::Tensor x, y;
  {
    std::lock_guard lock(cohort::testing::generator_mutex());
    torch::manual_seed(700 + seed);
    x = torch::randn({8, 5});
    y = torch::randint(0, 2, {8});
  }
  optimizer.zero_grad();
  torch::nn::functional::cross_entropy(net->forward(x), y).backward();
  optimizer.step();
}

std::unique_ptr<ParameterServerOptimizer> make_ps(torch::nn::Sequential& net, comm::ProcessGroup& g,
                                                  int servers) {
  auto adam =
      std::make_unique<torch::optim::Adam>(net->parameters(), torch::optim::AdamOptions(0.02));
  return std::make_unique<ParameterServerOptimizer>(
      net.ptr(), std::move(adam), g,
      parallel::AsyncParameterServer{.max_staleness = 1, .servers = servers});
}

// A whole Adam's state by "<parameter>/<state>", its steps and learning rate, read from `dir` on
// one rank (as a DDP run resumes).
struct WholeState {
  std::map<std::string, torch::Tensor> tensors;
  Json values;
};
WholeState load_into_whole_adam(const std::filesystem::path& dir) {
  auto net = make_ps_net();
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(0.5));
  load_checkpoint(Checkpoint::from_directory(dir), *net, adam);
  std::vector<std::string> names;
  for (const auto& p : net->named_parameters()) names.push_back(p.key());
  const auto state = optim::OptimizerState(adam, names).state_dict();
  WholeState out;
  for (const auto& [name, piece] : state.tensors) out.tensors[name] = piece.values.clone();
  out.values = state.values;
  return out;
}

void expect_same_state(const WholeState& a, const WholeState& b, const std::string& what) {
  ASSERT_EQ(a.tensors.size(), b.tensors.size()) << what;
  for (const auto& [name, tensor] : a.tensors)
    EXPECT_TRUE(torch::equal(tensor, b.tensors.at(name))) << what << ": " << name;
  EXPECT_EQ(a.values.at("steps"), b.values.at("steps")) << what;
  EXPECT_DOUBLE_EQ(a.values.at("lr").get<double>(), b.values.at("lr").get<double>()) << what;
}

// Two servers write their ranges; three servers, ZeRO's loader and DDP's whole Adam read them,
// and what three servers write again is the same state.
TEST(ParameterServerCheckpoint, LoadsAtAnyNumberOfServersAndIntoAWholeOptimizer) {
  const auto root = cohort::testing::temp_dir("ps_checkpoint");
  run_ranks(2, [&](comm::ProcessGroup& g) {
    auto net = make_ps_net();
    auto ps = make_ps(net, g, 2);
    for (int step = 0; step < 4; ++step) ps_train_step(net, *ps, step * 2 + g.rank());
    EXPECT_TRUE(checkpoint_per_rank(*ps));
    save_checkpoint(root / "two", *net, *ps);
  });
  for (const char* file : {"model.safetensors", "zero_manifest.json", "zero-rank0-of-2.safetensors",
                           "zero-rank1-of-2.safetensors"})
    EXPECT_TRUE(std::filesystem::exists(root / "two" / file)) << file;
  const Json manifest = Json::parse(std::ifstream(root / "two" / "zero_manifest.json"));
  EXPECT_EQ(manifest["values"]["version"], 8) << "two workers, four pushes each";
  EXPECT_EQ(manifest["values"]["pushes_by_worker"], Json::array({4, 4}));
  const auto written = load_into_whole_adam(root / "two");
  EXPECT_EQ(written.values["steps"], 8);
  EXPECT_DOUBLE_EQ(written.values["lr"].get<double>(), 0.02);

  run_ranks(3, [&](comm::ProcessGroup& g) {
    auto net = make_ps_net();
    auto ps = make_ps(net, g, 3);
    load_checkpoint(Checkpoint::from_directory(root / "two"), *net, *ps);
    save_checkpoint(root / "three", *net, *ps);
  });
  expect_same_state(load_into_whole_adam(root / "three"), written, "via three servers");
  const Json again = Json::parse(std::ifstream(root / "three" / "zero_manifest.json"));
  EXPECT_EQ(again["values"]["version"], 8);
  EXPECT_EQ(again["values"]["pushes_by_worker"], Json::array({4, 4, 4}))
      << "a new worker starts level with the slowest";
  std::filesystem::remove_all(root);
}

// A whole optimizer's checkpoint (DDP's optimizer.pt) starts the servers with its state.
TEST(ParameterServerCheckpoint, TakesADdpCheckpointsOptimizerState) {
  const auto root = cohort::testing::temp_dir("ps_from_ddp");
  auto net = make_ps_net();
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(0.02));
  for (int step = 0; step < 3; ++step) ps_train_step(net, adam, step);
  save_checkpoint(root / "ddp", *net, adam);
  const auto written = load_into_whole_adam(root / "ddp");
  run_ranks(2, [&](comm::ProcessGroup& g) {
    auto replica = make_ps_net();
    auto ps = make_ps(replica, g, 2);
    load_checkpoint(Checkpoint::from_directory(root / "ddp"), *replica, *ps);
    save_checkpoint(root / "ps", *replica, *ps);
  });
  expect_same_state(load_into_whole_adam(root / "ps"), written, "DDP -> parameter server -> DDP");
  std::filesystem::remove_all(root);
}

// The first format, as cohort wrote it until now: rank 0's model.safetensors, optimizer.pt (the
// wrapped optimizer's options) and parameter_server.json; each server's flat range of the state
// in ps-shard-rank<s>-of-<S>.safetensors ("params", "state/<name>") and its .json.
void write_first_format(const std::filesystem::path& dir, torch::nn::Sequential& net,
                        torch::optim::Adam& adam, int servers) {
  std::filesystem::create_directories(dir);
  save_model(*net, dir / "model.safetensors");
  save_optimizer(adam, dir / "optimizer.pt");
  std::vector<std::string> names;
  for (const auto& p : net->named_parameters()) names.push_back(p.key());
  const auto state = optim::OptimizerState(adam, names).state_dict();
  std::map<std::string, std::vector<torch::Tensor>> pieces;
  std::vector<torch::Tensor> params;
  for (const auto& name : names) {
    params.push_back(net->named_parameters()[name].detach().reshape({-1}));
    for (const char* s : {"exp_avg", "exp_avg_sq"})
      pieces[s].push_back(state.tensors.at(name + "/" + s).values.reshape({-1}));
  }
  const auto flat_params = torch::cat(params);
  const int64_t numel = flat_params.numel();
  for (int s = 0; s < servers; ++s) {
    const int64_t begin = numel * s / servers;
    const int64_t end = numel * (s + 1) / servers;
    std::map<std::string, at::Tensor> tensors{{"params", flat_params.slice(0, begin, end)}};
    for (const auto& [name, list] : pieces)
      tensors["state/" + name] = torch::cat(list).slice(0, begin, end).contiguous();
    const std::string stem = "ps-shard-rank" + std::to_string(s) + "-of-" + std::to_string(servers);
    safetensors::write(dir / (stem + ".safetensors"), tensors, {{"format", "pt"}});
    std::ofstream(dir / (stem + ".json")) << Json{
        {"begin", begin},
        {"end", end},
        {"optimizer_steps", state.values["steps"]},
        {"version", 6},
        {"pushes_by_worker", {3, 3}}}.dump(2);
  }
  std::ofstream(dir / "parameter_server.json") << Json{
      {"format", "cohort.parameter_server.v1"},
      {"servers", servers},
      {"workers", 2},
      {"numel", numel},
      {"sync", "async-ps:1"}}.dump(2);
}

TEST(ParameterServerCheckpoint, TheFirstFormatStillLoads) {
  const auto root = cohort::testing::temp_dir("ps_first_format");
  auto net = make_ps_net();
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(0.03));
  for (int step = 0; step < 3; ++step) ps_train_step(net, adam, step);
  write_first_format(root / "v1", net, adam, 2);
  save_checkpoint(root / "ddp", *net, adam);
  const auto expected = load_into_whole_adam(root / "ddp");
  // Into a whole optimizer, and into one server that writes the current format.
  expect_same_state(load_into_whole_adam(root / "v1"), expected, "first format -> DDP");
  run_ranks(1, [&](comm::ProcessGroup& g) {
    auto replica = make_ps_net();
    auto ps = make_ps(replica, g, 1);
    load_checkpoint(Checkpoint::from_directory(root / "v1"), *replica, *ps);
    save_checkpoint(root / "now", *replica, *ps);
  });
  expect_same_state(load_into_whole_adam(root / "now"), expected, "first format -> server");
  const Json manifest = Json::parse(std::ifstream(root / "now" / "zero_manifest.json"));
  EXPECT_EQ(manifest["values"]["version"], 6);
  EXPECT_EQ(manifest["values"]["pushes_by_worker"], Json::array({3}))
      << "one worker now: level with the slowest of before";

  // A shard file missing, or a range that does not fit the model, is named.
  std::filesystem::remove(root / "v1" / "ps-shard-rank1-of-2.json");
  testing::expect_error<UsageError>([&] { load_into_whole_adam(root / "v1"); },
                                    "lacks server 1's shard");
  write_first_format(root / "v1", net, adam, 2);
  Json info = Json::parse(std::ifstream(root / "v1" / "ps-shard-rank1-of-2.json"));
  info["end"] = info["end"].get<int64_t>() + 5;
  std::ofstream(root / "v1" / "ps-shard-rank1-of-2.json") << info.dump();
  testing::expect_error<UsageError>([&] { load_into_whole_adam(root / "v1"); }, "it was altered");
  std::filesystem::remove_all(root);
}

}  // namespace
}  // namespace cohort::train

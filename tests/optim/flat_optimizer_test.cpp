#include "cohort/optim/flat_optimizer.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <sstream>

#include "cohort/error.h"
#include "cohort/optim/state_dict.h"
#include "support/cuda.h"
#include "support/expect.h"
#include "support/tiny_mnist.h"

namespace cohort {
namespace {

// A small net with a weight matrix, a conv, biases and a branch used on some steps only.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3)));
    fc = register_module("fc", torch::nn::Linear(4 * 6 * 6, 10));
    side = register_module("side", torch::nn::Linear(10, 10));
  }
  torch::Tensor forward(const torch::Tensor& x, bool use_side) {
    auto y = fc->forward(torch::relu(conv->forward(x)).flatten(1));
    return use_side ? side->forward(y) : y;
  }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::Linear fc{nullptr}, side{nullptr};
};
TORCH_MODULE(Net);

Net make_net(uint64_t seed) {
  torch::manual_seed(seed);
  return Net();
}

// Trains two copies of one net for `steps` steps, one with `make_reference`'s optimizer and one
// with `make_flat`'s, on the same batches; the side branch is used on odd steps only when
// `skip_side` is set.
void expect_same_training(
    const std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)>&
        make_reference,
    const std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)>&
        make_flat,
    int steps = 100, bool skip_side = false, double rtol = 1e-6) {
  auto reference = make_net(1);
  auto flat = make_net(1);
  auto reference_optimizer = make_reference(reference->parameters());
  auto flat_optimizer = make_flat(flat->parameters());
  torch::manual_seed(2);
  for (int step = 0; step < steps; ++step) {
    const auto x = torch::randn({8, 1, 8, 8});
    const auto target = torch::randint(0, 10, {8});
    const bool use_side = !skip_side || step % 2 == 1;
    for (auto* pair : {&reference, &flat}) {
      auto& optimizer = pair == &reference ? *reference_optimizer : *flat_optimizer;
      optimizer.zero_grad();
      torch::nn::functional::cross_entropy((*pair)->forward(x, use_side), target).backward();
    }
    // Both step on the reference's gradients, so that what is compared is the optimizers'
    // arithmetic: two trainings on their own gradients drift apart from ulp-level differences
    // (libtorch 2.14's fused kernels round differently from torch::optim in the last bit), which
    // a ReLU net amplifies over 100 steps.
    {
      torch::NoGradGuard no_grad;
      const auto from = reference->parameters(), to = flat->parameters();
      for (size_t i = 0; i < from.size(); ++i) {
        ASSERT_EQ(from[i].grad().defined(), to[i].grad().defined()) << "parameter " << i;
        if (from[i].grad().defined()) to[i].mutable_grad().copy_(from[i].grad());
      }
    }
    reference_optimizer->step();
    flat_optimizer->step();
  }
  const auto expected = reference->parameters();
  const auto actual = flat->parameters();
  ASSERT_EQ(expected.size(), actual.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    const double scale = expected[i].abs().max().item<double>();
    const double diff = (expected[i] - actual[i]).abs().max().item<double>();
    EXPECT_LE(diff, rtol * std::max(scale, 1e-3))
        << "parameter " << i << " after " << steps << " steps: max |diff| " << diff;
  }
}

TEST(FlatOptimizer, SgdMatchesTorchOptimOver100Steps) {
  for (const auto& options :
       {torch::optim::SGDOptions(0.05), torch::optim::SGDOptions(0.05).momentum(0.9),
        torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(true).weight_decay(1e-3),
        torch::optim::SGDOptions(0.05).momentum(0.8).dampening(0.1).weight_decay(1e-2)}) {
    expect_same_training([&](auto p) { return std::make_unique<torch::optim::SGD>(p, options); },
                         [&](auto p) { return std::make_unique<optim::FlatSGD>(p, options); });
  }
}

TEST(FlatOptimizer, AdamAndAdamWMatchTorchOptimOver100Steps) {
  for (const auto& options :
       {torch::optim::AdamOptions(1e-3), torch::optim::AdamOptions(2e-3).weight_decay(1e-2),
        torch::optim::AdamOptions(1e-3).amsgrad(true).betas({0.8, 0.99})}) {
    expect_same_training([&](auto p) { return std::make_unique<torch::optim::Adam>(p, options); },
                         [&](auto p) { return std::make_unique<optim::FlatAdam>(p, options); });
  }
  for (const auto& options :
       {torch::optim::AdamWOptions(1e-3), torch::optim::AdamWOptions(3e-3).weight_decay(0.1)}) {
    expect_same_training([&](auto p) { return std::make_unique<torch::optim::AdamW>(p, options); },
                         [&](auto p) { return std::make_unique<optim::FlatAdamW>(p, options); });
  }
}

TEST(FlatOptimizer, ParametersWithoutGradientsAreLeftAloneAsTorchOptimDoes) {
  // The side branch gets a gradient every other step: its Adam step count and moments must
  // advance only then, exactly as torch::optim's per-parameter state does.
  expect_same_training(
      [](auto p) {
        return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(1e-2));
      },
      [](auto p) { return std::make_unique<optim::FlatAdam>(p, torch::optim::AdamOptions(1e-2)); },
      40, true);
  expect_same_training(
      [](auto p) {
        return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1).momentum(0.9));
      },
      [](auto p) {
        return std::make_unique<optim::FlatSGD>(p, torch::optim::SGDOptions(0.1).momentum(0.9));
      },
      40, true);
}

TEST(FlatOptimizer, ParametersLiveInOneBufferAndGradientsAccumulateThere) {
  auto net = make_net(3);
  optim::FlatSGD optimizer(net->parameters(), torch::optim::SGDOptions(0.1));
  const auto params = net->parameters();
  const auto* base = static_cast<const char*>(params.front().data_ptr());
  int64_t offset = 0;
  for (const auto& p : params) {
    EXPECT_EQ(static_cast<const char*>(p.data_ptr()), base + offset * 4);
    offset += p.numel();
  }
  const auto x = torch::randn({4, 1, 8, 8});
  torch::nn::functional::cross_entropy(net->forward(x, true), torch::zeros({4}, torch::kLong))
      .backward();
  optimizer.step();
  // After the first step the gradients are the flat buffer's slots: no copy at later steps.
  const auto grads = optimizer.flat_gradients();
  ASSERT_EQ(grads.size(), 1u);
  EXPECT_EQ(params.front().grad().data_ptr(), grads.front().data_ptr());
  EXPECT_EQ(grads.front().numel(), offset);
}

TEST(FlatOptimizer, ResumedFromACheckpointIsBitIdentical) {
  const auto dir = testing::temp_dir("flat_optimizer_resume");
  auto run = [&](Net& net, torch::optim::Optimizer& optimizer, int from, int to) {
    for (int step = from; step < to; ++step) {
      torch::manual_seed(100 + step);
      const auto x = torch::randn({8, 1, 8, 8});
      const auto target = torch::randint(0, 10, {8});
      optimizer.zero_grad();
      torch::nn::functional::cross_entropy(net->forward(x, true), target).backward();
      optimizer.step();
    }
  };
  auto whole = make_net(4);
  optim::FlatAdamW whole_optimizer(whole->parameters(), torch::optim::AdamWOptions(1e-2));
  run(whole, whole_optimizer, 0, 20);

  auto first = make_net(4);
  optim::FlatAdamW first_optimizer(first->parameters(), torch::optim::AdamWOptions(1e-2));
  run(first, first_optimizer, 0, 10);
  torch::save(first, (dir / "model.pt").string());
  torch::save(first_optimizer, (dir / "optimizer.pt").string());

  auto resumed = make_net(99);
  optim::FlatAdamW resumed_optimizer(resumed->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::load(resumed, (dir / "model.pt").string());
  torch::load(resumed_optimizer, (dir / "optimizer.pt").string());
  run(resumed, resumed_optimizer, 10, 20);
  const auto a = whole->parameters();
  const auto b = resumed->parameters();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << "parameter " << i;
  std::filesystem::remove_all(dir);
}

// A checkpoint of a flat optimizer's state writes from its own buffers, and a load fills them in
// place: no copy of the whole state is made (for a 100 M-parameter Adam, 800 MB of fresh memory a
// rank, which live recovery paid twice per survivor). The state still moves bit for bit.
TEST(FlatOptimizer, ItsStateIsSavedFromAndLoadedIntoItsOwnBuffers) {
  auto run = [](Net& net, torch::optim::Optimizer& optimizer, int steps) {
    for (int step = 0; step < steps; ++step) {
      torch::manual_seed(200 + step);
      optimizer.zero_grad();
      torch::nn::functional::cross_entropy(net->forward(torch::randn({8, 1, 8, 8}), true),
                                           torch::randint(0, 10, {8}))
          .backward();
      optimizer.step();
    }
  };
  auto written = make_net(5);
  optim::FlatAdam writer(written->parameters(), torch::optim::AdamOptions(1e-2));
  run(written, writer, 3);
  std::vector<std::string> names;
  for (const auto& p : written->named_parameters()) names.push_back(p.key());
  const auto saved = optim::OptimizerState(writer, names).state_dict();
  // Views of the writer's buffers: what a step changes, they show.
  const auto& exp_avg = saved.tensors.at("fc.weight/exp_avg").values;
  EXPECT_EQ(exp_avg.data_ptr(), writer.parameter_state_views(0, 2).values[0].data_ptr());
  const auto before = exp_avg.clone();
  run(written, writer, 1);
  EXPECT_FALSE(torch::equal(before, exp_avg));

  // Loaded in place: the tensors to fill are the reader's own buffers.
  auto read = make_net(6);
  optim::FlatAdam reader(read->parameters(), torch::optim::AdamOptions(1e-2));
  optim::OptimizerState into(reader, names);
  auto wanted = into.state_to_load(saved.values);
  for (auto& [name, piece] : wanted.tensors) piece.values.copy_(saved.tensors.at(name).values);
  EXPECT_EQ(wanted.tensors.at("fc.weight/exp_avg").values.data_ptr(),
            reader.parameter_state_views(0, 2).values[0].data_ptr());
  wanted.values = optim::OptimizerState(writer, names).state_dict().values;
  into.load_state_dict(wanted);
  for (size_t i = 0; i < names.size(); ++i) {
    const auto a = writer.parameter_state(0, i);
    const auto b = reader.parameter_state(0, i);
    EXPECT_EQ(a.steps, b.steps) << names[i];
    for (size_t s = 0; s < a.values.size(); ++s)
      EXPECT_TRUE(torch::equal(a.values[s], b.values[s])) << names[i] << " state " << s;
  }
  // A copy (another optimizer's buffers) is still copied.
  auto copied = make_net(7);
  optim::FlatAdam third(copied->parameters(), torch::optim::AdamOptions(1e-2));
  optim::OptimizerState(third, names)
      .load_state_dict(optim::OptimizerState(writer, names).state_dict());
  EXPECT_TRUE(
      torch::equal(third.parameter_state(0, 2).values[1], writer.parameter_state(0, 2).values[1]));
}

// A flat optimizer over another one's buffers (a live regroup's survivor: its new model and
// optimizer over the memory of the ones it had) takes them as they are: no copy, no fresh
// memory; and it steps on from them exactly as the one that left them.
TEST(FlatOptimizer, AdoptsAnotherFlatOptimizersBuffersWithoutACopy) {
  auto run = [](Net& net, torch::optim::Optimizer& optimizer, int from, int to) {
    for (int step = from; step < to; ++step) {
      torch::manual_seed(300 + step);
      optimizer.zero_grad();
      torch::nn::functional::cross_entropy(net->forward(torch::randn({8, 1, 8, 8}), step % 2),
                                           torch::randint(0, 10, {8}))
          .backward();
      optimizer.step();
    }
  };
  auto reference = make_net(8);
  optim::FlatAdam reference_optimizer(reference->parameters(), torch::optim::AdamOptions(1e-2));
  run(reference, reference_optimizer, 0, 6);

  std::vector<torch::Tensor> weights;
  std::vector<optim::FlatOptimizer::ParameterState> states;
  {
    auto left = make_net(8);
    optim::FlatAdam leaving(left->parameters(), torch::optim::AdamOptions(1e-2));
    run(left, leaving, 0, 3);
    weights = left->parameters();
    for (size_t i = 0; i < weights.size(); ++i)
      states.push_back(leaving.parameter_state_views(0, i));
  }  // the model and the optimizer are gone; their buffers stay, held by what was kept

  auto next = make_net(9);
  optim::FlatAdam adopting(next->parameters(), torch::optim::AdamOptions(1e-2));
  // Copies (a peer's state as received) are not one optimizer's buffers: refused, nothing changed.
  std::vector<torch::Tensor> copies;
  for (const auto& w : weights) copies.push_back(w.clone());
  const auto* before = next->parameters().front().data_ptr();
  EXPECT_FALSE(adopting.adopt(0, copies, states));
  EXPECT_EQ(next->parameters().front().data_ptr(), before);
  EXPECT_EQ(adopting.parameter_state(0, 0).steps, 0);

  ASSERT_TRUE(adopting.adopt(0, weights, states));
  const auto params = next->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(params[i].data_ptr(), weights[i].data_ptr()) << "parameter " << i;
    const auto state = adopting.parameter_state_views(0, i);
    EXPECT_EQ(state.steps, states[i].steps) << "parameter " << i;
    for (size_t s = 0; s < state.values.size(); ++s)
      EXPECT_EQ(state.values[s].data_ptr(), states[i].values[s].data_ptr())
          << "parameter " << i << " state " << s;
  }
  run(next, adopting, 3, 6);
  const auto expected = reference->parameters();
  for (size_t i = 0; i < params.size(); ++i)
    EXPECT_TRUE(torch::equal(params[i], expected[i])) << "parameter " << i << " after 3 more steps";
}

// Parameters that already lie one after another in one buffer stay where they are.
TEST(FlatOptimizer, ParametersAlreadyInOneBufferAreSteppedWhereTheyAre) {
  auto buffer = torch::randn({30});
  std::vector<torch::Tensor> params;
  for (const int64_t offset : {0, 12, 20}) {
    const int64_t numel = offset == 0 ? 12 : offset == 12 ? 8 : 10;
    auto p = torch::empty({0});
    p.set_(buffer.storage(), offset, {numel}, {1});
    params.push_back(p.requires_grad_());
  }
  optim::FlatSGD optimizer(params, torch::optim::SGDOptions(0.5));
  for (size_t i = 0; i < params.size(); ++i)
    EXPECT_TRUE(params[i].storage().is_alias_of(buffer.storage())) << "parameter " << i;
  const auto before = buffer.clone();
  for (auto& p : params) p.mutable_grad() = torch::ones_like(p);
  optimizer.step();
  EXPECT_TRUE(torch::allclose(buffer, before - 0.5));
  // Out of order, they are copied into the optimizer's own buffer.
  std::vector<torch::Tensor> swapped{params[1], params[0]};
  optim::FlatSGD copying(swapped, torch::optim::SGDOptions(0.5));
  EXPECT_FALSE(swapped[0].storage().is_alias_of(buffer.storage()));
}

TEST(FlatOptimizer, RefusesStateOfAnotherOptimizerNamingIt) {
  const auto dir = testing::temp_dir("flat_optimizer_refuse");
  auto net = make_net(5);
  torch::optim::Adam plain(net->parameters(), torch::optim::AdamOptions(1e-3));
  torch::save(plain, (dir / "plain.pt").string());
  optim::FlatAdam flat(net->parameters(), torch::optim::AdamOptions(1e-3));
  testing::expect_error<UsageError>([&] { torch::load(flat, (dir / "plain.pt").string()); },
                                    "torch::optim");
  torch::save(flat, (dir / "flat.pt").string());
  optim::FlatSGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  testing::expect_error<UsageError>([&] { torch::load(sgd, (dir / "flat.pt").string()); },
                                    "flat adam optimizer, not sgd");
  std::filesystem::remove_all(dir);
}

TEST(FlatOptimizer, FollowsAModuleMovedAfterConstruction) {
  auto reference = make_net(6);
  auto flat = make_net(6);
  torch::optim::SGD reference_optimizer(reference->parameters(),
                                        torch::optim::SGDOptions(0.1).momentum(0.9));
  optim::FlatSGD flat_optimizer(flat->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < 6; ++step) {
    if (step == 3) {  // moved mid-run: the momentum must come along
      reference->to(torch::kDouble);
      flat->to(torch::kDouble);
    }
    torch::manual_seed(200 + step);
    const auto dtype = step >= 3 ? torch::kDouble : torch::kFloat;
    const auto x = torch::randn({8, 1, 8, 8}, dtype);
    const auto target = torch::randint(0, 10, {8});
    for (auto* net : {&reference, &flat}) {
      torch::optim::Optimizer& optimizer =
          net == &reference ? static_cast<torch::optim::Optimizer&>(reference_optimizer)
                            : flat_optimizer;
      optimizer.zero_grad();
      torch::nn::functional::cross_entropy((*net)->forward(x, true), target).backward();
      optimizer.step();
    }
  }
  const auto a = reference->parameters();
  const auto b = flat->parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(b[i].scalar_type(), torch::kDouble);
    EXPECT_TRUE(torch::allclose(a[i], b[i], 1e-6, 1e-7)) << "parameter " << i;
  }
}

TEST(FlatOptimizer, LowPrecisionParametersStepThroughFloat32Masters) {
  // Steps of 1e-4 vanish against bfloat16's spacing of 2^-7 at 1.0: without a float32 master the
  // parameter would never move.
  auto w = torch::ones({16}, torch::kBFloat16).requires_grad_(true);
  optim::FlatSGD optimizer({w}, torch::optim::SGDOptions(1.0));
  EXPECT_EQ(optimizer.state_bytes(), 16 * 4 /*grads*/ + 16 * 4 /*float32 masters*/);
  for (int step = 0; step < 100; ++step) {
    w.mutable_grad() = torch::full({16}, 1e-4, torch::kBFloat16);
    optimizer.step();
  }
  EXPECT_EQ(w.scalar_type(), torch::kBFloat16);
  EXPECT_NEAR(w[0].item<float>(), 0.99f, 0.005f);
  torch::optim::SGD plain({torch::ones({16}, torch::kBFloat16).requires_grad_(true)},
                          torch::optim::SGDOptions(1.0));
  auto& p = plain.param_groups()[0].params()[0];
  for (int step = 0; step < 100; ++step) {
    p.mutable_grad() = torch::full({16}, 1e-4, torch::kBFloat16);
    plain.step();
  }
  EXPECT_EQ(p[0].item<float>(), 1.0f) << "plain bfloat16 SGD was expected to lose the updates";
}

TEST(FlatOptimizer, ClipsLikeTorchWithoutSyncing) {
  auto reference = make_net(7);
  auto flat = make_net(7);
  optim::FlatSGD optimizer(flat->parameters(), torch::optim::SGDOptions(0.1));
  const auto x = torch::randn({8, 1, 8, 8}) * 10;
  const auto target = torch::randint(0, 10, {8});
  torch::nn::functional::cross_entropy(reference->forward(x, true), target).backward();
  torch::nn::functional::cross_entropy(flat->forward(x, true), target).backward();
  const double expected = torch::nn::utils::clip_grad_norm_(reference->parameters(), 0.5);
  const auto norm = optimizer.clip_grad_norm(0.5);
  EXPECT_EQ(norm.dim(), 0);
  EXPECT_NEAR(norm.item<double>(), expected, 1e-5 * expected);
  const auto a = reference->parameters();
  const auto b = flat->parameters();
  optimizer.step();  // uses the clipped gradients
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(torch::allclose(a[i].grad(), b[i].grad(), 1e-5, 1e-7)) << "gradient " << i;
    EXPECT_TRUE(torch::allclose(b[i], a[i] - 0.1 * a[i].grad(), 1e-5, 1e-6)) << "parameter " << i;
  }
  // The free function for any parameters.
  auto other = make_net(7);
  torch::nn::functional::cross_entropy(other->forward(x, true), target).backward();
  EXPECT_NEAR(optim::clip_grad_norm(other->parameters(), 0.5).item<double>(), expected,
              1e-5 * expected);
  testing::expect_error<UsageError>([&] { optimizer.clip_grad_norm(0); }, "max_norm 0");
}

// Offloaded to disk, the state steps a chunk at a time through files that nothing can see (they
// are unlinked at once), and the parameters after 20 steps are bit for bit those of the state in
// memory: Adam, AdamW and SGD with momentum, over partitions of several chunks.
TEST(FlatOptimizer, StateOffloadedToDiskStepsBitForBitAsInMemory) {
  const auto dir = cohort::testing::temp_dir("flat_offload");
  const auto run = [&](const std::string& algorithm, bool offload) {
    torch::manual_seed(4);
    // 2 x 600 x 600 + biases: about 2.8 chunks of state per buffer.
    torch::nn::Sequential net(torch::nn::Linear(600, 600), torch::nn::Tanh(),
                              torch::nn::Linear(600, 600));
    std::unique_ptr<optim::FlatOptimizer> optimizer;
    if (algorithm == "adam") {
      optimizer =
          std::make_unique<optim::FlatAdam>(net->parameters(), torch::optim::AdamOptions(1e-3));
    } else if (algorithm == "adamw") {
      optimizer = std::make_unique<optim::FlatAdamW>(
          net->parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.1));
    } else {
      optimizer = std::make_unique<optim::FlatSGD>(net->parameters(),
                                                   torch::optim::SGDOptions(0.05).momentum(0.9));
    }
    if (offload) {
      optimizer->offload_state(dir);
      EXPECT_TRUE(optimizer->state_offloaded());
      // The files exist only as mappings of this process.
      EXPECT_TRUE(std::filesystem::is_empty(dir));
      std::ifstream maps("/proc/self/maps");
      const std::string text((std::istreambuf_iterator<char>(maps)), {});
      EXPECT_NE(text.find("cohort-optimizer-state-"), std::string::npos);
    }
    for (int step = 0; step < 20; ++step) {
      optimizer->zero_grad();
      torch::manual_seed(100 + step);
      net->forward(torch::randn({16, 600})).pow(2).mean().backward();
      optimizer->step();
    }
    std::vector<at::Tensor> out;
    for (const auto& p : net->parameters()) out.push_back(p.detach().clone());
    return out;
  };
  for (const std::string algorithm : {"adam", "adamw", "sgd"}) {
    const auto memory = run(algorithm, false), disk = run(algorithm, true);
    ASSERT_EQ(memory.size(), disk.size());
    for (size_t i = 0; i < memory.size(); ++i)
      EXPECT_TRUE(torch::equal(memory[i], disk[i])) << algorithm << " parameter " << i;
  }
  EXPECT_TRUE(std::filesystem::is_empty(dir));
  // A folder that is not there, or a file: named with the fix.
  torch::nn::Linear small(2, 2);
  optim::FlatAdam adam(small->parameters());
  cohort::testing::expect_error<UsageError>([&] { adam.offload_state(dir / "absent"); },
                                            "absent is not a folder: create it");
  std::ofstream(dir / "file") << "x";
  cohort::testing::expect_error<UsageError>([&] { adam.offload_state(dir / "file"); },
                                            "is not a folder");
  EXPECT_FALSE(adam.state_offloaded());
  std::filesystem::remove_all(dir);
}

// Offloaded to the host, a GPU model's optimizer keeps its masters, its state and a copy of the
// gradients in pinned host memory and updates there: the GPU holds the parameters and their
// gradients only (clipping and unscaling act on those), the steps match the update on the GPU
// to rounding, a checkpoint resumes bit for bit, and the state goes on to files as well. On CPU
// parameters (the next test) it changes nothing.
TEST(FlatOptimizer, StateOffloadedToTheHostStepsThereForAGpuModel) {
  COHORT_REQUIRE_CUDA();
  const torch::Device gpu(torch::kCUDA);
  const auto dir = testing::temp_dir("flat_host_offload");
  auto run = [&](Net& net, torch::optim::Optimizer& optimizer, int from, int to) {
    for (int step = from; step < to; ++step) {
      torch::manual_seed(100 + step);
      const auto x = torch::randn({8, 1, 8, 8}).to(gpu);
      const auto target = torch::randint(0, 10, {8}).to(gpu);
      optimizer.zero_grad();
      torch::nn::functional::cross_entropy(net->forward(x, true), target).backward();
      optimizer.step();
    }
  };
  const auto adamw = [](Net& net) {
    return std::make_unique<optim::FlatAdamW>(net->parameters(),
                                              torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  };
  auto on_gpu = make_net(4);
  on_gpu->to(gpu);
  auto gpu_optimizer = adamw(on_gpu);
  run(on_gpu, *gpu_optimizer, 0, 10);

  auto offloaded = make_net(4);
  offloaded->to(gpu);
  auto optimizer = adamw(offloaded);
  optimizer->offload_to_host();
  EXPECT_TRUE(optimizer->offloaded_to_host());
  run(offloaded, *optimizer, 0, 5);
  const auto views = optimizer->parameter_state_views(0, 0);
  ASSERT_EQ(views.values.size(), 2U);
  EXPECT_TRUE(views.values[0].is_cpu());
  EXPECT_EQ(views.steps, 5);
  for (const auto& g : optimizer->flat_gradients()) EXPECT_TRUE(g.is_cuda());
  for (const auto& p : offloaded->parameters()) {
    EXPECT_TRUE(p.is_cuda());
    EXPECT_TRUE(p.grad().is_cuda());
  }
  EXPECT_FALSE(optimizer->replays_exactly()) << "a host update is not captured";
  torch::save(offloaded, (dir / "model.pt").string());
  torch::save(*optimizer, (dir / "optimizer.pt").string());
  run(offloaded, *optimizer, 5, 10);
  const auto a = on_gpu->parameters(), b = offloaded->parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(torch::allclose(a[i], b[i], 1e-4, 1e-6))
        << "parameter " << i << " differs by " << (a[i] - b[i]).abs().max().item<double>();
  }
  // Resumed from step 5 on the host, then with the state in files too: bit for bit.
  for (const bool disk : {false, true}) {
    auto resumed = make_net(99);
    resumed->to(gpu);
    auto resumed_optimizer = adamw(resumed);
    resumed_optimizer->offload_to_host();
    if (disk) {
      std::filesystem::create_directories(dir / "state");
      resumed_optimizer->offload_state(dir / "state");
    }
    torch::load(resumed, (dir / "model.pt").string());
    torch::load(*resumed_optimizer, (dir / "optimizer.pt").string());
    run(resumed, *resumed_optimizer, 5, 10);
    const auto c = resumed->parameters();
    for (size_t i = 0; i < b.size(); ++i)
      EXPECT_TRUE(torch::equal(b[i], c[i])) << (disk ? "disk" : "host") << " parameter " << i;
  }
  std::filesystem::remove_all(dir);
}

TEST(FlatOptimizer, OffloadToTheHostChangesNothingForCpuParameters) {
  auto run = [](bool offload) {
    auto net = make_net(4);
    optim::FlatAdamW optimizer(net->parameters(), torch::optim::AdamWOptions(1e-2));
    if (offload) optimizer.offload_to_host();
    EXPECT_EQ(optimizer.offloaded_to_host(), offload);
    const auto bytes = optimizer.state_bytes();
    for (int step = 0; step < 5; ++step) {
      torch::manual_seed(100 + step);
      const auto x = torch::randn({8, 1, 8, 8});
      optimizer.zero_grad();
      torch::nn::functional::cross_entropy(net->forward(x, true), torch::randint(0, 10, {8}))
          .backward();
      optimizer.step();
    }
    EXPECT_EQ(optimizer.state_bytes(), bytes) << "no second copy of anything";
    // The parameters still lie in the optimizer's buffer: stepped where they are.
    const auto params = net->parameters();
    EXPECT_EQ(params[1].data_ptr<float>(), params[0].data_ptr<float>() + params[0].numel());
    std::vector<at::Tensor> out;
    for (const auto& p : params) out.push_back(p.detach().clone());
    return out;
  };
  const auto plain = run(false), offloaded = run(true);
  for (size_t i = 0; i < plain.size(); ++i)
    EXPECT_TRUE(torch::equal(plain[i], offloaded[i])) << "parameter " << i;
}

TEST(FlatOptimizer, HyperparametersOutOfRangeAreNamed) {
  auto w = torch::zeros({2}, torch::requires_grad());
  using testing::expect_error;
  expect_error<UsageError>(
      [&] { optim::FlatSGD({w}, torch::optim::SGDOptions(0.1).momentum(1.5)); },
      "SGD momentum 1.5");
  expect_error<UsageError>([&] { optim::FlatSGD({w}, torch::optim::SGDOptions(-1)); }, "SGD lr -1");
  expect_error<UsageError>(
      [&] { optim::FlatSGD({w}, torch::optim::SGDOptions(0.1).nesterov(true)); }, "nesterov");
  expect_error<UsageError>(
      [&] {
        optim::FlatAdam({w}, torch::optim::AdamOptions(1e-3).betas({0.9, 1.0}));
      },
      "Adam beta2 1");
  expect_error<UsageError>([&] { optim::FlatAdamW({w}, torch::optim::AdamWOptions(1e-3).eps(0)); },
                           "AdamW eps 0");
  expect_error<UsageError>(
      [&] { optim::FlatAdam({w}, torch::optim::AdamOptions(1e-3).weight_decay(-0.1)); },
      "weight_decay -0.1");
  expect_error<UsageError>(
      [&] { optim::FlatSGD({torch::zeros({2}, torch::kLong)}, torch::optim::SGDOptions(0.1)); },
      "not floating point");
}

}  // namespace
}  // namespace cohort

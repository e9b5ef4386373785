#include "cohort/parallel/activation_checkpointing.h"

#include <gtest/gtest.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/torch.h>

#include <functional>
#include <set>

#include "cohort/error.h"
#include "cohort/optim/precision.h"
#include "cohort/parallel/fully_shard.h"
#include "cohort/parallel/tensor_parallel.h"
#include "parallel/grad_accumulator.h"
#include "support/cuda.h"
#include "support/expect.h"
#include "support/local_group.h"

namespace cohort::parallel {
namespace {

// A block with every kind of state a recomputation must reproduce: dropout (the random
// generator), BatchNorm (running statistics updated in training), and a count of its forwards.
struct RecomputedBlockImpl : torch::nn::Module {
  RecomputedBlockImpl() {
    fc = register_module("fc", torch::nn::Linear(6, 6));
    norm = register_module("norm", torch::nn::BatchNorm1d(6));
  }
  at::Tensor forward(const at::Tensor& x) {
    ++forwards;
    return x + torch::dropout(torch::gelu(norm->forward(fc->forward(x))), 0.3, is_training());
  }
  torch::nn::Linear fc{nullptr};
  torch::nn::BatchNorm1d norm{nullptr};
  int forwards = 0;
};
TORCH_MODULE(RecomputedBlock);

// Four blocks, each a unit, and a head outside them.
struct RecomputedNetImpl : torch::nn::Module {
  RecomputedNetImpl() {
    for (int i = 0; i < 4; ++i) {
      blocks.push_back(FullyShard(RecomputedBlock()));
      register_module("block" + std::to_string(i), blocks.back());
    }
    head = register_module("head", torch::nn::Linear(6, 3));
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& b : blocks) x = b->forward(x);
    return head->forward(x);
  }
  int forwards() const {
    int n = 0;
    for (const auto& b : blocks) n += b->module_as<RecomputedBlockImpl>()->forwards;
    return n;
  }
  std::vector<FullyShard> blocks;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(RecomputedNet);

RecomputedNet seeded_net() {
  torch::manual_seed(1);
  return RecomputedNet();
}

struct Step {
  at::Tensor loss, input_grad, next_draw;
  std::vector<at::Tensor> grads, buffers;
};

// One forward and backward of `net` from the same seed: its loss, gradients, buffers afterwards
// and the generator's next draw after the step.
Step run_step(RecomputedNet& net) {
  torch::manual_seed(7);
  const at::Tensor x = torch::randn({5, 6}).requires_grad_(true);
  const at::Tensor loss = net->forward(x).pow(2).mean();
  loss.backward();
  Step s{.loss = loss.detach(), .input_grad = x.grad(), .next_draw = torch::rand({4})};
  for (const auto& p : net->parameters()) s.grads.push_back(p.grad().clone());
  for (const auto& b : net->buffers()) s.buffers.push_back(b.clone());
  return s;
}

void expect_same_step(const Step& a, const Step& b) {
  EXPECT_TRUE(torch::allclose(a.loss, b.loss, 0, 1e-6))
      << a.loss.item<double>() << " vs " << b.loss.item<double>();
  EXPECT_TRUE(torch::allclose(a.input_grad, b.input_grad, 0, 1e-6));
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (size_t i = 0; i < a.grads.size(); ++i) {
    EXPECT_TRUE(torch::allclose(a.grads[i], b.grads[i], 0, 1e-6))
        << "gradient " << i << ": largest difference "
        << (a.grads[i] - b.grads[i]).abs().max().item<double>();
  }
  ASSERT_EQ(a.buffers.size(), b.buffers.size());
  for (size_t i = 0; i < a.buffers.size(); ++i)
    EXPECT_TRUE(torch::equal(a.buffers[i], b.buffers[i])) << "buffer " << i;
  EXPECT_TRUE(torch::equal(a.next_draw, b.next_draw)) << "the generator after the step";
}

TEST(ActivationCheckpointing, CheckpointedUnitsGiveThePlainLossAndGradientsWithDropout) {
  auto plain = seeded_net();
  const Step expected = run_step(plain);
  EXPECT_EQ(plain->forwards(), 4);
  for (const std::string policy :
       {"every:1", "every:2", "layers:block1,block3", "layers:RecomputedBlock"}) {
    SCOPED_TRACE(policy);
    auto net = seeded_net();
    const auto units = apply_activation_checkpointing(*net, parse_activation_checkpointing(policy));
    const Step actual = run_step(net);
    expect_same_step(expected, actual);
    // Each checkpointed unit ran its forward twice: once without keeping activations, once in
    // backward.
    EXPECT_EQ(net->forwards(), 4 + static_cast<int>(units.size()));
  }
}

// The gradients `step` leaves in a plain net and in one with every unit checkpointed: equal.
void expect_plain_gradients(const std::function<std::vector<at::Tensor>(RecomputedNet&)>& step) {
  auto plain = seeded_net();
  const auto expected = step(plain);
  auto net = seeded_net();
  apply_activation_checkpointing(*net, {.every = 1});
  const auto actual = step(net);
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i) {
    EXPECT_TRUE(torch::allclose(actual[i], expected[i], 0, 1e-6))
        << "gradient " << i << ": largest difference "
        << (actual[i] - expected[i]).abs().max().item<double>();
  }
}

TEST(ActivationCheckpointing, RecomputesUnderTheForwardsAutocast) {
  const auto step = [](RecomputedNet& net) {
    torch::manual_seed(7);
    const at::Tensor x = torch::randn({5, 6});
    at::Tensor loss;
    {
      optim::AutocastGuard autocast(optim::Precision::kBf16, torch::kCPU);
      loss = net->forward(x).to(torch::kFloat).pow(2).mean();
    }
    // Backward after the guard, as in PyTorch: the recomputation must bring bf16 back itself.
    loss.backward();
    std::vector<at::Tensor> grads;
    for (const auto& p : net->parameters()) grads.push_back(p.grad().clone());
    return grads;
  };
  expect_plain_gradients(step);
}

TEST(ActivationCheckpointing, EvaluationRunsTheForwardOnce) {
  auto net = seeded_net();
  apply_activation_checkpointing(*net, {.every = 1});
  net->eval();
  torch::NoGradGuard no_grad;
  net->forward(torch::randn({2, 6}));
  EXPECT_EQ(net->forwards(), 4);
}

TEST(ActivationCheckpointing, SeveralInputsAndOutputsGetTheirGradients) {
  torch::manual_seed(3);
  const at::Tensor w = torch::randn({4, 4}).requires_grad_(true);
  const at::Tensor a = torch::randn({2, 4}).requires_grad_(true);
  const at::Tensor b = torch::randn({2, 4});  // needs no gradient
  const auto fn = [&](const std::vector<at::Tensor>& in) {
    const at::Tensor h = torch::tanh(in[0].matmul(w)) * in[1];
    return std::vector<at::Tensor>{h.sum(1), h.exp().mean()};
  };
  const auto plain = fn({a, b});
  (plain[0].sum() * 3 + plain[1]).backward();
  const at::Tensor a_grad = a.grad().clone(), w_grad = w.grad().clone();
  a.mutable_grad().reset();
  w.mutable_grad().reset();
  const auto outs = checkpoint(fn, {a, b}, {.parameters = {w}});
  EXPECT_TRUE(torch::equal(outs[0], plain[0]));
  (outs[0].sum() * 3 + outs[1]).backward();
  EXPECT_TRUE(torch::allclose(a.grad(), a_grad, 0, 1e-6));
  EXPECT_TRUE(torch::allclose(w.grad(), w_grad, 0, 1e-6));
  // A parameter listed twice (a module shared by two parents) gets its gradient once, from
  // backward and from grad() alike.
  w.mutable_grad().reset();
  const auto twice = checkpoint(fn, {a, b}, {.parameters = {w, w}});
  (twice[0].sum() * 3 + twice[1]).backward();
  EXPECT_TRUE(torch::allclose(w.grad(), w_grad, 0, 1e-6));
  const auto again = checkpoint(fn, {a, b}, {.parameters = {w, w}});
  EXPECT_TRUE(torch::allclose(torch::autograd::grad({again[0].sum() * 3 + again[1]}, {w})[0],
                              w_grad, 0, 1e-6));
}

// Each parameter's own gradient accumulator, whose hooks DDP and ZeRO listen to, runs once per
// backward and finds the whole gradient in .grad. For a checkpointed unit's parameters it is
// given none: the recomputation added each gradient to .grad as it was made, rather than
// returning the unit's gradients together (all of them live at once). A second step adds to the
// gradients the first left.
TEST(ActivationCheckpointing, EachParametersOwnAccumulatorRunsOnceWithItsGradientComplete) {
  auto plain = seeded_net();
  auto net = seeded_net();
  apply_activation_checkpointing(*net, {.every = 1});  // block0-2; block3 and the head plain
  std::set<const c10::TensorImpl*> checkpointed;
  for (size_t b = 0; b < 3; ++b)
    for (const auto& p : net->blocks[b]->parameters()) checkpointed.insert(p.unsafeGetTensorImpl());
  const auto params = net->parameters();
  std::vector<int> runs(params.size(), 0);
  std::vector<char> given(params.size(), 0);
  std::vector<at::Tensor> seen(params.size());
  std::vector<std::pair<detail::GradAccumulator, uintptr_t>> hooks;
  for (size_t i = 0; i < params.size(); ++i) {
    auto accumulator = torch::autograd::impl::grad_accumulator(params[i]);
    const auto key =
        accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
            [&, i](const torch::autograd::variable_list& outputs,
                   const torch::autograd::variable_list& inputs) {
              ++runs[i];
              given[i] = inputs.at(0).defined();
              seen[i] = params[i].grad().clone();
              return outputs;
            }));
    hooks.emplace_back(std::move(accumulator), key);
  }
  for (int step = 1; step <= 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const Step expected = run_step(plain);
    const Step actual = run_step(net);
    expect_same_step(expected, actual);
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_EQ(runs[i], step) << "parameter " << i;
      EXPECT_EQ(given[i] != 0, checkpointed.count(params[i].unsafeGetTensorImpl()) == 0)
          << "parameter " << i;
      ASSERT_TRUE(seen[i].defined()) << "parameter " << i;
      EXPECT_TRUE(torch::allclose(seen[i], expected.grads[i], 0, 1e-6)) << "parameter " << i;
    }
  }
  for (auto& [accumulator, key] : hooks) accumulator->del_post_hook(key);
}

// A hook on a checkpointed parameter (register_hook) sees its gradient once, as without
// checkpointing, and what it returns is what accumulates.
TEST(ActivationCheckpointing, AHookOnACheckpointedParameterRunsOnce) {
  std::vector<Step> steps;
  for (const bool checkpointed : {false, true}) {
    SCOPED_TRACE(checkpointed ? "checkpointed" : "plain");
    auto net = seeded_net();
    if (checkpointed) apply_activation_checkpointing(*net, {.every = 1});
    int calls = 0;
    net->blocks[0]->module_as<RecomputedBlockImpl>()->fc->weight.register_hook(
        [&calls](const at::Tensor& grad) {
          ++calls;
          return grad * 2;
        });
    steps.push_back(run_step(net));
    EXPECT_EQ(calls, 1);
  }
  expect_same_step(steps[0], steps[1]);
}

// torch::autograd::grad by the parameters through checkpointed units: their plain gradients,
// and nothing accumulated into .grad.
TEST(ActivationCheckpointing, GradByTheParametersLeavesTheirGradAlone) {
  std::vector<std::vector<at::Tensor>> grads;
  for (const bool checkpointed : {false, true}) {
    auto net = seeded_net();
    if (checkpointed) apply_activation_checkpointing(*net, {.every = 1});
    torch::manual_seed(7);
    const auto loss = net->forward(torch::randn({5, 6})).pow(2).mean();
    grads.push_back(torch::autograd::grad({loss}, net->parameters()));
    for (const auto& p : net->parameters()) EXPECT_FALSE(p.grad().defined());
  }
  ASSERT_EQ(grads[0].size(), grads[1].size());
  for (size_t i = 0; i < grads[0].size(); ++i)
    EXPECT_TRUE(torch::allclose(grads[0][i], grads[1][i], 0, 1e-6)) << "parameter " << i;
}

TEST(ActivationCheckpointing, AParameterLeftOutIsNamedNotLost) {
  torch::manual_seed(3);
  const at::Tensor w = torch::randn({3, 4}).requires_grad_(true);
  const at::Tensor x = torch::randn({2, 3}).requires_grad_(true);
  const auto out = checkpoint(
      [&](const std::vector<at::Tensor>& in) { return std::vector{in[0].matmul(w)}; }, {x}, {});
  try {
    out[0].sum().backward();
    FAIL() << "backward went through without w's gradient";
  } catch (const std::exception& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("CheckpointOptions::parameters"), std::string::npos) << message;
    EXPECT_NE(message.find("[3, 4]"), std::string::npos) << message;
  }
}

TEST(ActivationCheckpointing, PoliciesParseAndBadOnesAreNamed) {
  EXPECT_FALSE(parse_activation_checkpointing("none").enabled());
  EXPECT_EQ(parse_activation_checkpointing("every:3").every, 3);
  EXPECT_EQ(parse_activation_checkpointing("layers:a,b.c").layers,
            (std::vector<std::string>{"a", "b.c"}));
  for (const std::string text : {"every:2", "layers:blocks.0,RecomputedBlock", "none"})
    EXPECT_EQ(to_string(parse_activation_checkpointing(text)), text);
  const auto message_of = [](const std::string& text) {
    try {
      parse_activation_checkpointing(text);
    } catch (const UsageError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message_of("every:0").find("'every:0': K must be >= 1"), std::string::npos);
  EXPECT_NE(message_of("every:x").find("K must be an integer"), std::string::npos);
  EXPECT_NE(message_of("layers:").find("a layer name is empty"), std::string::npos);
  EXPECT_NE(message_of("layers:a,,b").find("a layer name is empty"), std::string::npos);
  EXPECT_NE(message_of("sometimes").find("give none, every:K"), std::string::npos);
  EXPECT_THROW((ActivationCheckpointing{.every = 2, .layers = {"a"}}.validate()), UsageError);
}

TEST(ActivationCheckpointing, PoliciesChooseUnitsByPositionNameOrTypeAndNameWhatIsMissing) {
  auto net = seeded_net();
  const auto names = [&](const std::string& policy, UnitChoiceOptions options = {}) {
    std::vector<std::string> out;
    for (const auto& u : checkpointed_units(*net, parse_activation_checkpointing(policy), options))
      out.push_back(u.name);
    return out;
  };
  // Without a pipeline every:K leaves the last unit plain; a pipeline's stages count it.
  using Names = std::vector<std::string>;
  EXPECT_EQ(names("every:1"), (Names{"block0", "block1", "block2"}));
  EXPECT_EQ(names("every:1", {.pipeline = true}), (Names{"block0", "block1", "block2", "block3"}));
  EXPECT_EQ(names("every:2"), (Names{"block1"}));
  EXPECT_EQ(names("every:2", {.pipeline = true}), (Names{"block1", "block3"}));
  EXPECT_EQ(names("every:4", {.pipeline = true}), (Names{"block3"}));
  testing::expect_error<UsageError>([&] { names("every:4"); },
                                    "every:4 chooses none of the model's 4 units but the last "
                                    "(block3), which backward recomputes right after the forward, "
                                    "saving no memory: use every:K with K <= 3");
  // Names are taken as written, the last unit's too.
  EXPECT_EQ(names("layers:block0,block2"), (Names{"block0", "block2"}));
  EXPECT_EQ(names("layers:block3"), (Names{"block3"}));
  EXPECT_EQ(names("layers:RecomputedBlock").size(), 4u);
  EXPECT_TRUE(names("none").empty());
  try {
    checkpointed_units(*net, parse_activation_checkpointing("layers:block9"));
    FAIL();
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("no unit named or of type 'block9'; its units: block0 "
                                         "(RecomputedBlock), block1 (RecomputedBlock)"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(checkpointed_units(*net, parse_activation_checkpointing("every:5")), UsageError);
  // A model without units says how to make some.
  torch::nn::Linear bare(2, 2);
  try {
    checkpointed_units(*bare, {.every = 1});
    FAIL();
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("wrap its layers in parallel::FullyShard"),
              std::string::npos);
  }
  // A model of one unit: every:1 would only recompute it at once; naming it checkpoints it.
  auto one = torch::nn::Sequential(FullyShard(torch::nn::Linear(2, 2)));
  testing::expect_error<UsageError>([&] { checkpointed_units(*one, {.every = 1}); },
                                    "the model's one unit, 0, is recomputed in backward right "
                                    "after the forward, which saves no memory; give layers:0 to "
                                    "checkpoint it anyway");
  EXPECT_EQ(checkpointed_units(*one, {.layers = {"0"}}).size(), 1u);
  // Applying a policy marks exactly its units, and a second one replaces the first.
  apply_activation_checkpointing(*net, parse_activation_checkpointing("every:1"));
  apply_activation_checkpointing(*net, parse_activation_checkpointing("layers:block2"));
  for (size_t i = 0; i < net->blocks.size(); ++i)
    EXPECT_EQ(net->blocks[i]->activation_checkpointing(), i == 2) << i;
}

// Megatron-style tensor-parallel units recompute their collectives alike on every rank.
TEST(ActivationCheckpointing, TensorParallelUnitsGiveThePlainGradients) {
  testing::run_ranks(2, [](comm::ProcessGroup& group) {
    const auto make = [&] {
      std::lock_guard lock(testing::generator_mutex());
      torch::manual_seed(11);
      return TensorParallelMlp(8, 16, group);
    };
    auto plain = make(), checkpointed = make();
    at::Tensor x;
    {
      std::lock_guard lock(testing::generator_mutex());
      torch::manual_seed(12);
      x = torch::randn({3, 8});
    }
    const at::Tensor xp = x.clone().requires_grad_(true), xc = x.clone().requires_grad_(true);
    plain->forward(xp).pow(2).sum().backward();
    // The ranks are threads sharing one generator: nothing here draws from it.
    auto options = checkpoint_options_of(*checkpointed);
    options.preserve_rng_state = false;
    checkpoint(
        [&](const std::vector<at::Tensor>& in) {
          return std::vector{checkpointed->forward(in[0])};
        },
        {xc}, options)[0]
        .pow(2)
        .sum()
        .backward();
    EXPECT_TRUE(torch::allclose(xp.grad(), xc.grad(), 0, 1e-6));
    const auto a = plain->parameters(), b = checkpointed->parameters();
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i)
      EXPECT_TRUE(torch::allclose(a[i].grad(), b[i].grad(), 0, 1e-6)) << i;
  });
}

TEST(ActivationCheckpointing, CheckpointedUnitsGiveThePlainGradientsOnTheGpu) {
  COHORT_REQUIRE_CUDA();
  const auto step = [](RecomputedNet& net) {
    net->to(torch::kCUDA);
    torch::manual_seed(7);
    const at::Tensor x = torch::randn({5, 6}, torch::kCUDA);
    net->forward(x).pow(2).mean().backward();
    std::vector<at::Tensor> grads;
    for (const auto& p : net->parameters()) grads.push_back(p.grad().cpu());
    return grads;
  };
  expect_plain_gradients(step);
}

}  // namespace
}  // namespace cohort::parallel

#include "cohort/models/zoo.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <tuple>

#include "cohort/error.h"
#include "cohort/models/model_spec.h"
#include "cohort/optim/flat_optimizer.h"
#include "cohort/parallel/activation_checkpointing.h"
#include "cohort/parallel/distributed_data_parallel.h"
#include "cohort/parallel/fully_shard.h"
#include "cohort/parallel/zero_optimizer.h"
#include "support/expect.h"
#include "support/local_group.h"

namespace cohort::models {
namespace {

int64_t count_parameters(const ZooModel& m) {
  int64_t n = 0;
  for (const auto& p : m->parameters()) n += p.numel();
  return n;
}

TEST(Zoo, SeedArchitecturesHaveTheirParameterCounts) {
  // Seed 000's MLP and CNN, seed 002's resnet18 with a 1-channel stem and 10 classes.
  EXPECT_EQ(count_parameters(create_model("mlp")), 784 * 128 + 128 + 128 * 64 + 64 + 64 * 10 + 10);
  EXPECT_EQ(count_parameters(create_model("cnn")),
            (32 * 9 + 32) + (64 * 32 * 9 + 64) + (64 * 7 * 7 * 128 + 128) + (128 * 10 + 10));
  // torchvision's resnet18 has 11,689,512 parameters with 3 input channels and 1000 classes.
  EXPECT_EQ(count_parameters(create_model("resnet18")),
            11'689'512 - 64 * 2 * 49 - (512 * 990 + 990));
}

TEST(Zoo, ModelOptionsComeBackFromJsonAndABadValueIsNamed) {
  ModelOptions options;
  options.num_classes = 3;
  options.in_channels = 3;
  options.image_size = 32;
  options.depth = 2;
  options.width = 48;
  options.heads = 6;
  options.context = 64;
  options.tie_embeddings = false;
  options.deferred_init = true;
  const auto read = Json(options).get<ModelOptions>();
  EXPECT_EQ(Json(read), Json(options));
  EXPECT_EQ(read.image_size, 32);
  EXPECT_EQ(read.heads, 6);
  EXPECT_FALSE(read.tie_embeddings);
  EXPECT_TRUE(read.deferred_init);
  // A missing key keeps its default; a value of the wrong type names its key.
  const auto deeper = Json{{"depth", 8}}.get<ModelOptions>();
  EXPECT_EQ(deeper.depth, 8);
  EXPECT_EQ(deeper.width, ModelOptions{}.width);
  cohort::testing::expect_error<UsageError>(
      [] {
        Json{{"heads", 2.5}}.get<ModelOptions>();
      },
      "field 'heads'");
}

TEST(Zoo, OptionsForDataTakeItsShapeOrItsVocabulary) {
  data::LabelledData images;
  images.channels = 3;
  images.image_size = 32;
  images.num_classes = 5;
  ModelOptions base;
  base.depth = 2;
  const auto image_options = options_for_data(images, base);
  EXPECT_EQ(image_options.in_channels, 3);
  EXPECT_EQ(image_options.image_size, 32);
  EXPECT_EQ(image_options.num_classes, 5);
  EXPECT_EQ(image_options.depth, 2);  // the rest is the base's
  EXPECT_EQ(image_options.vocab_size, ModelOptions{}.vocab_size);
  data::LabelledData text;
  text.kind = data::LabelledData::Kind::kText;
  text.num_classes = 256;
  text.context = 48;
  const auto text_options = options_for_data(text);
  EXPECT_EQ(text_options.vocab_size, 256);
  EXPECT_EQ(text_options.context, 48);
}

TEST(Zoo, APlanTheModelCannotTakeIsNamedBeforeAnyWorkerStarts) {
  const auto problem = [](const std::string& name, const ModelOptions& options,
                          const train::Plan& plan) -> std::string {
    try {
      check_plan(name, options, plan);
    } catch (const UsageError& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_EQ(problem("mlp", {}, {.pp = 2}), "");
  EXPECT_EQ(problem("vit", {}, {.tp = 2}), "");
  EXPECT_EQ(problem("mlp", {}, {.pp = 4}),
            "mlp has 3 layers, too few for 4 pipeline stages (--pp 4): use a smaller --pp or a "
            "deeper model (resnet18 has 10, vit and gpt --layers + 2)");
  EXPECT_NE(
      problem("mlp", {}, {.pp = 2, .schedule = parallel::pipeline::ScheduleKind::kInterleaved})
          .find("too few for 4 pipeline stages (--pp 2, 2 per worker with --schedule "
                "interleaved)"),
      std::string::npos);
  EXPECT_EQ(problem("cnn", {}, {.tp = 2}),
            "--tp 2: cnn has no tensor-parallel layers; use --model vit or gpt, or --pp to cut "
            "cnn into pipeline stages");
  ModelOptions three_heads;
  three_heads.heads = 3;
  three_heads.width = 96;
  EXPECT_EQ(problem("gpt", three_heads, {.tp = 2}),
            "--tp 2 must divide the gpt's 3 heads (--heads) and 384 MLP features (4 x --width)");
  // Tied embeddings across pipeline stages: with DDP and with ZeRO.
  EXPECT_EQ(problem("gpt", {}, {.pp = 2}), "");
  EXPECT_EQ(problem("gpt", {}, {.pp = 2, .zero = {.stage = 1}}), "");
  EXPECT_EQ(problem("gpt", {}, {.pp = 2, .zero = {.stage = 3}}), "");
  ModelOptions untied;
  untied.tie_embeddings = false;
  EXPECT_EQ(problem("gpt", untied, {.pp = 2, .zero = {.stage = 1}}), "");
}

TEST(Zoo, EveryModelScoresABatch) {
  for (const auto& name : model_names()) {
    auto model = create_model(name);
    const auto [x, y] = model->sample_batch(3);
    auto out = model->forward(x);
    // A classifier's logits per image; the GPT's per token, over its 256 byte values.
    const auto want =
        name == "gpt" ? std::vector<int64_t>{3, 128, 256} : std::vector<int64_t>{3, 10};
    EXPECT_EQ(out.sizes(), want) << name;
    logits_cross_entropy(out, y).backward();
    for (const auto& p : model->parameters()) EXPECT_TRUE(p.grad().defined()) << name;
  }
}

// ZeRO stage 3 shards each model's layers (every FullyShard unit, however small) and trains as
// DDP does: the same losses and parameters after two steps on two ranks.
TEST(Zoo, EveryModelTrainsUnderZeroStageThreeAsUnderDdp) {
  cohort::testing::run_ranks(2, [](comm::ProcessGroup& g) {
    for (const auto& name : model_names()) {
      auto run = [&](bool zero) {
        ZooModel model;
        {
          std::lock_guard lock(testing::generator_mutex());
          torch::manual_seed(9);
          model = create_model(name, {.depth = 2, .width = 32, .context = 16});
        }
        torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
        std::unique_ptr<parallel::DistributedDataParallel> ddp;
        std::unique_ptr<parallel::ZeroOptimizer> sharded;
        if (zero) {
          sharded = std::make_unique<parallel::ZeroOptimizer>(
              model, sgd, g, parallel::ZeroOptions{.stage = 3, .param_persistence_threshold = 0});
          EXPECT_GE(sharded->stats().units, 2) << name;  // vit, gpt: their 2 blocks
        } else {
          ddp = std::make_unique<parallel::DistributedDataParallel>(model, g);
        }
        torch::optim::Optimizer& optimizer =
            zero ? static_cast<torch::optim::Optimizer&>(*sharded) : sgd;
        std::vector<double> losses;
        for (int step = 0; step < 2; ++step) {
          torch::Tensor x, y;
          {
            std::lock_guard lock(testing::generator_mutex());
            torch::manual_seed(100 + 10 * g.rank() + step);
            std::tie(x, y) = model->sample_batch(2);
          }
          optimizer.zero_grad();
          auto loss = logits_cross_entropy(model->forward(x), y);
          loss.backward();
          optimizer.step();
          losses.push_back(loss.item<double>());
        }
        std::vector<torch::Tensor> params;
        std::optional<parallel::ZeroOptimizer::GatheredParameters> whole;
        if (sharded) whole.emplace(*sharded);
        for (const auto& p : model->parameters()) params.push_back(p.detach().clone());
        return std::make_pair(losses, params);
      };
      const auto [ddp_losses, ddp_params] = run(false);
      const auto [zero_losses, zero_params] = run(true);
      for (size_t s = 0; s < ddp_losses.size(); ++s)
        EXPECT_NEAR(zero_losses[s], ddp_losses[s], 1e-5 * std::abs(ddp_losses[s])) << name;
      ASSERT_EQ(zero_params.size(), ddp_params.size());
      for (size_t i = 0; i < ddp_params.size(); ++i) {
        EXPECT_TRUE(torch::allclose(zero_params[i], ddp_params[i], 1e-4, 1e-6))
            << name << " parameter " << i << " differs by "
            << (zero_params[i] - ddp_params[i]).abs().max().item<double>();
      }
    }
  });
}

// Every model's units recompute to the same loss, gradients and BatchNorm statistics as the plain
// model, with each unit checkpointed.
TEST(Zoo, EveryModelCheckpointsEveryUnitToThePlainGradients) {
  for (const auto& name : model_names()) {
    SCOPED_TRACE(name);
    const auto step = [&](bool checkpointed) {
      torch::manual_seed(9);
      auto model = create_model(name, {.depth = 2, .width = 32, .context = 16});
      if (checkpointed) {
        // Every unit, the last included (as a pipeline counts them).
        const auto units =
            parallel::apply_activation_checkpointing(*model, {.every = 1}, {.pipeline = true});
        EXPECT_GE(units.size(), 2u);
      }
      torch::manual_seed(10);
      const auto [x, y] = model->sample_batch(3);
      const auto loss = logits_cross_entropy(model->forward(x), y);
      loss.backward();
      std::vector<torch::Tensor> state{loss.detach()};
      for (const auto& p : model->parameters()) state.push_back(p.grad().clone());
      for (const auto& b : model->buffers()) state.push_back(b.clone());
      return state;
    };
    const auto plain = step(false), checkpointed = step(true);
    ASSERT_EQ(plain.size(), checkpointed.size());
    for (size_t i = 0; i < plain.size(); ++i) {
      EXPECT_TRUE(
          torch::allclose(checkpointed[i].to(torch::kDouble), plain[i].to(torch::kDouble), 0, 1e-6))
          << "tensor " << i << " differs by "
          << (checkpointed[i].to(torch::kDouble) - plain[i].to(torch::kDouble))
                 .abs()
                 .max()
                 .item<double>();
    }
  }
}

// Deferred initialisation: the units hold no weights until materialised, and then the weights
// of an ordinary build with the same seed, bit for bit; torch's generator is where an ordinary
// build leaves it.
TEST(Zoo, EveryModelBuiltDeferredMaterialisesToTheOrdinaryWeights) {
  for (const auto& name : model_names()) {
    SCOPED_TRACE(name);
    const auto build = [&](bool deferred) {
      torch::manual_seed(17);
      auto model =
          create_model(name, {.depth = 2, .width = 32, .context = 16, .deferred_init = deferred});
      return std::make_pair(model, torch::randn({4}));  // the generator's next draws
    };
    const auto [ordinary, next_ordinary] = build(false);
    const auto [deferred, next_deferred] = build(true);
    EXPECT_TRUE(torch::equal(next_deferred, next_ordinary));
    ASSERT_TRUE(parallel::has_deferred_units(*deferred));
    int64_t held = 0, whole = 0;
    for (const auto& p : deferred->parameters()) {
      held += static_cast<int64_t>(p.storage().nbytes());
      whole += p.numel() * p.element_size();
    }
    // mlp, cnn and resnet18 are all units; the transformers keep their embeddings and head.
    EXPECT_LT(held, whole / 2) << "held " << held << " of " << whole << " bytes";
    torch::manual_seed(99);
    parallel::materialize(*deferred);
    EXPECT_FALSE(parallel::has_deferred_units(*deferred));
    const auto after = torch::randn({4});
    torch::manual_seed(99);
    EXPECT_TRUE(torch::equal(after, torch::randn({4})))
        << "materialising leaves the generator where it was";
    const auto want = ordinary->named_parameters();
    for (const auto& p : deferred->named_parameters()) {
      EXPECT_FALSE(parallel::is_deferred(p.value())) << p.key();
      EXPECT_TRUE(torch::equal(p.value(), want[p.key()])) << p.key();
    }
  }
}

// ZeRO stage 3 materialises a deferred model one unit at a time, keeping its shard, and trains
// as it does the ordinary model: the same losses and weights, bit for bit. The user's flat
// optimizer, built over the deferred parameters, allocates nothing for them.
TEST(Zoo, StageThreeShardsADeferredModelAsItShardsTheOrdinaryOne) {
  cohort::testing::run_ranks(2, [](comm::ProcessGroup& g) {
    auto run = [&](bool deferred, int64_t threshold) {
      ZooModel model;
      std::vector<std::pair<torch::Tensor, torch::Tensor>> batches;
      {
        // The batches drawn first: the ranks' threads share torch's generator, which
        // materialising a unit sets and restores.
        std::lock_guard lock(testing::generator_mutex());
        torch::manual_seed(5);
        model =
            create_model("gpt", {.depth = 3, .width = 32, .context = 8, .deferred_init = deferred});
        for (int step = 0; step < 3; ++step) {
          torch::manual_seed(40 + 10 * g.rank() + step);
          batches.push_back(model->sample_batch(2));
        }
      }
      // No rank materialises (which sets and restores torch's generator) while another still
      // draws from it above.
      g.barrier();
      optim::FlatAdamW adam(model->parameters(), torch::optim::AdamWOptions(1e-2));
      parallel::ZeroOptimizer zero(
          model, adam, g,
          parallel::ZeroOptions{.stage = 3, .param_persistence_threshold = threshold});
      EXPECT_FALSE(parallel::has_deferred_units(*model));
      std::vector<double> losses;
      for (int step = 0; step < 3; ++step) {
        const auto& [x, y] = batches[static_cast<size_t>(step)];
        zero.zero_grad();
        auto loss = logits_cross_entropy(model->forward(x), y);
        loss.backward();
        zero.step();
        losses.push_back(loss.item<double>());
      }
      parallel::ZeroOptimizer::GatheredParameters whole(zero);
      std::vector<torch::Tensor> params;
      for (const auto& p : model->parameters()) params.push_back(p.detach().clone());
      return std::make_pair(losses, params);
    };
    // Every block a unit; and none (blocks below the threshold stay whole on every rank).
    for (const int64_t threshold : {int64_t{0}, int64_t{1} << 30}) {
      const auto [ordinary_losses, ordinary] = run(false, threshold);
      const auto [deferred_losses, deferred] = run(true, threshold);
      EXPECT_EQ(deferred_losses, ordinary_losses) << "threshold " << threshold;
      ASSERT_EQ(deferred.size(), ordinary.size());
      for (size_t i = 0; i < ordinary.size(); ++i) {
        EXPECT_TRUE(torch::equal(deferred[i], ordinary[i]))
            << "parameter " << i << ", threshold " << threshold;
      }
    }
  });
}

TEST(Zoo, VitIsConfigurable) {
  auto vit = create_model("vit", {.num_classes = 5,
                                  .in_channels = 3,
                                  .image_size = 32,
                                  .patch_size = 8,
                                  .depth = 2,
                                  .width = 64,
                                  .heads = 4});
  EXPECT_EQ(vit->forward(torch::randn({2, 3, 32, 32})).sizes(), (std::vector<int64_t>{2, 5}));
  EXPECT_THROW(create_model("vit", {.image_size = 30, .patch_size = 7}), UsageError);
  EXPECT_THROW(create_model("vit", {.width = 100, .heads = 3}), UsageError);
}

// The nodes of checkpointed units (parallel::checkpoint's) in the graph that made `output`.
int checkpointed_nodes(const torch::Tensor& output) {
  std::set<const torch::autograd::Node*> seen;
  std::vector<const torch::autograd::Node*> todo{output.grad_fn().get()};
  int found = 0;
  while (!todo.empty()) {
    const auto* node = todo.back();
    todo.pop_back();
    if (node == nullptr || !seen.insert(node).second) continue;
    found += node->name().find("CheckpointFunction") != std::string::npos;
    for (const auto& edge : node->next_edges()) todo.push_back(edge.function.get());
  }
  return found;
}

TEST(Zoo, PipelineLayersComposeToTheModelAndHoldEachParameterOnce) {
  const std::map<std::string, size_t> layer_counts{
      {"mlp", 3}, {"cnn", 4}, {"resnet18", 10}, {"vit", 4 + 2}, {"gpt", 4 + 2}};
  for (const auto& name : model_names()) {
    torch::manual_seed(5);
    auto model = create_model(name);
    model->eval();  // batch norm with its running statistics: both passes alike
    const auto x = model->sample_batch(3).first;
    auto layers = model->pipeline_layers();
    EXPECT_EQ(layers->size(), layer_counts.at(name)) << name;
    const auto whole = model->forward(x);
    const auto composed = layers->forward(x);
    EXPECT_TRUE(torch::equal(whole, composed)) << name;
    // The layers' parameters are the model's own tensors, each in exactly one layer.
    std::set<const void*> model_params, seen;
    for (const auto& p : model->parameters()) model_params.insert(p.unsafeGetTensorImpl());
    for (const auto& child : layers->children()) {
      for (const auto& p : child->parameters()) {
        EXPECT_TRUE(model_params.count(p.unsafeGetTensorImpl())) << name << ": a copy";
        EXPECT_TRUE(seen.insert(p.unsafeGetTensorImpl()).second) << name << ": in two layers";
      }
    }
    EXPECT_EQ(seen, model_params) << name << ": a parameter in no layer";
    // The model's units, which ZeRO stage 3 gathers and activation checkpointing recomputes, are
    // the layers' too.
    const auto units = [](const torch::nn::Module& m) {
      std::set<const void*> found;
      for (const auto& child : m.modules()) {
        if (dynamic_cast<const parallel::FullyShardImpl*>(child.get()) != nullptr)
          found.insert(child.get());
      }
      return found;
    };
    EXPECT_EQ(units(*layers), units(*model)) << name;
    EXPECT_FALSE(units(*model).empty()) << name;
    // The layers run the units as the model does: checkpointed, each recomputes in backward.
    {
      auto checkpointed = create_model(name);
      const auto marked =
          parallel::apply_activation_checkpointing(*checkpointed, {.every = 1}, {.pipeline = true});
      EXPECT_EQ(checkpointed_nodes(checkpointed->pipeline_layers()->forward(x)),
                static_cast<int>(marked.size()))
          << name;
    }
    // Training through the layers trains the model.
    composed.sum().backward();
    for (const auto& p : model->parameters()) EXPECT_TRUE(p.grad().defined()) << name;
  }
}

TEST(Zoo, AModelWithoutPipelineLayersSaysHowToGiveThem) {
  struct Custom : ZooModelImpl {
    torch::Tensor forward(torch::Tensor x) override { return x; }
  };
  cohort::testing::expect_error<UsageError>([] { Custom().pipeline_layers(); },
                                            "override pipeline_layers()");
}

TEST(Zoo, TensorParallelVitIsTheDenseVitSliced) {
  const ModelOptions options{
      .image_size = 28, .patch_size = 7, .depth = 2, .width = 32, .heads = 4};
  cohort::testing::run_ranks(2, [&](comm::ProcessGroup& tp) {
    std::unique_lock lock(cohort::testing::generator_mutex());
    torch::manual_seed(8);
    auto dense = create_model("vit", options);
    torch::manual_seed(8);
    auto sliced = create_model("vit", [&] {
      auto o = options;
      o.tensor_parallel_group = tp;
      return o;
    }());
    torch::manual_seed(9);
    const auto x = torch::randn({4, 1, 28, 28});
    lock.unlock();
    // Fewer parameters per rank: the blocks' attention and MLP weights are halves.
    int64_t dense_count = 0, sliced_count = 0;
    for (const auto& p : dense->parameters()) dense_count += p.numel();
    for (const auto& p : sliced->parameters()) sliced_count += p.numel();
    EXPECT_LT(sliced_count, dense_count);
    const auto y_dense = dense->forward(x), y_sliced = sliced->forward(x);
    EXPECT_TRUE(torch::allclose(y_dense, y_sliced, 1e-5, 1e-6))
        << "largest difference " << (y_dense - y_sliced).abs().max().item<double>();
    y_dense.pow(2).sum().backward();
    y_sliced.pow(2).sum().backward();
    // The replicated parameters (embedding, norms, head) get the dense gradients, to float
    // rounding (relative to the gradient's largest element).
    const auto dense_params = dense->named_parameters(), sliced_params = sliced->named_parameters();
    for (const auto* key :
         {"patch_embed.weight", "cls_token", "positions", "blocks.0.norm1.weight", "head.weight"}) {
      const auto want = dense_params[key].grad(), got = sliced_params[key].grad();
      const double scale = want.abs().max().item<double>();
      EXPECT_LT((want - got).abs().max().item<double>(), 1e-5 * scale)
          << key << " on rank " << tp.rank();
    }
  });
}

// A checkpoint of a tensor-parallel ViT holds the dense model: gathering the slices gives the
// dense weights back, and slicing them gives the same model again.
TEST(Zoo, TensorParallelVitGathersIntoTheDenseVitAndBack) {
  const ModelOptions options{
      .image_size = 28, .patch_size = 7, .depth = 2, .width = 32, .heads = 4};
  cohort::testing::run_ranks(2, [&](comm::ProcessGroup& tp) {
    std::unique_lock lock(cohort::testing::generator_mutex());
    torch::manual_seed(21);
    auto trained = create_model("vit", options);  // stands for any dense weights
    torch::manual_seed(22);
    auto sliced_options = options;
    sliced_options.tensor_parallel_group = tp;
    auto sliced = create_model("vit", sliced_options);
    torch::manual_seed(23);
    auto gathered = create_model("vit", options);
    lock.unlock();
    auto& vit = dynamic_cast<VisionTransformerImpl&>(*sliced);
    vit.load_from_dense(dynamic_cast<VisionTransformerImpl&>(*trained));
    vit.copy_to_dense(dynamic_cast<VisionTransformerImpl&>(*gathered));
    const auto want = trained->named_parameters(), got = gathered->named_parameters();
    ASSERT_EQ(want.size(), got.size());
    for (const auto& p : want) {
      EXPECT_TRUE(torch::equal(p.value(), got[p.key()])) << p.key() << " on rank " << tp.rank();
    }
  });
}

TEST(Zoo, TensorParallelismThatDoesNotFitIsNamed) {
  cohort::testing::run_ranks(2, [](comm::ProcessGroup& tp) {
    cohort::testing::expect_error<UsageError>(
        [&] { create_model("mlp", {.tensor_parallel_group = tp}); },
        "mlp has no tensor-parallel layers");
    cohort::testing::expect_error<UsageError>(
        [&] { create_model("vit", {.width = 96, .heads = 3, .tensor_parallel_group = tp}); },
        "use a tp degree that divides both");
  });
}

// A decoder: the logits at position t depend on the tokens up to t only.
TEST(Zoo, GptAttendsToThePastOnly) {
  torch::manual_seed(3);
  auto gpt = create_model("gpt", {.depth = 2, .width = 32, .heads = 4, .context = 12});
  const auto tokens = torch::randint(0, 256, {2, 12});
  auto changed = tokens.clone();
  changed.select(1, 7).fill_(0).add_(tokens.select(1, 7).add(1).remainder(256));
  const auto a = gpt->forward(tokens), b = gpt->forward(changed);
  EXPECT_TRUE(torch::equal(a.narrow(1, 0, 7), b.narrow(1, 0, 7)));
  EXPECT_GT((a.narrow(1, 7, 5) - b.narrow(1, 7, 5)).abs().max().item<double>(), 1e-4);
  // Shorter sequences are the prefix's logits.
  EXPECT_TRUE(torch::allclose(gpt->forward(tokens.narrow(1, 0, 5)), a.narrow(1, 0, 5), 1e-5, 1e-6));
}

TEST(Zoo, GptTiesItsHeadToTheTokenEmbedding) {
  const ModelOptions tied{.depth = 2, .width = 32, .heads = 4, .vocab_size = 50, .context = 8};
  auto untied_options = tied;
  untied_options.tie_embeddings = false;
  const auto gpt = create_model("gpt", tied), untied = create_model("gpt", untied_options);
  // Per block: 2 norms, q/k/v and output projection with biases, the MLP with biases.
  const int64_t w = 32, block = 2 * 2 * w + (3 * w * w + 3 * w) + (w * w + w) +
                                (w * 4 * w + 4 * w) + (4 * w * w + w);
  EXPECT_EQ(count_parameters(gpt), 50 * w + 8 * w + 2 * block + 2 * w);
  EXPECT_EQ(count_parameters(untied), count_parameters(gpt) + 50 * w);
  EXPECT_EQ(gpt->named_parameters().find("head.weight"), nullptr);
  // The head's gradient reaches the embedding: a token never input still gets one.
  const auto tokens = torch::zeros({1, 8}, torch::kLong);
  logits_cross_entropy(gpt->forward(tokens), torch::full({1, 8}, 7, torch::kLong)).backward();
  const auto embedding_grad = gpt->named_parameters()["token_embedding.weight"].grad();
  EXPECT_GT(embedding_grad[7].abs().sum().item<double>(), 0);
  // FLOPs per token: 6 per block and head weight, attention's 12 x depth x width x T.
  const auto& model = dynamic_cast<const GptImpl&>(*gpt);
  EXPECT_EQ(model.flops_per_token(8), 6 * (2 * 12 * w * w + w * 50) + 12 * 2 * w * 8);
}

TEST(Zoo, GptShapesThatDoNotFitAreNamed) {
  cohort::testing::expect_error<UsageError>([] { create_model("gpt", {.width = 100, .heads = 3}); },
                                            "gpt: width 100 is not divisible by heads 3");
  cohort::testing::expect_error<UsageError>([] { create_model("gpt", {.context = 0}); },
                                            "context=0 must be >= 1");
  auto gpt = create_model("gpt", {.depth = 1, .width = 16, .heads = 2, .context = 4});
  cohort::testing::expect_error<UsageError>(
      [&] {
        gpt->forward(torch::zeros({1, 5}, torch::kLong));
      },
      "T <= the context 4");
}

// Over several pipeline ranks the tied head's layer holds the embedding's weight too (the last
// stage's copy); on one rank only the embedding layer does, so its optimizer steps it once.
TEST(Zoo, ATiedGptsHeadLayerHoldsTheEmbeddingOnlyOverSeveralRanks) {
  auto gpt = create_model("gpt", {.depth = 2, .width = 16, .heads = 2, .context = 4});
  const auto weight = gpt->named_parameters()["token_embedding.weight"];
  const auto one = pipeline_layers(*gpt, 1), two = pipeline_layers(*gpt, 2);
  ASSERT_EQ(one->size(), 4u);
  ASSERT_EQ(two->size(), 4u);
  const auto head_one = one->ptr(3)->named_parameters(), head_two = two->ptr(3)->named_parameters();
  EXPECT_EQ(head_one.find("token_embedding.weight"), nullptr);
  ASSERT_NE(head_two.find("token_embedding.weight"), nullptr);
  EXPECT_TRUE(head_two["token_embedding.weight"].is_same(weight));
  EXPECT_EQ(head_two.size(), head_one.size() + 1);
  // Untied, the head has its own weight either way.
  auto untied = create_model(
      "gpt", {.depth = 2, .width = 16, .heads = 2, .context = 4, .tie_embeddings = false});
  EXPECT_EQ(pipeline_layers(*untied, 2)->ptr(3)->named_parameters().find("token_embedding.weight"),
            nullptr);
}

TEST(Zoo, TensorParallelGptIsTheDenseGptSliced) {
  const ModelOptions options{.depth = 2, .width = 32, .heads = 4, .context = 10};
  cohort::testing::run_ranks(2, [&](comm::ProcessGroup& tp) {
    std::unique_lock lock(cohort::testing::generator_mutex());
    torch::manual_seed(8);
    auto dense = create_model("gpt", options);
    torch::manual_seed(8);
    auto sliced_options = options;
    sliced_options.tensor_parallel_group = tp;
    auto sliced = create_model("gpt", sliced_options);
    torch::manual_seed(9);
    const auto [x, y] = dense->sample_batch(3);
    lock.unlock();
    const auto y_dense = dense->forward(x), y_sliced = sliced->forward(x);
    EXPECT_TRUE(torch::allclose(y_dense, y_sliced, 1e-5, 1e-5))
        << "largest difference " << (y_dense - y_sliced).abs().max().item<double>();
    logits_cross_entropy(y_dense, y).backward();
    logits_cross_entropy(y_sliced, y).backward();
    const auto dense_params = dense->named_parameters(), sliced_params = sliced->named_parameters();
    for (const auto* key : {"token_embedding.weight", "positions", "blocks.1.norm2.weight"}) {
      const auto want = dense_params[key].grad(), got = sliced_params[key].grad();
      const double scale = want.abs().max().item<double>();
      EXPECT_LT((want - got).abs().max().item<double>(), 1e-5 * scale)
          << key << " on rank " << tp.rank();
    }
    // Gathered back, the slices are the dense weights.
    torch::manual_seed(31);
    auto gathered = create_model("gpt", options);
    dynamic_cast<GptImpl&>(*sliced).copy_to_dense(dynamic_cast<GptImpl&>(*gathered));
    for (const auto& p : dense->named_parameters())
      EXPECT_TRUE(torch::equal(p.value(), gathered->named_parameters()[p.key()])) << p.key();
  });
}

TEST(Zoo, UnknownNameListsTheZoo) {
  cohort::testing::expect_error<UsageError>([] { create_model("alexnet"); },
                                            "mlp, cnn, resnet18, vit");
}

}  // namespace
}  // namespace cohort::models

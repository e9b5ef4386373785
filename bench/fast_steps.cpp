// Step time of seed 000's CNN and seed 002's ResNet-18 on the CPU (or --device cuda): libtorch's
// torch::optim against cohort's flat optimizers (SGD with momentum, Adam), and bf16 autocast
// against fp32. One process, one static batch of Fashion-MNIST resident in memory, so that the
// figures are the step itself. The variants run interleaved, round by round, and each figure is
// the median over rounds: a machine whose speed drifts treats them all alike.
//
// --device cuda adds the whole step captured as one CUDA graph (train::CapturedStep), and
// --epochs N trains seed 002's run on the device, eager against the graph.
//
// Prints a table, then one JSON line per model.
#include <torch/cuda.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <iomanip>
#include <iostream>

#include "cohort/cohort.h"
#include "cohort/models/zoo.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Variant {
  std::string optimizer;  // "sgd" or "adam"
  bool flat;
  cohort::optim::Precision precision;
  bool graph = false;  // the whole step as one CUDA graph (train::CapturedStep)
  std::string label() const {
    return std::string(flat ? "flat " : "torch::optim ") + optimizer + ", " +
           cohort::optim::to_string(precision) + (graph ? ", cuda graph" : "");
  }
};

struct Runner {
  cohort::models::ZooModel model;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  Variant variant;
  std::vector<double> step_ms, optimizer_ms, isolated_ms;
  int64_t steps = 0;
  std::unique_ptr<cohort::train::CapturedStep> captured;
};

// Seed 002's run with data resident on the device: `epochs` epochs of the training set in
// shuffled batches, Adam 1e-3 (flat), each step eager or one CUDA graph; returns the training
// seconds (evaluation excluded) and the test accuracy.
std::pair<double, double> train_epochs(const std::string& name, const torch::Device& device,
                                       const cohort::data::Batch& train,
                                       const cohort::data::Batch& test, int64_t batch_size,
                                       int epochs, bool graph) {
  torch::manual_seed(0);
  auto model = cohort::models::create_model(name);
  model->to(device);
  cohort::optim::FlatAdam optimizer(model->parameters(), torch::optim::AdamOptions(1e-3));
  auto step = [&](const std::vector<torch::Tensor>& in) {
    optimizer.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(model->forward(in[0]), in[1]);
    loss.backward();
    optimizer.step();
    return loss.detach();
  };
  cohort::train::CapturedStep captured(step, {.optimizer = &optimizer});
  const int64_t n = train.data.size(0);
  double seconds = 0;
  for (int epoch = 0; epoch < epochs; ++epoch) {
    model->train();
    if (device.is_cuda()) torch::cuda::synchronize();
    const auto start = Clock::now();
    const auto order = torch::randperm(n, torch::dtype(torch::kLong).device(device));
    for (int64_t from = 0; from < n; from += batch_size) {
      const auto rows = order.narrow(0, from, std::min(batch_size, n - from));
      const std::vector<torch::Tensor> in{train.data.index_select(0, rows),
                                          train.target.index_select(0, rows)};
      if (graph) {
        captured.run(in);
      } else {
        step(in);
      }
    }
    if (device.is_cuda()) torch::cuda::synchronize();
    seconds += std::chrono::duration<double>(Clock::now() - start).count();
    std::cerr << "\r" << name << (graph ? " (cuda graph)" : " (eager)") << ": epoch " << epoch + 1
              << "/" << epochs << std::flush;
  }
  std::cerr << "\r" << std::string(40, ' ') << "\r";
  if (graph && !captured.captured())
    std::cout << "  (the step was not captured: " << captured.fallback_reason() << ")\n";
  model->eval();
  torch::NoGradGuard no_grad;
  int64_t correct = 0;
  for (int64_t from = 0; from < test.data.size(0); from += 1000) {
    const auto len = std::min<int64_t>(1000, test.data.size(0) - from);
    correct += model->forward(test.data.narrow(0, from, len))
                   .argmax(1)
                   .eq(test.target.narrow(0, from, len))
                   .sum()
                   .item<int64_t>();
  }
  return {seconds, static_cast<double>(correct) / static_cast<double>(test.data.size(0))};
}

std::unique_ptr<torch::optim::Optimizer> make(const Variant& v, std::vector<torch::Tensor> p) {
  if (v.optimizer == "adam") {
    torch::optim::AdamOptions o(1e-3);
    if (v.flat) return std::make_unique<cohort::optim::FlatAdam>(p, o);
    return std::make_unique<torch::optim::Adam>(p, o);
  }
  auto o = torch::optim::SGDOptions(0.01).momentum(0.9);
  if (v.flat) return std::make_unique<cohort::optim::FlatSGD>(p, o);
  return std::make_unique<torch::optim::SGD>(p, o);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"cohort fast-step benchmark (CPU)"};
  std::vector<std::string> models{"cnn", "resnet18"};
  int64_t batch_size = 128;
  int rounds = 5;
  int steps = 5;
  int threads = 1;
  std::string data_dir = cohort::data::default_fashion_mnist_dir().string();
  app.add_option("--models", models, "zoo models")->capture_default_str();
  app.add_option("--batch-size", batch_size)->capture_default_str();
  app.add_option("--rounds", rounds, "rounds; each variant runs `steps` timed steps per round")
      ->capture_default_str();
  app.add_option("--steps", steps)->capture_default_str();
  app.add_option("--threads", threads, "torch intra-op threads")->capture_default_str();
  app.add_option("--data-dir", data_dir)->capture_default_str();
  std::string device_name = "cpu";
  app.add_option("--device", device_name, "cpu or cuda (batches resident there)")
      ->capture_default_str();
  int epochs = 0;
  app.add_option("--epochs", epochs,
                 "then train the first model for this many epochs on the whole training set "
                 "resident on the device, eager and (on a GPU) as a CUDA graph: training time "
                 "and test accuracy (seed 002: resnet18, 10)")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  torch::set_num_threads(threads);
  at::globalContext().setFlushDenormal(true);
  std::cout << "libtorch " << TORCH_VERSION << "; the flat optimizers step with "
            << (cohort::optim::FlatOptimizer::has_fused_kernels()
                    ? "libtorch's fused kernels"
                    : "vectorised operations (libtorch < 2.4 has no fused CPU kernels)")
            << std::endl;
  const auto train = cohort::data::load_mnist(data_dir, cohort::data::Split::kTrain);
  // Distinct batches, cycled: one batch repeated is learnt by heart, its gradients shrink into
  // denormal floats and the CPU slows down for reasons that have nothing to do with the step.
  constexpr int64_t kBatches = 16;
  std::vector<cohort::data::Batch> batches;
  for (int64_t b = 0; b < kBatches; ++b)
    batches.push_back(train.get_batch(torch::arange(b * batch_size, (b + 1) * batch_size)));
  const torch::Device device(device_name);
  if (device.is_cuda() && !torch::cuda::is_available()) {
    std::cerr << "--device cuda: this libtorch sees no CUDA device" << std::endl;
    return 2;
  }
  for (auto& b : batches) b = {b.data.to(device), b.target.to(device)};
  // The host waits for the device before reading the clock.
  auto sync = [&] {
    if (device.is_cuda()) torch::cuda::synchronize();
  };
  using cohort::optim::Precision;
  std::vector<Variant> variants{{"sgd", false, Precision::kFp32},
                                {"sgd", true, Precision::kFp32},
                                {"adam", false, Precision::kFp32},
                                {"adam", true, Precision::kFp32},
                                {"adam", true, Precision::kBf16}};
  const bool graphs = device.is_cuda() && cohort::train::CapturedStep::available();
  if (graphs) {
    variants.push_back({"sgd", true, Precision::kFp32, true});
    variants.push_back({"adam", true, Precision::kFp32, true});
  }
  for (const auto& name : models) {
    std::vector<Runner> runners;
    for (const auto& v : variants) {
      torch::manual_seed(0);
      auto model = cohort::models::create_model(name);
      model->to(device);
      auto optimizer = make(v, model->parameters());
      runners.push_back(Runner{model, std::move(optimizer), v, {}, {}});
    }
    auto one_step = [&](Runner& r, bool timed) {
      const auto& batch = batches[r.steps++ % kBatches];
      if (r.variant.graph) {
        if (!r.captured) {
          auto* flat = dynamic_cast<cohort::optim::FlatOptimizer*>(r.optimizer.get());
          r.captured = std::make_unique<cohort::train::CapturedStep>(
              [&r](const std::vector<torch::Tensor>& in) {
                r.optimizer->zero_grad();
                auto loss = torch::nn::functional::cross_entropy(r.model->forward(in[0]), in[1]);
                loss.backward();
                r.optimizer->step();
                return loss.detach();
              },
              cohort::train::CaptureOptions{.optimizer = flat});
        }
        sync();
        const auto start = Clock::now();
        r.captured->run({batch.data, batch.target});
        sync();
        if (timed) {
          r.step_ms.push_back(
              std::chrono::duration<double, std::milli>(Clock::now() - start).count());
          r.optimizer_ms.push_back(0);  // inside the graph: not separable
        }
        return;
      }
      sync();
      const auto start = Clock::now();
      r.optimizer->zero_grad();
      torch::Tensor loss;
      {
        cohort::optim::AutocastGuard autocast(r.variant.precision, device);
        loss = torch::nn::functional::cross_entropy(r.model->forward(batch.data), batch.target);
      }
      loss.backward();
      sync();
      const auto before_step = Clock::now();
      r.optimizer->step();
      sync();
      const auto end = Clock::now();
      if (timed) {
        r.step_ms.push_back(std::chrono::duration<double, std::milli>(end - start).count());
        r.optimizer_ms.push_back(
            std::chrono::duration<double, std::milli>(end - before_step).count());
      }
    };
    // Warm-up: state allocation, first-call costs, and the graphs' warm-up and capture.
    for (auto& r : runners)
      for (int s = 0; s < (r.variant.graph ? 5 : 1); ++s) one_step(r, false);
    for (int round = 0; round < rounds; ++round) {
      std::cerr << "\r" << name << ": round " << round + 1 << "/" << rounds << std::flush;
      for (auto& r : runners)
        for (int s = 0; s < steps; ++s) one_step(r, true);
    }
    std::cerr << "\r" << std::string(40, ' ') << "\r";
    // optimizer.step() alone, on fixed gradients of a typical size (1e-3): the optimizer's own
    // cost, whatever the model's state.
    for (auto& r : runners) {
      if (r.variant.graph) continue;  // its optimizer steps inside the graph
      torch::manual_seed(1);
      for (auto& p : r.model->parameters()) {
        p.mutable_grad() = torch::randn_like(p) * 1e-3;
      }
      r.optimizer->step();
    }
    for (int round = 0; round < rounds; ++round) {
      for (auto& r : runners) {
        if (r.variant.graph) continue;
        for (int s = 0; s < steps; ++s) {
          sync();
          const auto start = Clock::now();
          r.optimizer->step();
          sync();
          r.isolated_ms.push_back(
              std::chrono::duration<double, std::milli>(Clock::now() - start).count());
        }
      }
    }
    int64_t parameters = 0;
    for (const auto& p : runners.front().model->parameters()) parameters += p.numel();
    std::cout << name << " (" << parameters << " parameters) on " << device << ", batch "
              << batch_size << ", " << threads << " thread(s), median of " << rounds * steps
              << " steps:\n";
    cohort::Json line{{"model", name},
                      {"device", device.str()},
                      {"batch_size", batch_size},
                      {"threads", threads}};
    for (auto& r : runners) {
      const double step = median(r.step_ms);
      const double opt = median(r.optimizer_ms);
      const double isolated = median(r.isolated_ms);
      std::cout << "  " << std::left << std::setw(28) << r.variant.label() << std::right
                << std::fixed << std::setprecision(2) << std::setw(9) << step << " ms/step";
      if (r.variant.graph) {
        std::cout << "   (the optimizer steps inside the graph)\n";
      } else {
        std::cout << std::setw(9) << opt << " ms in optimizer.step()" << std::setw(9) << isolated
                  << " ms optimizer.step() alone\n";
      }
      line["variants"].push_back({{"variant", r.variant.label()},
                                  {"step_ms", step},
                                  {"optimizer_step_ms", opt},
                                  {"optimizer_alone_ms", isolated}});
    }
    auto ms = [&](size_t i) { return median(runners[i].step_ms); };
    auto opt_ms = [&](size_t i) { return median(runners[i].isolated_ms); };
    line["flat_sgd_speedup_optimizer"] = opt_ms(0) / opt_ms(1);
    line["flat_adam_speedup_optimizer"] = opt_ms(2) / opt_ms(3);
    line["flat_sgd_speedup_step"] = ms(0) / ms(1);
    line["flat_adam_speedup_step"] = ms(2) / ms(3);
    line["bf16_over_fp32_step"] = ms(4) / ms(3);
    if (graphs) {
      for (size_t i : {size_t{5}, size_t{6}}) {
        if (!runners[i].captured->captured())
          std::cout << "  " << runners[i].variant.label()
                    << ": not captured: " << runners[i].captured->fallback_reason() << "\n";
      }
      line["graph_sgd_speedup_step"] = ms(0) / ms(5);
      line["graph_adam_speedup_step"] = ms(2) / ms(6);
      std::cout << "  whole step as a CUDA graph: SGD " << std::setprecision(2)
                << line["graph_sgd_speedup_step"].get<double>()
                << "x torch::optim's eager step, Adam "
                << line["graph_adam_speedup_step"].get<double>() << "x\n";
    }
    std::cout << "  optimizer.step(): flat SGD " << std::setprecision(2)
              << line["flat_sgd_speedup_optimizer"].get<double>() << "x torch::optim, flat Adam "
              << line["flat_adam_speedup_optimizer"].get<double>() << "x; whole step: bf16 takes "
              << line["bf16_over_fp32_step"].get<double>() << "x fp32's time\n";
    std::cout << line.dump() << std::endl;
  }
  if (epochs > 0) {
    const auto all = [&](cohort::data::Split split) {
      const auto set = cohort::data::load_mnist(data_dir, split);
      auto b = set.get_batch(torch::arange(set.size()));
      return cohort::data::Batch{b.data.to(device), b.target.to(device)};
    };
    const auto train = all(cohort::data::Split::kTrain), test = all(cohort::data::Split::kTest);
    const auto& name = models.front();
    cohort::Json line{{"model", name}, {"device", device.str()}, {"epochs", epochs}};
    for (bool graph : {false, true}) {
      if (graph && !graphs) break;
      const auto [seconds, accuracy] =
          train_epochs(name, device, train, test, batch_size, epochs, graph);
      const std::string key = graph ? "cuda_graph" : "eager";
      std::cout << name << ", " << epochs << " epochs of Fashion-MNIST, batch " << batch_size
                << ", flat Adam 1e-3, " << key << ": " << std::setprecision(2) << seconds
                << " s of training, test accuracy " << std::setprecision(4) << accuracy << "\n";
      line[key] = {{"training_s", seconds}, {"test_accuracy", accuracy}};
    }
    std::cout << line.dump() << std::endl;
  }
}

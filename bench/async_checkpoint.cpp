// How long training stands still per checkpoint, saved synchronously and asynchronously
// (train::SaveOptions::async), for the zoo's GPT of about 100 M parameters on `--workers`
// processes with AdamW (fp32 state), each mode in the same run:
//
//   sync   the step waits while every rank writes its files into the run directory and rank 0
//          commits them (manifest with CRC-32, a durable rename)
//   async  the step waits only while every rank copies its files into memory (buffers kept from
//          save to save); the writing into the run directory and the commit run on a thread of
//          their own
//
// The workers train --steps steps on random tokens and report a checkpoint every --every steps.
// Printed per mode: the checkpoint's size, the stall per save (the report call, the slowest rank's:
// its mean, the first save's, the later saves' mean), the mean step time of the steps right after a
// save against the others (what the background copy takes from training on these cores), and
// whether the last checkpoint verifies against its manifest and equals the other mode's. Then one
// JSON line per mode.
//
//   bench/async_checkpoint                  (14 layers x 768: 99 M parameters, 4 workers)
#include <torch/torch.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <iomanip>
#include <iostream>

#include "cohort/cohort.h"
#include "cohort/models/model_spec.h"
#include "cohort/models/zoo.h"
#include "gpt_config.h"

namespace {

using cohort::Json;
namespace train = cohort::train;
namespace models = cohort::models;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double mean(const std::vector<double>& v) {
  double sum = 0;
  for (double x : v) sum += x;
  return v.empty() ? 0.0 : sum / static_cast<double>(v.size());
}

// A worker: --steps steps, a checkpoint every --every, each report call timed.
void worker_loop(const Json& c) {
  auto& ctx = train::get_context();
  const auto o = cohort::bench::gpt_options(c);
  train::Plan plan;
  plan.zero.stage = c["zero_stage"];
  auto model = train::parallelize(
      models::model_spec("gpt", o, 0),
      [](std::vector<at::Tensor> p) {
        return std::make_unique<cohort::optim::FlatAdamW>(p, torch::optim::AdamWOptions(1e-4));
      },
      models::logits_cross_entropy, plan);
  const train::SaveOptions save{.async = c["mode"] == "async"};
  const int64_t batch = c["batch_size"], steps = c["steps"], every = c["every"];
  std::vector<double> stalls, after_save, others;
  bool saved_last = false;
  for (int64_t step = 1; step <= steps; ++step) {
    torch::manual_seed(step + 1000 * ctx.get_world_rank());
    const auto tokens = torch::randint(0, o.vocab_size, {batch, o.context + 1});
    auto start = Clock::now();
    model.step(tokens.narrow(1, 0, o.context), tokens.narrow(1, 1, o.context));
    const double step_s = seconds_since(start);
    if (step > 1) (saved_last ? after_save : others).push_back(step_s);
    saved_last = step % every == 0;
    if (saved_last) {
      start = Clock::now();
      train::report({{"steps", model.steps()}}, model, save);
      stalls.push_back(seconds_since(start));
    }
    if (ctx.get_world_rank() == 0) {
      std::cerr << "  " << c["mode"].get<std::string>() << " step " << step << ": " << step_s
                << " s" << (saved_last ? ", save " + std::to_string(stalls.back()) + " s" : "")
                << std::endl;
    }
  }
  // The slowest rank's stall per save; every rank's step times.
  auto mine = torch::tensor(stalls, torch::kDouble);
  auto slowest = torch::stack(ctx.get_process_group().allgather(mine)).amax(0);
  const auto step_means = torch::stack(ctx.get_process_group().allgather(torch::tensor(
                                           {mean(after_save), mean(others)}, torch::kDouble)))
                              .mean(0);
  // The first asynchronous save allocates its buffers; the others reuse them.
  const auto later = slowest.numel() > 1 ? slowest.narrow(0, 1, slowest.numel() - 1) : slowest;
  train::report({{"stall_mean_s", slowest.mean().item<double>()},
                 {"stall_first_s", slowest[0].item<double>()},
                 {"stall_later_mean_s", later.mean().item<double>()},
                 {"stall_max_s", slowest.max().item<double>()},
                 {"saves", static_cast<int64_t>(stalls.size())},
                 {"step_after_save_s", step_means[0].item<double>()},
                 {"step_other_s", step_means[1].item<double>()}});
}

uintmax_t folder_bytes(const std::filesystem::path& dir) {
  uintmax_t total = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir))
    if (e.is_regular_file()) total += e.file_size();
  return total;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"training's stall per checkpoint, saved synchronously and asynchronously"};
  std::vector<std::string> modes{"sync", "async"};
  int workers = 4, zero_stage = 0;
  int64_t layers = 14, width = 768, heads = 12, context = 64, batch = 1, steps = 12, every = 3;
  app.add_option("--modes", modes, "sync, async")->delimiter(',')->capture_default_str();
  app.add_option("--workers", workers)->capture_default_str();
  app.add_option("--zero-stage", zero_stage, "0: DDP (rank 0 writes the whole state)")
      ->capture_default_str();
  app.add_option("--layers", layers)->capture_default_str();
  app.add_option("--width", width)->capture_default_str();
  app.add_option("--heads", heads)->capture_default_str();
  app.add_option("--context", context, "tokens per row")->capture_default_str();
  app.add_option("--batch-size", batch, "rows per worker and step")->capture_default_str();
  app.add_option("--steps", steps)->capture_default_str();
  app.add_option("--every", every, "steps between checkpoints")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  const auto dir = std::filesystem::temp_directory_path() /
                   ("cohort-bench-async-checkpoint-" + std::to_string(::getpid()));
  torch::manual_seed(0);
  int64_t parameters = 0;
  for (const auto& p : models::create_model("gpt", {.depth = layers,
                                                   .width = width,
                                                   .heads = heads,
                                                   .context = context,
                                                   .deferred_init = true})
                           ->parameters())
    parameters += p.numel();
  std::cout << "gpt: " << layers << " layers, width " << width << ": " << std::fixed
            << std::setprecision(1) << static_cast<double>(parameters) / 1e6 << " M parameters; "
            << workers << " workers, " << (zero_stage > 0 ? "ZeRO stage " : "DDP")
            << (zero_stage > 0 ? std::to_string(zero_stage) : "") << ", AdamW (fp32 state), "
            << steps << " steps, a checkpoint every " << every << "; libtorch " << TORCH_VERSION
            << std::endl;
  struct Row {
    std::string mode;
    Json metrics;
    double checkpoint_mb = 0;
    bool verified = false;
    std::map<std::string, at::Tensor> model;
  };
  std::vector<Row> rows;
  int failures = 0;
  for (const auto& mode : modes) {
    const Json config{{"mode", mode},   {"layers", layers},   {"width", width},
                      {"heads", heads}, {"context", context}, {"batch_size", batch},
                      {"steps", steps}, {"every", every},     {"zero_stage", zero_stage}};
    std::cout << mode << ": training " << steps << " steps..." << std::endl;
    const auto result = cohort::Trainer(worker_loop, {.num_workers = workers},
                                        {.name = mode, .storage_path = dir, .verbose = 0}, config)
                            .fit();
    if (!result.ok() || !result.checkpoint) {
      std::cout << mode << ": failed: " << result.error.value_or("no checkpoint") << std::endl;
      ++failures;
      continue;
    }
    Row row{.mode = mode, .metrics = result.metrics};
    row.checkpoint_mb = static_cast<double>(folder_bytes(result.checkpoint->path())) / 1e6;
    try {
      result.checkpoint->verify();
      row.verified = true;
      const auto file = dir / (mode + ".safetensors");
      train::consolidate_checkpoint(*result.checkpoint, file);
      row.model = cohort::safetensors::read(file);
      std::filesystem::remove(file);
    } catch (const std::exception& e) {
      std::cout << mode << ": " << e.what() << std::endl;
      ++failures;
    }
    rows.push_back(std::move(row));
  }
  std::cout << std::left << std::setw(8) << "mode" << std::right << std::setw(16) << "checkpoint MB"
            << std::setw(8) << "saves" << std::setw(14) << "stall mean s" << std::setw(14)
            << "first save s" << std::setw(16) << "later saves s" << std::setw(18)
            << "step after save" << std::setw(14) << "other steps" << std::setw(10) << "verifies"
            << std::endl;
  for (const auto& r : rows) {
    std::cout << std::left << std::setw(8) << r.mode << std::right << std::setprecision(1)
              << std::setw(16) << r.checkpoint_mb << std::setw(8) << r.metrics["saves"].get<int>()
              << std::setprecision(3) << std::setw(14) << r.metrics["stall_mean_s"].get<double>()
              << std::setw(14) << r.metrics["stall_first_s"].get<double>() << std::setw(16)
              << r.metrics["stall_later_mean_s"].get<double>() << std::setw(18)
              << r.metrics["step_after_save_s"].get<double>() << std::setw(14)
              << r.metrics["step_other_s"].get<double>() << std::setw(10)
              << (r.verified ? "yes" : "no") << std::endl;
  }
  if (rows.size() == 2 && !rows[0].model.empty() && !rows[1].model.empty()) {
    bool equal = rows[0].model.size() == rows[1].model.size();
    for (const auto& [name, tensor] : rows[0].model)
      equal = equal && rows[1].model.count(name) && torch::equal(rows[1].model.at(name), tensor);
    std::cout << "the last checkpoints of " << rows[0].mode << " and " << rows[1].mode << " are "
              << (equal ? "equal" : "NOT equal") << std::endl;
    failures += equal ? 0 : 1;
    const auto ratio = [&](const char* key) {
      return 100 * rows[1].metrics[key].get<double>() / rows[0].metrics[key].get<double>();
    };
    std::cout << rows[1].mode << " stalls " << std::setprecision(1) << ratio("stall_mean_s")
              << "% of " << rows[0].mode << " per checkpoint, " << ratio("stall_later_mean_s")
              << "% after the first save (which allocates the buffers); goal: at most 10%"
              << std::endl;
  }
  for (const auto& r : rows) {
    Json line = r.metrics;
    line["mode"] = r.mode;
    line["checkpoint_mb"] = r.checkpoint_mb;
    line["parameters"] = parameters;
    line["workers"] = workers;
    std::cout << line.dump() << std::endl;
  }
  if (!std::getenv("KEEP")) std::filesystem::remove_all(dir);
  return failures == 0 ? 0 : 1;
}

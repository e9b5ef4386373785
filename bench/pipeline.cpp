// Pipeline schedules on a pipeline of equal MLP blocks, one stage per worker process:
//   pipeline [--ranks 4] [--micro-batches 4,8,16] [--schedules gpipe,1f1b,interleaved,zero-bubble]
//            [--blocks 8] [--width 256] [--rows 16] [--steps 6]
// For each schedule and number of micro-batches m: the bubble by the formula, by the simulator
// (fed with the forward and backward times this run measured) and as measured from the ranks'
// timelines (the median step), the step time, the peak heap growth per rank during a step
// (measured: activations and gradients) and the peak live activations per rank (the
// simulator's count of micro-batch activations a stage holds at once). First, the whole model in
// one process on the same batch (m x rows rows), for the throughput ratio. Blocks are
// Linear(width, 2 width), GELU, Linear(2 width, width); with --ranks p each stage holds
// blocks / p of them (interleaved: v = 2 stages of blocks / 2p).
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>
#include <sstream>

#include "cohort/cohort.h"

namespace {

namespace pp = cohort::parallel::pipeline;
using Clock = std::chrono::steady_clock;

std::vector<int> parse_list(const std::string& text) {
  std::vector<int> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) out.push_back(std::stoi(item));
  return out;
}

torch::nn::Sequential make_model(int blocks, int width) {
  torch::manual_seed(0);
  torch::nn::Sequential model;
  for (int b = 0; b < blocks; ++b) {
    model->push_back(torch::nn::Linear(width, 2 * width));
    model->push_back(torch::nn::GELU());
    model->push_back(torch::nn::Linear(2 * width, width));
  }
  return model;
}

at::Tensor mse(const at::Tensor& output, const at::Tensor& target) {
  return torch::mse_loss(output, target);
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

// Every rank's timeline of the last step, on every rank.
std::vector<std::vector<pp::TimedAction>> gather_timelines(cohort::comm::ProcessGroup& group,
                                                           const pp::Pipeline& pipe) {
  size_t longest = 0;
  for (const auto& r : pipe.program().ranks) longest = std::max(longest, r.size());
  at::Tensor mine = torch::full({static_cast<int64_t>(longest), 5}, -1.0, torch::kDouble);
  const auto& timeline = pipe.timeline();
  for (size_t i = 0; i < timeline.size(); ++i) {
    const auto& t = timeline[i];
    mine[i] = torch::tensor({static_cast<double>(t.action.type), double(t.action.stage),
                             double(t.action.micro_batch), t.start, t.end},
                            torch::kDouble);
  }
  std::vector<std::vector<pp::TimedAction>> out;
  for (const at::Tensor& rank : group.allgather(mine)) {
    auto& list = out.emplace_back();
    for (int64_t i = 0; i < rank.size(0); ++i) {
      const auto row = rank[i];
      if (row[0].item<double>() < 0) break;
      list.push_back({{static_cast<pp::ActionType>(row[0].item<int>()), row[1].item<int>(),
                       row[2].item<int>()},
                      row[3].item<double>(),
                      row[4].item<double>()});
    }
  }
  return out;
}

// Median duration of each kind of computation on every rank.
pp::SimulationCosts measured_costs(const std::vector<std::vector<pp::TimedAction>>& timelines) {
  std::vector<double> f, whole, input, weight;
  for (const auto& rank : timelines) {
    for (const auto& t : rank) {
      const double d = t.end - t.start;
      switch (t.action.type) {
        case pp::ActionType::kForward:
          f.push_back(d);
          break;
        case pp::ActionType::kBackward:
          whole.push_back(d);
          break;
        case pp::ActionType::kBackwardInput:
          input.push_back(d);
          break;
        case pp::ActionType::kBackwardWeight:
          weight.push_back(d);
          break;
        default:
          break;
      }
    }
  }
  pp::SimulationCosts costs{.forward = median(f)};
  if (!whole.empty()) {
    costs.backward_input = costs.backward_weight = median(whole) / 2;
  } else {
    costs.backward_input = median(input);
    costs.backward_weight = median(weight);
  }
  return costs;
}

void bench_loop(const cohort::Json& c) {
  torch::set_num_threads(1);
  auto& ctx = cohort::train::get_context();
  auto& world = ctx.get_process_group();
  const int p = ctx.get_world_size(), rank = ctx.get_world_rank();
  const int blocks = c["blocks"], width = c["width"], rows = c["rows"], steps = c["steps"];
  const auto ms = c["micro_batches"].get<std::vector<int>>();
  auto make_batch = [&](int m) {
    torch::manual_seed(1);
    return std::pair{torch::randn({int64_t(m) * rows, width}),
                     torch::randn({int64_t(m) * rows, width})};
  };
  // The whole model in one process, for each m.
  std::map<int, double> single;
  if (rank == 0) {
    auto model = make_model(blocks, width);
    for (int m : ms) {
      auto [x, y] = make_batch(m);
      std::vector<double> times;
      for (int s = 0; s <= steps; ++s) {
        const auto start = Clock::now();
        model->zero_grad();
        mse(model->forward(x), y).backward();
        if (s > 0) times.push_back(std::chrono::duration<double>(Clock::now() - start).count());
      }
      single[m] = median(times);
    }
  }
  world.barrier();
  if (rank == 0) {
    std::printf("%-12s %4s %9s %9s %9s %10s %10s %8s  %-16s %s\n", "schedule", "m", "formula",
                "simulated", "measured", "step ms", "1-proc ms", "speedup", "peak live/rank",
                "peak heap MB/rank");
  }
  for (const std::string& name : c["schedules"].get<std::vector<std::string>>()) {
    const pp::ScheduleKind kind = pp::schedule_from_string(name);
    const int v = kind == pp::ScheduleKind::kInterleaved ? 2 : 1;
    for (int m : ms) {
      if (kind == pp::ScheduleKind::kInterleaved && m % p != 0) continue;
      auto all = pp::split_sequential(make_model(blocks, width),
                                      std::vector<int>(p * v, 3 * blocks / (p * v)));
      std::vector<pp::Stage> mine;
      for (int s : pp::PipelineLayout{p, v}.stages_of(rank)) mine.emplace_back(all[s]);
      pp::Pipeline pipe(
          std::move(mine), world, mse,
          {.schedule = kind, .micro_batches = m, .virtual_stages = v, .record_timeline = true});
      auto [x, y] = make_batch(m);
      std::vector<double> bubbles, times;
      pp::SimulationCosts costs;
      // The most this rank's heap grew during a step over its size before: the activations it
      // holds at once, plus the gradients (the same for every schedule).
      int64_t peak_heap = 0;
      for (int s = 0; s <= steps; ++s) {
        for (auto& param : pipe.parameters()) param.mutable_grad() = at::Tensor();
        world.barrier();
        const int64_t heap_before = pp::heap_bytes_in_use();
        pipe.step(x, y);
        for (const auto& t : pipe.timeline())
          peak_heap = std::max(peak_heap, t.heap_bytes - heap_before);
        const auto timelines = gather_timelines(world, pipe);
        if (s == 0) continue;  // warm-up
        double first = 1e300, last = 0;
        for (const auto& r : timelines) {
          for (const auto& t : r) first = std::min(first, t.start), last = std::max(last, t.end);
        }
        times.push_back(last - first);
        bubbles.push_back(pp::measured_bubble(timelines));
        costs = measured_costs(timelines);
      }
      const auto heaps = world.allgather(torch::tensor({peak_heap}, torch::kInt64));
      if (rank != 0) continue;
      std::string heap_mb;
      for (const auto& h : heaps) {
        char mb[32];
        std::snprintf(mb, sizeof mb, "%.1f ", h.item<int64_t>() / 1e6);
        heap_mb += mb;
      }
      const pp::ScheduleOptions options{.kind = kind, .layout = {p, v}, .micro_batches = m};
      const pp::SimulationResult sim = pp::simulate(pp::compile_schedule(options), costs);
      std::string peaks;
      for (int live : sim.peak_live_activations) peaks += std::to_string(live) + " ";
      const double step = median(times);
      std::printf("%-12s %4d %9.3f %9.3f %9.3f %10.1f %10.1f %8.2f  %-16s %s\n", name.c_str(), m,
                  pp::expected_bubble(options, costs), sim.bubble_fraction, median(bubbles),
                  step * 1e3, single[m] * 1e3, single[m] / step, peaks.c_str(), heap_mb.c_str());
      std::fflush(stdout);
    }
  }
  cohort::train::report({{"done", 1}});
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Pipeline schedules: bubble (formula, simulator, measured), step time, memory"};
  int ranks = 4, blocks = 8, width = 256, rows = 16, steps = 6;
  std::string micro_batches = "4,8,16", schedules = "gpipe,1f1b,interleaved,zero-bubble";
  app.add_option("--ranks", ranks, "pipeline stages, one worker process each");
  app.add_option("--micro-batches", micro_batches);
  app.add_option("--schedules", schedules);
  app.add_option("--blocks", blocks, "MLP blocks; a multiple of 2 x ranks");
  app.add_option("--width", width);
  app.add_option("--rows", rows, "rows per micro-batch");
  app.add_option("--steps", steps, "timed steps per case, after one warm-up step");
  CLI11_PARSE(app, argc, argv);
  if (blocks % (2 * ranks) != 0) {
    std::fprintf(stderr, "error: --blocks %d must be a multiple of 2 x --ranks = %d\n", blocks,
                 2 * ranks);
    return 2;
  }
  std::vector<std::string> names;
  std::stringstream in(schedules);
  for (std::string item; std::getline(in, item, ',');) names.push_back(item);
  const std::string storage = "/tmp/cohort_bench_pipeline";
  cohort::Trainer trainer(bench_loop, {.num_workers = ranks},
                          {.name = "pipeline", .storage_path = storage, .resume = false},
                          {{"blocks", blocks},
                           {"width", width},
                           {"rows", rows},
                           {"steps", steps},
                           {"micro_batches", parse_list(micro_batches)},
                           {"schedules", names}});
  const cohort::Result result = trainer.fit();
  std::filesystem::remove_all(storage);
  if (!result.ok()) {
    std::fprintf(stderr, "error: %s\n", result.error->c_str());
    return 1;
  }
  return 0;
}

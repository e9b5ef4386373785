// Trains the zoo's MLP for a few steps on 2 workers through an installed cohort.
#include <cohort/cohort.h>
#include <cohort/models/zoo.h>
#include <cohort/version.h>
#include <torch/torch.h>

#include <iostream>

int main(int argc, char** argv) {
  cohort::Trainer trainer(
      [](const cohort::Json&) {
        auto model = cohort::train::prepare_model(cohort::models::create_model("mlp"));
        torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
        for (int step = 0; step < 3; ++step) {
          optimizer.zero_grad();
          model->forward(torch::randn({4, 1, 28, 28})).pow(2).mean().backward();
          optimizer.step();
        }
        cohort::train::report({{"world_size", cohort::train::get_context().get_world_size()}});
      },
      {.num_workers = 2},
      {.name = "consumer", .storage_path = argc > 1 ? argv[1] : "./cohort_results", .verbose = 0});
  auto result = trainer.fit();
  std::cout << "consumer of cohort " << COHORT_VERSION << " (git " << cohort::build::kGitRevision
            << ")" << std::endl;
  std::cout << "consumer world_size " << result.metrics.value("world_size", 0) << std::endl;
  return result.ok() ? 0 : 1;
}

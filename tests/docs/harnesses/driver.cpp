// A guide's fragment of a program's main(): a train loop and its base config are at hand.
#include <torch/torch.h>

#include <cohort/cohort.h>

[[maybe_unused]] static void train_loop(const cohort::Json&) {}

[[maybe_unused]] void fragment() {
  const cohort::Json base_config{{"epochs", 2}};
  {
    // SNIPPET
  }
}

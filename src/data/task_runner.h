// Runs an epoch's tasks and hands their results back in task order: in this process, or in a
// pool of preprocessing worker processes.
#pragma once
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "data/plan.h"

namespace cohort::data {

class TaskRunner {
 public:
  virtual ~TaskRunner() = default;
  // Ends any earlier epoch: results of its tasks still in flight are dropped.
  virtual void start_epoch(int64_t epoch, std::vector<std::vector<int64_t>> tasks) = 0;
  // The next task's result, in order; nullopt after the last. Throws RuntimeError when a task
  // failed or the workers are gone.
  virtual std::optional<TaskResult> next() = 0;
  // Wakes a next() blocked in another thread: it throws Cancelled.
  virtual void cancel() = 0;
  virtual int64_t tasks_redone() const { return 0; }
  virtual std::string listen_address() const { return ""; }
};

struct Cancelled {};

std::unique_ptr<TaskRunner> make_inline_runner(const Dataset::Plan& plan);
// Starts `local_workers` processes of this program in the data role for `fingerprint` (with
// `env` added), and accepts remote ones per the plan's ExecutionOptions.
std::unique_ptr<TaskRunner> make_worker_pool(const Dataset::Plan& plan,
                                             const std::string& fingerprint, int local_workers,
                                             std::map<std::string, std::string> env);

}  // namespace cohort::data

#include "train/checkpoint_manager.h"

#include <algorithm>

#include "cohort/error.h"
#include "train/run_files.h"

namespace cohort::train {

CheckpointManager::CheckpointManager(std::filesystem::path run_dir, CheckpointConfig config)
    : run_dir_(std::move(run_dir)), config_(std::move(config)) {
  if (config_.num_to_keep < 0) {
    throw UsageError("CheckpointConfig.num_to_keep=" + std::to_string(config_.num_to_keep) +
                     " must be >= 0 (0 keeps all)");
  }
  if (config_.checkpoint_score_order != "max" && config_.checkpoint_score_order != "min") {
    throw UsageError("CheckpointConfig.checkpoint_score_order '" + config_.checkpoint_score_order +
                     "' must be \"max\" or \"min\"");
  }
}

CheckpointManager CheckpointManager::from_snapshot(const std::filesystem::path& run_dir) {
  const auto file = run_dir / kCheckpointManagerFile;
  if (!std::filesystem::exists(file)) return CheckpointManager(run_dir, {});
  const Json snapshot = read_json(file);
  CheckpointManager manager(
      run_dir,
      {.num_to_keep = snapshot.value("num_to_keep", 0),
       .checkpoint_score_attribute = snapshot.value("checkpoint_score_attribute", std::string{}),
       .checkpoint_score_order = snapshot.value("checkpoint_score_order", std::string{"max"})});
  for (const auto& entry : snapshot.at("checkpoints")) {
    const std::filesystem::path path = entry.at("path").get<std::string>();
    if (std::filesystem::is_directory(path)) {
      manager.entries_.push_back({path, entry.at("index").get<int64_t>(), entry.at("metrics")});
    }
  }
  return manager;
}

std::vector<std::string> CheckpointManager::adopt_existing() {
  std::vector<std::string> warnings;
  entries_.clear();
  if (!std::filesystem::is_directory(run_dir_)) return warnings;
  for (const auto& entry : std::filesystem::directory_iterator(run_dir_)) {
    const int64_t index = checkpoint_index(entry.path());
    if (index < 0 || !entry.is_directory()) continue;
    try {
      verify_manifest(entry.path());
      entries_.push_back({entry.path(), index, Checkpoint::from_directory(entry.path()).metrics()});
    } catch (const std::exception& e) {
      warnings.push_back(std::string("skipping an invalid checkpoint: ") + e.what());
    }
  }
  std::sort(entries_.begin(), entries_.end(),
            [](const Entry& a, const Entry& b) { return a.index < b.index; });
  snapshot();
  return warnings;
}

int64_t CheckpointManager::next_index() const {
  int64_t next = 0;
  if (std::filesystem::is_directory(run_dir_)) {
    for (const auto& entry : std::filesystem::directory_iterator(run_dir_)) {
      next = std::max(next, checkpoint_index(entry.path()) + 1);
    }
  }
  for (const auto& e : entries_) next = std::max(next, e.index + 1);
  return next;
}

void CheckpointManager::check_score_attribute(const Json& metrics) const {
  const auto& attribute = config_.checkpoint_score_attribute;
  if (attribute.empty() || metrics.contains(attribute)) return;
  std::string names;
  for (const auto& [key, value] : metrics.items()) names += (names.empty() ? "" : ", ") + key;
  throw UsageError("CheckpointConfig.checkpoint_score_attribute '" + attribute +
                   "' is not among the reported metrics [" + names +
                   "]: report it, or name one of these");
}

bool CheckpointManager::better(const Entry& a, const Entry& b) const {
  const auto& attribute = config_.checkpoint_score_attribute;
  // One without the score (a checkpoint inside an epoch, before its evaluation) ranks below every
  // one with it; among themselves, newer first.
  if (!attribute.empty() && a.metrics.contains(attribute) != b.metrics.contains(attribute))
    return a.metrics.contains(attribute);
  if (attribute.empty() || !a.metrics.contains(attribute)) return a.index > b.index;
  const double sa = a.metrics[attribute].get<double>();
  const double sb = b.metrics[attribute].get<double>();
  if (sa == sb) return a.index > b.index;
  return config_.checkpoint_score_order == "max" ? sa > sb : sa < sb;
}

void CheckpointManager::add(const std::filesystem::path& dir, const Json& metrics) {
  entries_.push_back({dir, checkpoint_index(dir), metrics});
  std::sort(entries_.begin(), entries_.end(),
            [](const Entry& a, const Entry& b) { return a.index < b.index; });
  prune();
  snapshot();
}

void CheckpointManager::prune() {
  if (config_.num_to_keep == 0 || static_cast<int>(entries_.size()) <= config_.num_to_keep) return;
  std::vector<Entry> ranked = entries_;
  std::stable_sort(ranked.begin(), ranked.end(),
                   [&](const Entry& a, const Entry& b) { return better(a, b); });
  std::vector<int64_t> keep;
  for (int i = 0; i < config_.num_to_keep; ++i)
    keep.push_back(ranked[static_cast<size_t>(i)].index);
  keep.push_back(entries_.back().index);  // the latest, for resuming
  std::vector<Entry> kept;
  for (auto& e : entries_) {
    if (std::find(keep.begin(), keep.end(), e.index) != keep.end()) {
      kept.push_back(e);
    } else {
      remove_tree(e.path);
    }
  }
  entries_ = std::move(kept);
}

void CheckpointManager::snapshot() const {
  Json list = Json::array();
  for (const auto& e : entries_) {
    list.push_back({{"path", e.path.string()}, {"index", e.index}, {"metrics", e.metrics}});
  }
  write_atomically(run_dir_ / kCheckpointManagerFile,
                   Json{{"checkpoint_score_attribute", config_.checkpoint_score_attribute},
                        {"checkpoint_score_order", config_.checkpoint_score_order},
                        {"num_to_keep", config_.num_to_keep},
                        {"checkpoints", list}}
                           .dump(2) +
                       "\n");
}

std::optional<Checkpoint> CheckpointManager::latest() const {
  if (entries_.empty()) return std::nullopt;
  return Checkpoint::from_directory(entries_.back().path);
}

std::vector<std::pair<Checkpoint, Json>> CheckpointManager::best() const {
  std::vector<Entry> ranked = entries_;
  std::stable_sort(ranked.begin(), ranked.end(),
                   [&](const Entry& a, const Entry& b) { return better(a, b); });
  std::vector<std::pair<Checkpoint, Json>> out;
  for (const auto& e : ranked) out.emplace_back(Checkpoint::from_directory(e.path), e.metrics);
  return out;
}

}  // namespace cohort::train

#include "train/live_regroups.h"

#include <algorithm>
#include <numeric>

namespace cohort::train {

LiveRegroups::LiveRegroups(LiveRegroupsOptions options)
    : options_(std::move(options)),
      rank_of_(static_cast<size_t>(options_.world_size)),
      lost_(static_cast<size_t>(options_.world_size), false),
      exited_(static_cast<size_t>(options_.world_size), false) {
  std::iota(rank_of_.begin(), rank_of_.end(), 0);
}

std::vector<int> LiveRegroups::survivors() const {
  std::vector<int> alive;
  for (int i = 0; i < options_.world_size; ++i) {
    const auto at = static_cast<size_t>(i);
    if (rank_of_[at] >= 0 && !lost_[at] && !exited_[at]) alive.push_back(i);
  }
  return alive;
}

bool LiveRegroups::any_exited() const {
  return std::find(exited_.begin(), exited_.end(), true) != exited_.end();
}

void LiveRegroups::on_training(int index) { training_.insert(index); }

void LiveRegroups::on_ready(int index, int64_t steps, int64_t syncs) {
  ready_[index] = {steps, syncs};
  training_.erase(index);  // its loop unwinds; it says so again in the new group
}

void LiveRegroups::on_exited(int index) { exited_.at(static_cast<size_t>(index)) = true; }

LiveRegroups::Loss LiveRegroups::lose(int index, const std::string& cause) {
  Loss loss;
  for (int i : survivors()) {
    // Not training yet (or any more), nor regrouping already.
    if (i != index && !training_.count(i) && !ready_.count(i)) return loss;
  }
  for (int i = 0; i < options_.world_size; ++i) {
    // A worker that finished: the loop is over, nothing to go on with.
    const auto at = static_cast<size_t>(i);
    if (exited_[at] && i != index && !lost_[at] && rank_of_[at] >= 0) return loss;
  }
  training_.erase(index);
  ready_.erase(index);
  for (int i : survivors()) loss.left += i != index;
  if (loss.left == 0 || (!replaceable(index) && loss.left < options_.min_workers)) {
    loss.refusal = "rank " + std::to_string(rank_of(index)) + " lost; " +
                   std::to_string(loss.left) + " survivor(s) are fewer than the " +
                   std::to_string(options_.min_workers) +
                   " the group needs (ScalingConfig.min_workers) and its slot takes no "
                   "replacement: restarting instead";
    return loss;
  }
  lost_[static_cast<size_t>(index)] = true;
  cause_ += (cause_.empty() ? "" : "; ") + cause;
  if (!deadline_) deadline_ = now() + options_.deadline;
  loss.goes_on = true;
  return loss;
}

LiveRegroups::Poll LiveRegroups::poll(const std::function<bool(int index)>& place_free) {
  if (!deadline_) return {};
  std::string missing;
  for (int i : survivors()) {
    if (!ready_.count(i)) missing += (missing.empty() ? "" : ", ") + std::to_string(rank_of(i));
  }
  if (!missing.empty()) {
    if (now() <= *deadline_) return {};
    return {.stop = "live recovery: ranks [" + missing + "] did not reach the regroup within " +
                    std::to_string(options_.deadline.count() / 1000) +
                    " s (a failure outside a step's collectives): restarting the group"};
  }
  std::vector<int> in_group;
  for (int i = 0; i < options_.world_size; ++i)
    if (rank_of(i) >= 0) in_group.push_back(i);
  std::sort(in_group.begin(), in_group.end(),
            [&](int a, int b) { return rank_of(a) < rank_of(b); });
  Decision d;
  Json members = Json::array();
  Json progress = Json::array();
  int source = -1;
  for (int i : in_group) {
    const auto at = static_cast<size_t>(i);
    if (lost_[at]) {
      if (!replaceable(i)) continue;
      // Its place is free once nothing of it is left (a process stuck in the kernel may stay:
      // then the group goes on without a replacement).
      if (!place_free(i)) {
        if (now() < *deadline_) return {};
        continue;
      }
      d.replacements.push_back(i);
      members.push_back(-1);
      progress.push_back(nullptr);
    } else {
      if (source < 0 || ready_.at(i) > ready_.at(d.group[static_cast<size_t>(source)]))
        source = static_cast<int>(d.group.size());
      members.push_back(rank_of(i));
      progress.push_back(Json::array({ready_.at(i).first, ready_.at(i).second}));
    }
    d.group.push_back(i);
  }
  if (static_cast<int>(d.group.size()) < options_.min_workers) {
    return {.stop = "live recovery: " + std::to_string(d.group.size()) +
                    " workers left, fewer than the " + std::to_string(options_.min_workers) +
                    " the group needs: restarting the group"};
  }
  d.round = ++rounds_;
  d.steps = ready_.at(d.group[static_cast<size_t>(source)]).first;
  d.cause = cause_;
  d.record =
      Json{{"members", members}, {"source", source}, {"progress", progress}, {"cause", cause_}};
  std::fill(rank_of_.begin(), rank_of_.end(), -1);
  for (size_t k = 0; k < d.group.size(); ++k) rank_of_[static_cast<size_t>(d.group[k])] = int(k);
  for (int i : d.replacements) exited_[static_cast<size_t>(i)] = false;
  std::fill(lost_.begin(), lost_.end(), false);
  ready_.clear();
  deadline_.reset();
  cause_.clear();
  return {.decision = std::move(d)};
}

std::string LiveRegroups::describe(const Decision& d, const std::string& replaced_by) const {
  std::string replaced;
  for (int i : d.replacements)
    replaced += (replaced.empty() ? "" : ", ") + std::to_string(rank_of(i));
  return "live recovery: " + std::to_string(d.group.size()) + " workers go on after step " +
         std::to_string(d.steps) +
         (replaced.empty() ? std::string(" without restarting")
                           : " (rank(s) " + replaced + " replaced" + replaced_by +
                                 ", the others in the same processes)");
}

}  // namespace cohort::train

// The decisions of live recovery, without processes: who goes on, when the new group is formed,
// who is its source, and when the group restarts instead.
#include "train/live_regroups.h"

#include <gtest/gtest.h>

#include <set>

namespace cohort::train {
namespace {

using std::chrono::milliseconds;

struct FakeClock {
  runtime::SteadyTime now{};
  runtime::ClockSource source() {
    return [this] { return now; };
  }
};

LiveRegroupsOptions options_of(FakeClock& clock, int world, int min_workers,
                               std::set<int> unreplaceable = {}) {
  return {.world_size = world,
          .min_workers = min_workers,
          .deadline = milliseconds(1000),
          .replaceable = [unreplaceable](int index) { return !unreplaceable.count(index); },
          .clock = clock.source()};
}

auto always_free = [](int) { return true; };

TEST(LiveRegroups, ALostWorkersPlaceGoesToAReplacementOnceEverySurvivorIsReady) {
  FakeClock clock;
  LiveRegroups regroups(options_of(clock, 4, 4));
  for (int i = 0; i < 4; ++i) regroups.on_training(i);
  regroups.on_exited(2);
  const auto loss = regroups.lose(2, "rank 2 was killed by signal 9");
  ASSERT_TRUE(loss.goes_on);
  EXPECT_EQ(loss.left, 3);
  EXPECT_EQ(regroups.survivors(), (std::vector<int>{0, 1, 3}));
  // Not before every survivor is ready.
  regroups.on_ready(0, 10, 0);
  regroups.on_ready(3, 11, 0);
  EXPECT_FALSE(regroups.poll(always_free).decision);
  EXPECT_TRUE(regroups.training(1));
  EXPECT_FALSE(regroups.training(0));  // its loop unwinds
  regroups.on_ready(1, 10, 0);
  const auto poll = regroups.poll(always_free);
  ASSERT_TRUE(poll.decision) << poll.stop;
  const auto& d = *poll.decision;
  EXPECT_EQ(d.round, 1);
  EXPECT_EQ(d.group, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(d.replacements, (std::vector<int>{2}));
  // The survivor that got furthest is the source; the replacement knows nothing.
  EXPECT_EQ(d.record["source"], 3);
  EXPECT_EQ(d.steps, 11);
  EXPECT_EQ(d.record["members"], Json::parse("[0, 1, -1, 3]"));
  EXPECT_EQ(d.record["progress"], Json::parse("[[10, 0], [10, 0], null, [11, 0]]"));
  EXPECT_EQ(d.cause, "rank 2 was killed by signal 9");
  EXPECT_EQ(regroups.describe(d, " by their launchers"),
            "live recovery: 4 workers go on after step 11 (rank(s) 2 replaced by their launchers, "
            "the others in the same processes)");
  EXPECT_EQ(regroups.rank_of(2), 2);
  EXPECT_EQ(regroups.survivors().size(), 4u);
  // Decided once: the next poll has nothing to do.
  EXPECT_FALSE(regroups.poll(always_free).decision);
  EXPECT_TRUE(regroups.poll(always_free).stop.empty());
}

TEST(LiveRegroups, WithoutAReplacementTheSurvivorsAreRenumberedInTheirOrder) {
  FakeClock clock;
  LiveRegroups regroups(options_of(clock, 4, 2, {1, 3}));
  for (int i = 0; i < 4; ++i) regroups.on_training(i);
  regroups.on_exited(1);
  ASSERT_TRUE(regroups.lose(1, "rank 1 was killed").goes_on);
  for (int i : {0, 2, 3}) regroups.on_ready(i, 5, i == 2 ? 3 : 2);  // syncs break the tie
  const auto poll = regroups.poll(always_free);
  ASSERT_TRUE(poll.decision);
  EXPECT_EQ(poll.decision->group, (std::vector<int>{0, 2, 3}));
  EXPECT_TRUE(poll.decision->replacements.empty());
  EXPECT_EQ(poll.decision->record["source"], 1);  // new rank 1: worker 2
  EXPECT_EQ(regroups.describe(*poll.decision),
            "live recovery: 3 workers go on after step 5 without restarting");
  EXPECT_EQ(regroups.rank_of(1), -1);
  EXPECT_EQ(regroups.rank_of(2), 1);
  EXPECT_EQ(regroups.rank_of(3), 2);
  // A second loss in the new group is named by its new rank.
  for (int i : {0, 2, 3}) regroups.on_training(i);
  regroups.on_exited(3);
  ASSERT_TRUE(regroups.lose(3, "rank 2 was killed").goes_on);
  regroups.on_ready(0, 7, 0);
  regroups.on_ready(2, 7, 0);
  const auto second = regroups.poll(always_free);
  ASSERT_TRUE(second.decision);
  EXPECT_EQ(second.decision->round, 2);
  EXPECT_EQ(second.decision->group, (std::vector<int>{0, 2}));
}

TEST(LiveRegroups, TheGroupRestartsWhenItCannotGoOn) {
  FakeClock clock;
  {
    // A worker that is still starting up: nothing to regroup with.
    LiveRegroups regroups(options_of(clock, 3, 3));
    regroups.on_training(0);
    regroups.on_exited(2);
    EXPECT_FALSE(regroups.lose(2, "killed").goes_on);
  }
  {
    // A worker that finished: the loop is over.
    LiveRegroups regroups(options_of(clock, 3, 3));
    regroups.on_training(0);
    regroups.on_exited(1);
    regroups.on_exited(2);
    EXPECT_FALSE(regroups.lose(2, "killed").goes_on);
  }
  {
    // No replacement and too few survivors: said in a line naming the minimum.
    LiveRegroups regroups(options_of(clock, 2, 2, {1}));
    regroups.on_training(0);
    regroups.on_training(1);
    regroups.on_exited(1);
    const auto loss = regroups.lose(1, "killed");
    EXPECT_FALSE(loss.goes_on);
    EXPECT_NE(loss.refusal.find("rank 1 lost; 1 survivor(s) are fewer than the 2"),
              std::string::npos)
        << loss.refusal;
  }
  {
    // A survivor that never says it is ready: named when the deadline passes.
    LiveRegroups regroups(options_of(clock, 3, 3));
    for (int i = 0; i < 3; ++i) regroups.on_training(i);
    regroups.on_exited(0);
    ASSERT_TRUE(regroups.lose(0, "killed").goes_on);
    regroups.on_ready(1, 4, 0);
    EXPECT_TRUE(regroups.poll(always_free).stop.empty());
    clock.now += milliseconds(1001);
    const auto poll = regroups.poll(always_free);
    EXPECT_FALSE(poll.decision);
    EXPECT_NE(poll.stop.find("ranks [2] did not reach the regroup within 1 s"), std::string::npos)
        << poll.stop;
  }
}

TEST(LiveRegroups, AReplacementWaitsForItsPlaceUntilTheDeadlineThenTheGroupShrinks) {
  FakeClock clock;
  LiveRegroups regroups(options_of(clock, 3, 2));
  for (int i = 0; i < 3; ++i) regroups.on_training(i);
  regroups.on_exited(1);
  ASSERT_TRUE(regroups.lose(1, "killed").goes_on);
  regroups.on_ready(0, 3, 0);
  regroups.on_ready(2, 3, 0);
  const auto busy = [](int) { return false; };
  EXPECT_FALSE(regroups.poll(busy).decision);
  clock.now += milliseconds(1000);
  const auto poll = regroups.poll(busy);
  ASSERT_TRUE(poll.decision) << poll.stop;
  EXPECT_EQ(poll.decision->group, (std::vector<int>{0, 2}));
  EXPECT_TRUE(poll.decision->replacements.empty());
  // Below min_workers once the place stays busy: a restart.
  FakeClock other;
  LiveRegroups tight(options_of(other, 2, 2));
  tight.on_training(0);
  tight.on_training(1);
  tight.on_exited(1);
  ASSERT_TRUE(tight.lose(1, "killed").goes_on);
  tight.on_ready(0, 1, 0);
  other.now += milliseconds(1000);
  const auto stop = tight.poll(busy);
  EXPECT_FALSE(stop.decision);
  EXPECT_NE(stop.stop.find("1 workers left, fewer than the 2"), std::string::npos) << stop.stop;
}

}  // namespace
}  // namespace cohort::train

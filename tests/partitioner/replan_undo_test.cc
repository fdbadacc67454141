// A switch the next window measures slower than the plan before it is undone; what that asks
// of later switches (twice the gain while the devices are as they were), and of a return to a
// shape left (twice the gain, unless a straggler came or went since).
#include <gtest/gtest.h>

#include <random>
#include <tuple>

#include "partitioner/replan.h"
#include "random_graphs.h"
#include "replan_scenarios.h"

namespace conveyor::partitioner {
namespace {

using testing::devices;
using testing::options;
using testing::run;

// A straggler changes the layout's shape: two equal devices run one stage replicated (a
// replica each, even shares), and with one of them at half speed two pipelined stages cut
// unevenly run faster. Once it goes, returning to the replicated stage asks the usual gain:
// the devices' speeds moved since that shape was left. A return on devices as fast as when
// the shape was left (the model changing its mind) asks twice that.
TEST(Replan, AShapeLeftForAStragglerIsReturnedToForTheUsualGainOnceItGoes) {
  const CostGraph g = testing::uniform_chain(12, 1e-3, 2e-3, 1e5, 1e6);
  const Cluster cluster = devices(2);
  PlanOptions o = options();
  o.max_replicas = 2;
  const Plan plan = testing::one_stage_on_each_device(g, cluster, o);
  ReplanPolicy policy = testing::moving_no_bytes();
  Replanner r(g, cluster, plan, o, policy);
  std::mt19937 rng(11);
  auto until_switch = [&](Replanner& replanner, const std::vector<double>& truth) {
    ReplanDecision d;
    for (int window = 0; window < 10 && !d.switch_plan; ++window) {
      auto [m, step] = run(g, replanner.running(), truth, 0.02, rng);
      d = *replanner.evaluate(m, step);
    }
    return d;
  };
  const ReplanDecision away = until_switch(r, {1, 0.5});
  ASSERT_TRUE(away.switch_plan) << away.reason;
  ASSERT_NE(Replanner::shape_key(away.candidate), Replanner::shape_key(plan)) << away.candidate.table();
  EXPECT_DOUBLE_EQ(away.gain_asked, policy.min_gain);
  ASSERT_TRUE(r.switched_to(away.candidate).is_ok());
  const ReplanDecision back = until_switch(r, {1, 1});
  ASSERT_TRUE(back.switch_plan) << back.reason;
  EXPECT_EQ(Replanner::shape_key(back.candidate), Replanner::shape_key(plan)) << back.candidate.table();
  EXPECT_DOUBLE_EQ(back.gain_asked, policy.min_gain) << back.arithmetic(r.policy());

  // Forced onto that shape while both devices run at full speed: going back asks twice the gain.
  Replanner same(g, cluster, plan, o, policy);
  auto [m, step] = run(g, plan, {1, 1}, 0, rng);
  ASSERT_TRUE(same.evaluate(m, step).is_ok());
  ASSERT_TRUE(same.switched_to(away.candidate).is_ok());
  std::tie(m, step) = run(g, same.running(), {1, 1}, 0, rng);
  const ReplanDecision flip = *same.evaluate(m, step);
  EXPECT_EQ(Replanner::shape_key(flip.candidate), Replanner::shape_key(plan)) << flip.reason;
  EXPECT_DOUBLE_EQ(flip.gain_asked, 2 * policy.min_gain) << flip.arithmetic(same.policy());
}

// Device 1 of three at half speed until the Replanner decides a switch, which is taken: the
// step measured before it (the running plan's under the straggler).
double switch_for_a_straggler(Replanner& r, const CostGraph& g, std::mt19937& rng) {
  ReplanDecision d;
  for (int window = 0; window < 2; ++window) {
    auto [m, step] = run(g, r.running(), {1, 0.5, 1}, 0, rng);
    d = *r.evaluate(m, step);
  }
  EXPECT_TRUE(d.switch_plan) << d.reason;
  EXPECT_TRUE(r.switched_to(d.candidate).is_ok());
  return d.measured_step_s;
}

TEST(Replan, ASwitchThatMeasuresSlowerIsUndoneAndNotRetriedForTheSameGain) {
  const CostGraph g = testing::uniform_chain(12, 1e-3, 2e-3, 1e6, 1e6);
  const Cluster cluster = devices(3);
  const Plan plan = *make_plan(g, cluster, options());
  Replanner r(g, cluster, plan, options(), ReplanPolicy{});
  std::mt19937 rng(5);
  const double before = switch_for_a_straggler(r, g, rng);
  const std::string old_key = Replanner::layout_key(plan);
  // The new plan runs slower than the old one did (the model was wrong about it): undone,
  // though by less than the tolerance (it was taken for a saving of at least the gain asked).
  auto [m, step] = run(g, r.running(), {1, 0.5, 1}, 0, rng);
  auto undo = r.evaluate(m, before * 1.08);
  ASSERT_TRUE(undo.is_ok());
  EXPECT_TRUE(undo->switch_plan && undo->undo) << undo->reason;
  EXPECT_EQ(Replanner::layout_key(undo->candidate), old_key);
  EXPECT_NE(undo->reason.find("measured slower"), std::string::npos);
  ASSERT_TRUE(r.switched_to(undo->candidate).is_ok());
  // Back on the old plan, an undo is not itself undone.
  std::tie(m, step) = run(g, r.running(), {1, 0.5, 1}, 0, rng);
  auto after = r.evaluate(m, before * 1.5);
  ASSERT_TRUE(after.is_ok());
  EXPECT_FALSE(after->undo);
}

// A switch decided on a straggler that went while it was being confirmed measures slower
// than the plan before it, and is undone; but it measured what the devices do now, not how
// the model prices operators, so it asks no more of later switches (a ResNet-18's, counted,
// left the even shares it then needed 16.9% faster short of the 20% asked).
TEST(Replan, ASwitchUndoneAfterItsStragglerWentAsksNoMoreOfLaterSwitches) {
  const CostGraph g = testing::uniform_chain(12, 1e-3, 2e-3, 1e6, 1e6);
  const Cluster cluster = devices(3);
  const Plan plan = *make_plan(g, cluster, options());
  const double asked = ReplanPolicy{}.min_gain;
  for (const bool went : {false, true}) {
    Replanner r(g, cluster, plan, options(), ReplanPolicy{});
    std::mt19937 rng(5);
    const double before = switch_for_a_straggler(r, g, rng);
    const std::vector<double> now = went ? std::vector<double>{1, 1, 1} : std::vector<double>{1, 0.5, 1};
    auto [m, step] = run(g, r.running(), now, 0, rng);
    const ReplanDecision undo = *r.evaluate(m, before * 1.08);
    ASSERT_TRUE(undo.undo) << undo.reason;
    EXPECT_EQ(undo.reason.find("speeds moved") != std::string::npos, went) << undo.reason;
    ASSERT_TRUE(r.switched_to(undo.candidate).is_ok());
    std::tie(m, step) = run(g, r.running(), now, 0, rng);
    const ReplanDecision after = *r.evaluate(m, step);
    EXPECT_DOUBLE_EQ(after.gain_asked, went ? asked : 2 * asked) << after.arithmetic(r.policy());
  }
}

// A switch is judged against the last window the plan before it ran, as the caller measured
// it (switched_to's step_before_s), and on the caller's step after it: the figures its log
// prints. Judged against the window that decided it (a noisy start read 648 ms there, the
// window before the switch 503 ms), a timm ViT's switch that measured 578 ms was kept.
TEST(Replan, ASwitchIsJudgedAgainstTheLastWindowBeforeItAsTheCallerMeasuredIt) {
  const CostGraph g = testing::uniform_chain(12, 1e-3, 2e-3, 1e6, 1e6);
  const Cluster cluster = devices(3);
  const Plan plan = *make_plan(g, cluster, options());
  for (const bool given : {false, true}) {
    Replanner r(g, cluster, plan, options(), ReplanPolicy{});
    std::mt19937 rng(5);
    ReplanDecision d;
    for (int window = 0; window < 2; ++window) {
      auto [m, step] = run(g, r.running(), {1, 0.5, 1}, 0, rng);
      d = *r.evaluate(m, step);
    }
    ASSERT_TRUE(d.switch_plan) << d.reason;
    const double deciding = d.measured_step_s, last_before = 0.75 * deciding;
    ASSERT_TRUE(r.switched_to(d.candidate, given ? last_before : 0).is_ok());
    // After it, 0.9 of the deciding window's step by the stages, the caller's step 1.16 of the
    // last window before: slower than that by more than half the tolerance.
    auto [m, step] = run(g, r.running(), {1, 0.5, 1}, 0, rng);
    const ReplanDecision judged = *r.evaluate(m, 0.9 * deciding, true, {}, {{}, 0, 1.16 * last_before});
    EXPECT_EQ(judged.undo, given) << judged.reason;
    EXPECT_NE(judged.reason.find(human_seconds(1.16 * last_before)), std::string::npos) << judged.reason;
  }
  Replanner r(g, cluster, plan, options(), ReplanPolicy{});
  EXPECT_FALSE(r.switched_to(plan, -1).is_ok());
  EXPECT_FALSE(r.switched_to(plan, std::nan("")).is_ok());
  std::mt19937 rng(1);
  auto [m, step] = run(g, plan, {1, 1, 1}, 0, rng);
  EXPECT_FALSE(r.evaluate(m, step, true, {}, {{}, 0, -0.5}).is_ok());
}

}  // namespace
}  // namespace conveyor::partitioner

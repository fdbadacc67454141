// Recalibration: a running plan's measured stage times correct the cost graph, and the
// planner, planning again on the corrected costs, moves work off the stage that ran slow.
#include "partitioner/recalibrate.h"

#include <gtest/gtest.h>

#include "random_graphs.h"

namespace conveyor::partitioner {
namespace {

using scheduler::ScheduleKind;

Link fast_link() { return {100e9, 1e-6}; }

PlanOptions two_stage_1f1b() {
  PlanOptions o;
  o.batch = 8;
  o.microbatches = 4;
  o.max_replicas = 1;
  o.schedules = {ScheduleKind::kOneFOneB};
  return o;
}

Plan plan_of(const CostGraph& g) {
  auto plan = make_plan(g, Cluster::uniform(1, 2, 16e9, 1.0, fast_link(), fast_link()), two_stage_1f1b());
  EXPECT_TRUE(plan.is_ok()) << plan.status().to_string();
  return *plan;
}

// What each stage of `plan` measures when the stage runs `slower` times its prediction.
std::vector<StageMeasurement> measured_at(const Plan& plan, const std::vector<double>& slower, bool split) {
  std::vector<StageMeasurement> out;
  for (std::size_t s = 0; s < plan.stages.size(); ++s) {
    const StagePlan& p = plan.stages[s];
    out.push_back(split ? StageMeasurement{p.forward_s * slower[s], (p.backward_s - p.backward_weight_s) * slower[s],
                                           p.backward_weight_s * slower[s]}
                        : StageMeasurement{p.forward_s * slower[s], p.backward_s * slower[s], 0});
  }
  return out;
}

TEST(Recalibrate, AStageThatRanSlowGetsItsOperatorsScaledAndThePlannerMovesWorkOffIt) {
  const CostGraph g = testing::uniform_chain(8, 1e-3, 2e-3, 1e6, 1e6);
  const Plan plan = plan_of(g);
  ASSERT_EQ(plan.stages.size(), 2u);
  ASSERT_EQ(plan.stages[0].ops.size(), 4u);  // equal work: an even cut
  auto corrected = recalibrate(g, plan, measured_at(plan, {3.0, 1.0}, /*split=*/false));
  ASSERT_TRUE(corrected.is_ok()) << corrected.status().to_string();
  for (int id : plan.stages[0].ops) {
    EXPECT_NEAR(corrected->ops[id].forward_s, 3e-3, 1e-12);
    EXPECT_NEAR(corrected->ops[id].backward_s, 6e-3, 1e-12);
    EXPECT_NEAR(corrected->ops[id].backward_weight_s, 3e-3, 1e-12);
  }
  for (int id : plan.stages[1].ops) EXPECT_NEAR(corrected->ops[id].forward_s, 1e-3, 1e-12);
  // Stage 0's four operators now cost 3 units each, stage 1's 1: the best cut gives stage 0
  // three (9 against 7 units), and on the corrected costs it beats the old cut.
  const Plan again = plan_of(*corrected);
  ASSERT_EQ(again.stages.size(), 2u);
  EXPECT_EQ(again.stages[0].ops.size(), 3u);
  const Cluster cluster = Cluster::uniform(1, 2, 16e9, 1.0, fast_link(), fast_link());
  auto cut = [&](const Plan& p) {
    Candidate c{{p.stages[0].ops, p.stages[1].ops}, {1, 1}, 4, ScheduleKind::kOneFOneB};
    return *candidate_objective(*corrected, cluster, two_stage_1f1b(), c);
  };
  EXPECT_LT(cut(again), 0.9 * cut(plan));
}

TEST(Recalibrate, ASplitBackwardCorrectsItsHalvesApart) {
  const CostGraph g = testing::uniform_chain(8, 1e-3, 2e-3, 1e6, 1e6);  // weight half 1e-3
  const Plan plan = plan_of(g);
  std::vector<StageMeasurement> m = measured_at(plan, {1.0, 1.0}, /*split=*/true);
  m[1].backward_weight_s *= 4;  // stage 1's weight gradients ran 4 times slower, the rest as planned
  auto corrected = recalibrate(g, plan, m);
  ASSERT_TRUE(corrected.is_ok()) << corrected.status().to_string();
  for (int id : plan.stages[1].ops) {
    EXPECT_NEAR(corrected->ops[id].backward_weight_s, 4e-3, 1e-12);
    EXPECT_NEAR(corrected->ops[id].backward_s, 1e-3 + 4e-3, 1e-12);  // the input half unchanged
    EXPECT_NEAR(corrected->ops[id].forward_s, 1e-3, 1e-12);
  }
  for (int id : plan.stages[0].ops) EXPECT_NEAR(corrected->ops[id].backward_s, 2e-3, 1e-12);
}

TEST(Recalibrate, MeasurementsThatDoNotFitThePlanAreRefused) {
  const CostGraph g = testing::uniform_chain(8, 1e-3, 2e-3, 1e6, 1e6);
  const Plan plan = plan_of(g);
  EXPECT_NE(recalibrate(g, plan, {StageMeasurement{}}).status().message().find("measurements of 1 stages for a plan of 2"),
            std::string::npos);
  auto negative = measured_at(plan, {1.0, 1.0}, false);
  negative[0].forward_s = -1;
  EXPECT_NE(recalibrate(g, plan, negative).status().message().find("stage 0 measured a time of"), std::string::npos);
  // A stage that measured nothing (0) keeps its costs.
  auto nothing = recalibrate(g, plan, std::vector<StageMeasurement>(2));
  ASSERT_TRUE(nothing.is_ok());
  for (std::size_t i = 0; i < g.ops.size(); ++i) EXPECT_EQ(nothing->ops[i].forward_s, g.ops[i].forward_s);
}

}  // namespace
}  // namespace conveyor::partitioner

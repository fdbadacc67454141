// Recalibration: a running plan's measured stage times correct the planning inputs. What all
// stages share goes to the operators (the profile was off); what one device measures beyond
// that goes to its speed (a straggler); deviations within the tolerance change nothing.
#include "partitioner/recalibrate.h"

#include <gtest/gtest.h>

#include "common/shares.h"
#include "random_graphs.h"

namespace conveyor::partitioner {
namespace {

using scheduler::ScheduleKind;

Link fast_link() { return {100e9, 1e-6}; }

Cluster devices(int n) { return Cluster::uniform(1, n, 16e9, 1.0, fast_link(), fast_link()); }

PlanOptions pipeline_1f1b(int batch = 8) {
  PlanOptions o;
  o.batch = batch;
  o.microbatches = 4;
  o.max_replicas = 1;
  o.schedules = {ScheduleKind::kOneFOneB};
  return o;
}

Plan plan_of(const CostGraph& g, const Cluster& cluster, const PlanOptions& o = pipeline_1f1b()) {
  auto plan = make_plan(g, cluster, o);
  EXPECT_TRUE(plan.is_ok()) << plan.status().to_string();
  return *plan;
}

// What each stage of `plan` measures when it runs `slower` times its prediction.
std::vector<StageMeasurement> measured_at(const Plan& plan, const std::vector<double>& slower, bool split) {
  std::vector<StageMeasurement> out;
  for (std::size_t s = 0; s < plan.stages.size(); ++s) {
    const StagePlan& p = plan.stages[s];
    out.push_back(split ? StageMeasurement{p.forward_s * slower[s], (p.backward_s - p.backward_weight_s) * slower[s],
                                           p.backward_weight_s * slower[s], {}}
                        : StageMeasurement{p.forward_s * slower[s], p.backward_s * slower[s], 0, {}});
  }
  return out;
}

TEST(Recalibrate, WhatEveryStageMeasuresAlikeCorrectsTheOperatorsNotTheDevices) {
  const CostGraph g = testing::uniform_chain(8, 1e-3, 2e-3, 1e6, 1e6);
  const Cluster cluster = devices(2);
  const Plan plan = plan_of(g, cluster);
  auto c = recalibrate(g, cluster, pipeline_1f1b(), plan, measured_at(plan, {1.5, 1.5}, false));
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_NEAR(c->factors.forward, 1.5, 1e-12);
  EXPECT_NEAR(c->factors.backward, 1.5, 1e-12);
  for (const CostOp& op : c->costs.ops) EXPECT_NEAR(op.forward_s, 1.5e-3, 1e-12);
  for (const Device& d : c->cluster.devices) EXPECT_EQ(d.speed, 1.0);
  EXPECT_NEAR(c->running.stages[0].forward_s, 1.5 * plan.stages[0].forward_s, 1e-12);
  EXPECT_GT(c->running.predicted_step_s, 1.4 * plan.predicted_step_s);
}

TEST(Recalibrate, AStragglerGetsItsDeviceSlowedAndThePlannerMovesWorkOffIt) {
  const CostGraph g = testing::uniform_chain(12, 1e-3, 2e-3, 1e6, 1e6);
  const Cluster cluster = devices(3);
  const Plan plan = plan_of(g, cluster);
  ASSERT_EQ(plan.stages.size(), 3u);
  ASSERT_EQ(plan.stages[1].ops.size(), 4u);  // equal work: an even cut
  // Device 1 (stage 1) runs at half speed; the others as planned.
  auto c = recalibrate(g, cluster, pipeline_1f1b(), plan, measured_at(plan, {1.0, 2.0, 1.0}, false));
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_EQ(c->factors.forward, 1.0);  // the median stage ran as planned: the profile was right
  EXPECT_NEAR(c->cluster.devices[1].speed, 0.5, 1e-12);
  EXPECT_EQ(c->cluster.devices[0].speed, 1.0);
  EXPECT_NEAR(c->running.stages[1].forward_s, 2 * plan.stages[1].forward_s, 1e-12);
  for (std::size_t i = 0; i < g.ops.size(); ++i) EXPECT_EQ(c->costs.ops[i].forward_s, g.ops[i].forward_s);
  const Plan again = plan_of(c->costs, c->cluster);
  ASSERT_EQ(again.stages.size(), 3u);
  EXPECT_LT(again.stages[1].ops.size(), 4u);
  EXPECT_LT(again.predicted_step_s, 0.9 * c->running.predicted_step_s);
}

// Two devices, one stage with a replica on each (data parallel: no transfers, no bubble).
PlanOptions data_parallel() {
  PlanOptions o = pipeline_1f1b(16);
  o.max_replicas = 2;
  o.microbatches = 2;
  o.even_shares = true;
  return o;
}

TEST(Recalibrate, AReplicaThatRunsSlowSlowsItsOwnDeviceOnly) {
  const CostGraph g = testing::uniform_chain(8, 1e-3, 2e-3, 1e6, 1e6);
  const Cluster cluster = devices(2);
  const PlanOptions o = data_parallel();
  const Plan plan = plan_of(g, cluster, o);
  ASSERT_EQ(plan.stages.size(), 1u) << plan.table();
  StagePlan p = plan.stages[0];
  const double whole = p.forward_s + p.backward_s;
  std::vector<StageMeasurement> m{{2 * p.forward_s, 2 * p.backward_s, 0, {whole, 2 * whole}}};
  auto c = recalibrate(g, cluster, o, plan, m);
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  // The common factor is read from the stage's fastest replica, which ran as predicted: the
  // stage's time is its slower replica's, and reading the factor from that made the
  // straggler every device's error (devices [2, 1]: a slow process 0 read as no straggler).
  EXPECT_NEAR(c->factors.forward, 1.0, 1e-12);
  EXPECT_EQ(c->cluster.devices[0].speed, 1.0);
  EXPECT_NEAR(c->cluster.devices[1].speed, 0.5, 1e-12);
  // The stage waits for its slower replica: as measured.
  EXPECT_NEAR(c->running.stages[0].forward_s, 2 * p.forward_s, 1e-12);
}

TEST(Recalibrate, EachReplicaIsPredictedFromItsOwnShareOnItsOwnDevice) {
  // Device 1 is known to run at half speed, so it takes fewer samples of each microbatch
  // (6 and 2 of 8: the stage ends with device 0's 6 samples). Measured so, no device is a
  // straggler; with device 1 taking twice its share's time, it alone is slowed.
  const CostGraph g = testing::uniform_chain(8, 1e-3, 2e-3, 1e6, 1e6);
  Cluster cluster = devices(2);
  cluster.devices[1].speed = 0.5;
  PlanOptions o = data_parallel();
  o.even_shares = false;
  o.ranks = 1;
  const Plan plan = plan_of(g, cluster, o);
  ASSERT_EQ(plan.stages.size(), 1u) << plan.table();
  const StagePlan& p = plan.stages[0];
  ASSERT_EQ(p.replicas, 2);
  ASSERT_EQ(share_lengths(8, p.shares, 2), (std::vector<std::int64_t>{6, 2}));
  // Each replica's time: its share over its speed, against the slower one's (the stage's).
  const double whole = p.forward_s + p.backward_s;
  const double r0 = whole, r1 = whole * (2.0 / 8 / 0.5) / (6.0 / 8 / 1.0);
  auto as_planned = recalibrate(g, cluster, o, plan, {{p.forward_s, p.backward_s, 0, {r0, r1}}});
  ASSERT_TRUE(as_planned.is_ok()) << as_planned.status().to_string();
  EXPECT_EQ(as_planned->cluster.devices[0].speed, 1.0);
  EXPECT_EQ(as_planned->cluster.devices[1].speed, 0.5);
  auto straggling = measure_factors(plan, {{p.forward_s, p.backward_s, 0, {r0, 2 * r1}}}, 2);
  ASSERT_TRUE(straggling.is_ok());
  EXPECT_NEAR(straggling->speed[0], 1.0, 1e-12);
  EXPECT_NEAR(straggling->speed[1], 0.5, 1e-12);
}

TEST(Recalibrate, AReplicasFixedPartIsPaidWholeWhateverItsShare) {
  // As above, with half of each operator's time fixed: device 1's 2 samples take
  // (0.5 + 0.5 x 2/8) / 0.5 = 1.25 of the profile's time, device 0's 6 take 0.875, so the
  // stage is device 1's. Measured so, nothing is corrected; device 1 taking twice that, it
  // alone is slowed, by half.
  CostGraph g = testing::uniform_chain(8, 1e-3, 2e-3, 1e6, 1e6);
  g.microbatch = 8;
  g.fixed_fraction = 0.5;
  Cluster cluster = devices(2);
  cluster.devices[1].speed = 0.5;
  PlanOptions o = data_parallel();
  o.even_shares = false;
  o.ranks = 1;
  o.batch = 8;
  o.microbatches = 1;
  o.replicas = {2};
  const Plan plan = plan_of(g, cluster, o);
  const StagePlan& p = plan.stages[0];
  ASSERT_EQ(p.replicas, 2) << plan.table();
  ASSERT_EQ(share_lengths(8, p.shares, 2), (std::vector<std::int64_t>{6, 2}));
  EXPECT_NEAR(p.forward_s, 8 * 1e-3 * 1.25, 1e-12) << plan.table();
  const double whole = p.forward_s + p.backward_s;
  const double r0 = whole * 0.875 / 1.25, r1 = whole;
  auto as_planned = recalibrate(g, cluster, o, plan, {{p.forward_s, p.backward_s, 0, {r0, r1}}});
  ASSERT_TRUE(as_planned.is_ok()) << as_planned.status().to_string();
  EXPECT_EQ(as_planned->cluster.devices[1].speed, 0.5);
  EXPECT_NEAR(as_planned->running.predicted_step_s, plan.predicted_step_s, 1e-12);
  auto straggling = measure_factors(plan, {{2 * p.forward_s, 2 * p.backward_s, 0, {r0, 2 * r1}}}, 2, 0,
                                    share_pricing(g, plan));
  ASSERT_TRUE(straggling.is_ok());
  EXPECT_NEAR(straggling->forward, 1.0, 1e-12);
  EXPECT_NEAR(straggling->speed[0], 1.0, 1e-12);
  EXPECT_NEAR(straggling->speed[1], 0.5, 1e-12);
}

TEST(Recalibrate, DeviationsWithinTheToleranceChangeNothing) {
  const CostGraph g = testing::uniform_chain(12, 1e-3, 2e-3, 1e6, 1e6);
  const Cluster cluster = devices(3);
  const Plan plan = plan_of(g, cluster);
  auto c = recalibrate(g, cluster, pipeline_1f1b(), plan, measured_at(plan, {1.04, 0.97, 1.08}, false), 0.1);
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_EQ(c->factors.forward, 1.0);
  for (const Device& d : c->cluster.devices) EXPECT_EQ(d.speed, 1.0);
  EXPECT_NEAR(c->running.predicted_step_s, plan.predicted_step_s, 1e-12);
}

TEST(Recalibrate, ASplitBackwardCorrectsItsHalvesApart) {
  const CostGraph g = testing::uniform_chain(8, 1e-3, 2e-3, 1e6, 1e6);  // weight half 1e-3
  const Cluster cluster = devices(2);
  const Plan plan = plan_of(g, cluster);
  std::vector<StageMeasurement> m = measured_at(plan, {1.0, 1.0}, /*split=*/true);
  // The weight gradients ran 4 times slower, the rest as planned: the first stage, which
  // reads no other's output, also runs its operators' input halves in that action.
  const std::vector<double> input_share = weight_input_shares(g, plan);
  ASSERT_EQ(input_share.size(), 2u);
  EXPECT_NEAR(input_share[0], 0.5, 1e-12);
  EXPECT_EQ(input_share[1], 0.0);
  for (std::size_t s = 0; s < m.size(); ++s) m[s].backward_weight_s *= input_share[s] + 4 * (1 - input_share[s]);
  auto c = recalibrate(g, cluster, pipeline_1f1b(), plan, m);
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_NEAR(c->factors.weight, 4.0, 1e-12);
  EXPECT_EQ(c->factors.backward, 1.0);
  for (const Device& d : c->cluster.devices) EXPECT_NEAR(d.speed, 1.0, 1e-12);
  for (const CostOp& op : c->costs.ops) {
    EXPECT_NEAR(op.backward_weight_s, 4e-3, 1e-12);
    EXPECT_NEAR(op.backward_s, 1e-3 + 4e-3, 1e-12);  // the input half unchanged
    EXPECT_NEAR(op.forward_s, 1e-3, 1e-12);
  }
}

TEST(Recalibrate, AFirstStagesInputHalfOfNothingLeavesTheBackwardFactorToTheOthers) {
  // A first stage has no input gradient to compute: its split backward is all W, its input
  // half the action's overhead, and what is left of that difference is rounding. Its measured
  // input half (the runtime's bookkeeping) over that rounding must not be taken for a ratio.
  const CostGraph g = testing::uniform_chain(8, 1e-3, 2e-3, 1e6, 1e6);
  const Cluster cluster = devices(2);
  PlanOptions o = pipeline_1f1b();
  o.schedules = {ScheduleKind::kZeroBubbleH1};
  Plan plan = plan_of(g, cluster, o);
  ASSERT_EQ(plan.stages.size(), 2u);
  StagePlan& first = plan.stages[0];
  EXPECT_NEAR(first.backward_s - first.backward_weight_s, o.action_overhead_s, 1e-12);  // all at W
  first.backward_s = first.backward_weight_s + o.action_overhead_s + 1e-15;  // a rounding residue
  std::vector<StageMeasurement> m = measured_at(plan, {1.0, 1.0}, /*split=*/true);
  m[0].backward_s = 2e-5;
  auto c = recalibrate(g, cluster, o, plan, m);
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_EQ(c->factors.backward, 1.0);
  EXPECT_EQ(c->factors.weight, 1.0);
  for (const Device& d : c->cluster.devices) EXPECT_EQ(d.speed, 1.0);
}

TEST(Recalibrate, TransfersSlowerThanTheLinksPredictSlowTheLinks) {
  const CostGraph g = testing::uniform_chain(12, 1e-3, 2e-3, 1e6, 1e6);
  const Cluster cluster = devices(3);
  const Plan plan = plan_of(g, cluster);
  auto m = measured_at(plan, {1.0, 1.0, 1.0}, false);
  // Each transfer took 10 times what the link predicts (its latency and bytes over bandwidth).
  for (int s = 0; s < 2; ++s) {
    m[s].send_s = 10 * (plan.links[s].latency_s + plan.stages[s].send_bytes / plan.links[s].bandwidth_bytes_per_s);
  }
  auto c = recalibrate(g, cluster, pipeline_1f1b(), plan, m);
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_NEAR(c->factors.link, 10.0, 1e-9);
  EXPECT_NEAR(c->cluster.intra_node.latency_s, 10 * fast_link().latency_s, 1e-15);
  EXPECT_NEAR(c->cluster.intra_node.bandwidth_bytes_per_s, fast_link().bandwidth_bytes_per_s / 10, 1e-3);
  EXPECT_NEAR(c->running.links[0].latency_s, 10 * fast_link().latency_s, 1e-15);
  EXPECT_GT(c->running.predicted_step_s, plan.predicted_step_s);
  EXPECT_EQ(c->factors.forward, 1.0);
}

TEST(Recalibrate, GradientSumsSlowerThanPredictedSlowTheLinks) {
  const CostGraph g = testing::uniform_chain(8, 1e-3, 2e-3, 1e6, 1e6);
  const Cluster cluster = devices(2);
  const PlanOptions o = data_parallel();
  const Plan plan = plan_of(g, cluster, o);
  ASSERT_EQ(plan.stages.size(), 1u) << plan.table();
  ASSERT_GT(plan.stages[0].allreduce_s, 0);
  const StagePlan& p = plan.stages[0];
  std::vector<StageMeasurement> m{{p.forward_s, p.backward_s, 0, {}, 0, 3 * p.allreduce_s}};
  auto c = recalibrate(g, cluster, o, plan, m);
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_NEAR(c->factors.link, 3.0, 1e-9);
  EXPECT_NEAR(c->running.stages[0].allreduce_s, 3 * p.allreduce_s, 1e-12);
  EXPECT_EQ(c->factors.forward, 1.0);
}

TEST(Recalibrate, MeasurementsThatDoNotFitThePlanAreRefused) {
  const CostGraph g = testing::uniform_chain(8, 1e-3, 2e-3, 1e6, 1e6);
  const Cluster cluster = devices(2);
  const Plan plan = plan_of(g, cluster);
  EXPECT_NE(recalibrate(g, cluster, pipeline_1f1b(), plan, {StageMeasurement{}}).status().message().find("measurements of 1 stages for a plan of 2"),
            std::string::npos);
  auto negative = measured_at(plan, {1.0, 1.0}, false);
  negative[0].forward_s = -1;
  EXPECT_NE(recalibrate(g, cluster, pipeline_1f1b(), plan, negative).status().message().find("stage 0 measured a time of"),
            std::string::npos);
  EXPECT_NE(recalibrate(g, devices(1), pipeline_1f1b(), plan, measured_at(plan, {1.0, 1.0}, false)).status().message().find(
                "outside the cluster's 1"),
            std::string::npos);
  // A stage that measured nothing (0) keeps its costs.
  auto nothing = recalibrate(g, cluster, pipeline_1f1b(), plan, std::vector<StageMeasurement>(2));
  ASSERT_TRUE(nothing.is_ok());
  for (std::size_t i = 0; i < g.ops.size(); ++i) EXPECT_EQ(nothing->costs.ops[i].forward_s, g.ops[i].forward_s);
}

}  // namespace
}  // namespace conveyor::partitioner

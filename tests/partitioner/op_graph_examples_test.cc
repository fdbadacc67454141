// The planner on public operator and layer graphs of another group's device-placement
// benchmark (examples/op_graphs: BERT and ResNet-50 operator graphs, BERT-24, GNMT,
// Inception-v3 and ResNet-50 layer graphs, converted by tools/fiddle_op_graph.py), where a
// value crossing a cut costs as much as a stage's work or more: the plan returned simulates
// at least as fast (within 1%) as every pipeline a brute force cuts from the graph's
// operator order, each with every replica assignment, scored by the same simulator.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "partitioner/planner.h"
#include "random_graphs.h"

namespace conveyor::partitioner {
namespace {

using scheduler::ScheduleKind;

constexpr double kInf = std::numeric_limits<double>::infinity();
// Their cost model sends 2^31 bytes a second between devices, with no latency.
constexpr double kBandwidth = 2147483648.0;

std::string example(const std::string& name) {
  return std::string(CONVEYOR_SOURCE_ROOT) + "/examples/op_graphs/" + name + ".json";
}

// The best simulated step over every split of the operators' order into `stages` contiguous
// ranges (cut positions among `cuts`), each with every replica assignment that fits the
// cluster's devices.
double best_cut(const CostGraph& g, const Cluster& cluster, const PlanOptions& o, int stages,
                const std::vector<int>& cuts, int* tried) {
  const int n = static_cast<int>(g.ops.size());
  const int devices = static_cast<int>(cluster.devices.size());
  double best = kInf;
  std::vector<int> at;  // chosen cut positions (an op index where a stage begins)
  Candidate c;
  c.microbatches = o.microbatches;
  c.schedule = o.schedules.front();
  std::function<void(std::size_t)> choose = [&](std::size_t from) {
    if (static_cast<int>(at.size()) == stages - 1) {
      c.stages.clear();
      int begin = 0;
      for (int k = 0; k < stages; ++k) {
        const int end = k + 1 < stages ? at[k] : n;
        std::vector<int> stage(end - begin);
        for (int x = begin; x < end; ++x) stage[x - begin] = x;
        c.stages.push_back(std::move(stage));
        begin = end;
      }
      c.replicas.assign(stages, 1);
      testing::for_each_replica_assignment(c.replicas, devices, [&] {
        ++*tried;
        auto plan = plan_candidate(g, cluster, o, c);
        if (plan) best = std::min(best, plan->predicted_step_s);
      });
      return;
    }
    for (std::size_t i = from; i < cuts.size(); ++i) {
      at.push_back(cuts[i]);
      choose(i + 1);
      at.pop_back();
    }
  };
  choose(0);
  return best;
}

struct Case {
  const char* graph;
  int devices;
  int microbatches;
  int most_stages;  // the brute force's (every cut position up to this many stages)
};

TEST(OpGraphExamples, NoPipelineCutFromTheOperatorOrderSimulatesFasterThanThePlan) {
  const std::vector<Case> cases = {
      {"layer-bert24", 4, 8, 4},     {"layer-gnmt", 4, 8, 3},          {"layer-resnet50", 3, 8, 3},
      {"layer-inceptionv3", 2, 4, 2}, {"operator-bert_l-3", 3, 8, 3}, {"operator-bert_l-6", 2, 8, 2},
      {"operator-resnet50", 2, 4, 2},
  };
  int compared = 0;
  double worst = 0;
  for (const Case& k : cases) {
    auto g = load_cost_graph(example(k.graph));
    ASSERT_TRUE(g.is_ok()) << g.status().to_string();
    const int n = static_cast<int>(g->ops.size());
    std::vector<int> cuts(n - 1);
    for (int x = 1; x < n; ++x) cuts[x - 1] = x;
    // Free (data parallel often wins where transfers are this heavy), then a pipeline of
    // as many ranks as the brute force cuts.
    for (auto [kind, ranks] : {std::pair{ScheduleKind::kOneFOneB, 0}, std::pair{ScheduleKind::kGPipe, 0},
                               std::pair{ScheduleKind::kOneFOneB, k.most_stages}}) {
      const Cluster cluster = Cluster::uniform(1, k.devices, 1e12, 1.0, {kBandwidth, 0}, {kBandwidth, 0});
      PlanOptions o;
      o.batch = 2 * k.microbatches * k.devices;
      o.microbatches = k.microbatches;
      o.schedules = {kind};
      o.ranks = ranks;
      const auto t0 = std::chrono::steady_clock::now();
      auto plan = make_plan(*g, cluster, o);
      const double planning_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      ASSERT_TRUE(plan.is_ok()) << k.graph << ": " << plan.status().to_string();
      double best = kInf;
      int tried = 0;
      for (int stages = ranks > 0 ? ranks : 1; stages <= k.most_stages; ++stages) {
        best = std::min(best, best_cut(*g, cluster, o, stages, cuts, &tried));
      }
      ASSERT_TRUE(std::isfinite(best)) << k.graph;
      const double ratio = plan->predicted_step_s / best;
      worst = std::max(worst, ratio);
      std::printf("%-18s %d devices, %-5s%s m=%d: plan %.3f ms (%zu stages, replicas", k.graph, k.devices,
                  std::string(scheduler::schedule_kind_name(kind)).c_str(), ranks > 0 ? " (ranks fixed)" : "",
                  k.microbatches, plan->predicted_step_s * 1e3,
                  plan->stages.size());
      for (const auto& s : plan->stages) std::printf(" %d", s.replicas);
      std::printf(", planned in %.2f s), the best of %d cuts %.3f ms: %.3fx\n", planning_s, tried, best * 1e3, ratio);
      EXPECT_LE(ratio, 1.01) << k.graph << " " << scheduler::schedule_kind_name(kind) << "\n" << plan->table();
      ++compared;
    }
  }
  std::printf("%d plans on public op graphs: worst %.3fx the best brute-force cut\n", compared, worst);
}

// The repository's own example that once searched for minutes (a layer graph on the
// heterogeneous cluster file): with no time at all, the planner still returns a plan (the
// bottleneck bisection's), says its search was cut, and reports each search as it ends.
TEST(OpGraphExamples, AnExhaustedTimeBudgetReturnsTheBestPlanSoFarAndSaysSo) {
  auto g = load_cost_graph(example("layer-gnmt"));
  ASSERT_TRUE(g.is_ok()) << g.status().to_string();
  auto cluster = load_cluster(std::string(CONVEYOR_SOURCE_ROOT) + "/examples/clusters/mixed-generations.toml");
  ASSERT_TRUE(cluster.is_ok()) << cluster.status().to_string();
  PlanOptions o;
  o.batch = 64;
  o.time_budget_s = 1e-9;
  std::vector<std::pair<int, int>> reports;
  o.progress = [&reports](int done, int total, double) { reports.emplace_back(done, total); };
  auto plan = make_plan(*g, *cluster, o);
  ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
  EXPECT_NE(plan->search.find("time budget"), std::string::npos) << plan->search;
  EXPECT_GT(plan->predicted_step_s, 0);
  ASSERT_FALSE(reports.empty());
  for (std::size_t k = 0; k < reports.size(); ++k) EXPECT_EQ(reports[k].first, static_cast<int>(k) + 1);
  EXPECT_EQ(reports.back().first, reports.back().second);  // every search reported, the last as the end

  o.microbatches = 8;  // a small search given all the time it needs does not mention the budget
  o.time_budget_s = 0;
  o.progress = nullptr;
  auto whole = make_plan(*g, Cluster::uniform(1, 4, 1e12, 1.0, {kBandwidth, 0}, {kBandwidth, 0}), o);
  ASSERT_TRUE(whole.is_ok()) << whole.status().to_string();
  EXPECT_EQ(whole->search.find("time budget"), std::string::npos) << whole->search;
}

}  // namespace
}  // namespace conveyor::partitioner

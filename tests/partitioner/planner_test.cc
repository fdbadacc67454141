// The planner's searches against brute force: the exact search's analytic optimum, the
// simulator's best (a search true to the schedules), fixed parts, convex stages and mixed
// device speeds. What the plans hold (memory, chunked schedules, documents): plans_test.cc.
#include "partitioner/planner.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <random>

#include "common/shares.h"
#include "random_graphs.h"

namespace conveyor::partitioner {
namespace {

using scheduler::ScheduleKind;
using testing::fast_link;
using testing::for_each_replica_assignment;
using testing::is_convex;
using testing::random_dag;
using testing::reachability;
using testing::uniform_chain;

constexpr double kInf = std::numeric_limits<double>::infinity();

// Every downset of a graph of at most 20 operators, as bit masks.
std::vector<std::uint32_t> all_downsets(const CostGraph& g) {
  const int n = static_cast<int>(g.ops.size());
  std::vector<std::uint32_t> preds(n, 0);
  for (int b = 0; b < n; ++b) {
    for (int v : g.ops[b].inputs) {
      if (g.values[v].producer >= 0) preds[b] |= 1u << g.values[v].producer;
    }
  }
  std::vector<std::uint32_t> out;
  for (std::uint32_t mask = 0; mask < (1u << n); ++mask) {
    bool closed = true;
    for (int b = 0; b < n && closed; ++b) {
      if ((mask >> b) & 1u) closed = (preds[b] & ~mask) == 0;
    }
    if (closed) out.push_back(mask);
  }
  return out;
}

// Brute force: every ordered partition into convex stages (chains of nested downsets) with
// every replica assignment, scored by the planner's cost model (`simulated`: by the
// simulated step of the candidate's plan); with `allowed`, only the candidates it accepts.
double brute_force(const CostGraph& g, const Cluster& cluster, const PlanOptions& o, int m, ScheduleKind kind,
                   const std::function<bool(const Candidate&)>& allowed = nullptr, bool simulated = false) {
  const int n = static_cast<int>(g.ops.size());
  const int devices = static_cast<int>(cluster.devices.size());
  const auto downs = all_downsets(g);
  const std::uint32_t full = (n == 32) ? ~0u : ((1u << n) - 1);
  auto reach = reachability(g);
  double best = kInf;
  std::vector<std::uint32_t> chain{0};
  std::function<void()> extend = [&]() {
    const std::uint32_t last = chain.back();
    if (last == full) {
      Candidate c;
      c.microbatches = m;
      c.schedule = kind;
      for (std::size_t s = 1; s < chain.size(); ++s) {
        std::vector<int> stage;
        for (int x = 0; x < n; ++x) {
          if (((chain[s] & ~chain[s - 1]) >> x) & 1u) stage.push_back(x);
        }
        EXPECT_TRUE(is_convex(reach, stage, n));  // nested downsets give convex stages
        c.stages.push_back(stage);
      }
      c.replicas.assign(c.stages.size(), 1);
      for_each_replica_assignment(c.replicas, devices, [&] {
        if (allowed && !allowed(c)) return;
        if (simulated) {
          auto plan = plan_candidate(g, cluster, o, c);
          if (plan) best = std::min(best, plan->predicted_step_s);
          return;
        }
        auto obj = candidate_objective(g, cluster, o, c);
        if (obj) best = std::min(best, *obj);
      });
      return;
    }
    if (static_cast<int>(chain.size()) - 1 >= devices) return;  // each stage needs a device
    for (std::uint32_t d : downs) {
      if (d != last && (d & last) == last) {
        chain.push_back(d);
        extend();
        chain.pop_back();
      }
    }
  };
  extend();
  return best;
}

// The exact search's options for the random-DAG tests: a batch of 8 in `m` microbatches.
PlanOptions exact_options(int m, ScheduleKind kind) {
  PlanOptions o;
  o.batch = 8;
  o.microbatches = m;
  o.schedules = {kind};
  o.search = SearchMode::kExact;
  return o;
}

TEST(Planner, ExactSearchMatchesBruteForceOnRandomDags) {
  std::mt19937_64 rng(2026);
  int compared = 0, infeasible = 0, grouped = 0;
  for (int trial = 0; trial < 240; ++trial) {
    const int devices = 2 + static_cast<int>(rng() % 3);  // 2..4
    const int n = 3 + static_cast<int>(rng() % (devices == 4 ? 10 : 14));  // up to 12 or 16 operators
    CostGraph g = random_dag(n, 1000 + trial);
    // Sometimes pin two adjacent operators together (a convex group).
    if (trial % 3 == 0) {
      auto reach = reachability(g);
      for (int b = n - 1; b > 0; --b) {
        if (reach[b - 1][b] && is_convex(reach, {b - 1, b}, n)) {
          g.ops[b - 1].group = g.ops[b].group = 7;
          ++grouped;
          break;
        }
      }
    }
    const double memory = std::vector<double>{40e3, 80e3, 1e9, 1e9}[rng() % 4];
    Cluster cluster = Cluster::uniform(devices <= 2 ? 1 : 2, devices <= 2 ? devices : (devices + 1) / 2, memory, 1.0,
                                       {50e6, 1e-5}, {5e6, 1e-4});
    while (static_cast<int>(cluster.devices.size()) > devices) cluster.devices.pop_back();
    if (trial % 4 == 1) cluster.devices.back().speed = 1.7;  // heterogeneous speeds
    const int m = 1 + static_cast<int>(rng() % 4);
    const ScheduleKind kind = trial % 2 ? ScheduleKind::kOneFOneB : ScheduleKind::kGPipe;
    PlanOptions o = exact_options(m, kind);
    o.simulated_search = false;  // the analytic optimum itself
    const double expected = brute_force(g, cluster, o, m, kind);
    auto plan = make_plan(g, cluster, o);
    if (!std::isfinite(expected)) {
      ASSERT_FALSE(plan.is_ok()) << "trial " << trial;
      EXPECT_EQ(plan.status().code(), ErrorCode::kDoesNotFit);
      ++infeasible;
      continue;
    }
    ASSERT_TRUE(plan.is_ok()) << "trial " << trial << ": " << plan.status().to_string();
    EXPECT_NEAR(plan->objective_s, expected, 1e-9 * expected) << "trial " << trial << " n=" << n << " devices=" << devices;
    // The plan's own stages score to the same objective.
    Candidate c;
    c.microbatches = m;
    c.schedule = kind;
    for (const auto& s : plan->stages) {
      c.stages.push_back(s.ops);
      c.replicas.push_back(s.replicas);
    }
    auto again = candidate_objective(g, cluster, o, c);
    ASSERT_TRUE(again.is_ok()) << again.status().to_string();
    EXPECT_NEAR(*again, expected, 1e-9 * expected);
    ++compared;
  }
  std::printf("brute force agreed on %d feasible DAGs (%d with a group) and %d infeasible ones\n", compared, grouped,
              infeasible);
  EXPECT_GE(compared, 200);
  EXPECT_GT(infeasible, 0);  // some memory limits are too tight, and both agree
  EXPECT_GT(grouped, 20);
}

TEST(Planner, NoPlanSimulatesFasterThanTheOneReturnedEvenWhenTransfersDominate) {
  // Transfers of 30-60% of a stage's work and more: the analytic objective and the
  // simulated schedule disagree most here. The plan returned must simulate at least as fast
  // as every candidate the brute force simulates.
  std::mt19937_64 rng(77);
  int compared = 0, worse = 0;
  double worst = 1;
  for (int trial = 0; trial < 120; ++trial) {
    const int devices = 2 + static_cast<int>(rng() % 3);
    const int n = 3 + static_cast<int>(rng() % (devices == 4 ? 8 : 11));
    CostGraph g = random_dag(n, 5000 + trial);
    const double bandwidth = std::vector<double>{2e6, 5e6, 20e6}[rng() % 3];
    Cluster cluster = Cluster::uniform(1, devices, 1e9, 1.0, {bandwidth, 2e-5}, {bandwidth, 2e-5});
    const int m = 1 + static_cast<int>(rng() % 4);
    const ScheduleKind kind = trial % 2 ? ScheduleKind::kOneFOneB : ScheduleKind::kGPipe;
    const PlanOptions o = exact_options(m, kind);
    const double best = brute_force(g, cluster, o, m, kind, nullptr, /*simulated=*/true);
    auto plan = make_plan(g, cluster, o);
    ASSERT_TRUE(std::isfinite(best) && plan.is_ok()) << "trial " << trial;
    const double ratio = plan->predicted_step_s / best;
    worst = std::max(worst, ratio);
    if (ratio > 1.01) ++worse;
    EXPECT_LE(ratio, 1.01) << "trial " << trial << " n=" << n << " devices=" << devices << " m=" << m << " "
                           << scheduler::schedule_kind_name(kind) << ": simulated " << plan->predicted_step_s
                           << " s, the best candidate " << best << " s\n"
                           << plan->table();
    ++compared;
  }
  std::printf("%d transfer-heavy DAGs: %d plans slower than the best simulated candidate, worst %.3fx\n", compared,
              worse, worst);
}

TEST(Planner, FixedRanksAndReplicasGetTheBestPlanWithThem) {
  // Stages and replicas fixed alone or together: the plan is the best of those that have
  // them (brute force over every partition restricted to them), in every search mode.
  std::mt19937_64 rng(77);
  int compared = 0;
  for (int trial = 0; trial < 90; ++trial) {
    const int devices = 2 + static_cast<int>(rng() % 3);  // 2..4
    const int n = 4 + static_cast<int>(rng() % 8);
    CostGraph g = random_dag(n, 5000 + trial);
    Cluster cluster = Cluster::uniform(1, devices, 1e9, 1.0, {50e6, 1e-5}, {5e6, 1e-4});
    if (trial % 3 == 1) cluster.devices.back().speed = 1.7;
    PlanOptions o;
    o.batch = 8;
    o.microbatches = 1 + static_cast<int>(rng() % 4);
    const ScheduleKind kind = trial % 2 ? ScheduleKind::kOneFOneB : ScheduleKind::kGPipe;
    o.schedules = {kind};
    o.ranks = trial % 3 == 2 ? 0 : 1 + static_cast<int>(rng() % std::min(devices, 3));
    const int variant = trial % 4;  // replicas: planned, one count, one per rank
    if (variant == 1 || o.ranks == 0) {
      o.replicas = {1 + static_cast<int>(rng() % 2)};
    } else if (variant == 2) {
      for (int r = 0; r < o.ranks; ++r) o.replicas.push_back(1 + static_cast<int>(rng() % 2));
    }
    int need = 0;
    for (int r = 0; r < std::max(o.ranks, 1); ++r) need += o.replicas.empty() ? 1 : o.replicas[o.replicas.size() == 1 ? 0 : r];
    if (need > devices) continue;
    auto allowed = [&](const Candidate& c) {
      if (o.ranks > 0 && static_cast<int>(c.stages.size()) != o.ranks) return false;
      for (std::size_t s = 0; s < c.replicas.size(); ++s) {
        if (o.replicas.size() == 1 && c.replicas[s] != o.replicas[0]) return false;
        if (o.replicas.size() > 1 && c.replicas[s] != o.replicas[s]) return false;
      }
      return true;
    };
    const double expected = brute_force(g, cluster, o, o.microbatches, kind, allowed);
    const double expected_simulated = brute_force(g, cluster, o, o.microbatches, kind, allowed, true);
    for (auto [mode, simulated] : {std::pair{SearchMode::kExact, false}, std::pair{SearchMode::kAuto, false},
                                   std::pair{SearchMode::kExact, true}}) {
      o.search = mode;
      o.simulated_search = simulated;
      auto plan = make_plan(g, cluster, o);
      if (!std::isfinite(expected)) {
        ASSERT_FALSE(plan.is_ok()) << "trial " << trial;
        continue;
      }
      ASSERT_TRUE(plan.is_ok()) << "trial " << trial << ": " << plan.status().to_string();
      if (o.ranks > 0) {
        EXPECT_EQ(plan->ranks(), o.ranks) << "trial " << trial;
      }
      for (std::size_t s = 0; s < plan->stages.size(); ++s) {
        if (!o.replicas.empty()) {
          EXPECT_EQ(plan->stages[s].replicas, o.replicas[o.replicas.size() == 1 ? 0 : s]) << "trial " << trial;
        }
      }
      if (simulated) {  // the simulator's best of the plans with those parts
        EXPECT_LE(plan->predicted_step_s, expected_simulated * (1 + 1e-9)) << "trial " << trial;
      } else {
        EXPECT_NEAR(plan->objective_s, expected, 1e-9 * expected) << "trial " << trial << " ranks " << o.ranks;
      }
      ++compared;
    }
  }
  EXPECT_GE(compared, 100);
}

// Whether stages `a` and `b` of a plan (`replicas` each, on consecutive devices ending at
// the cluster's last) split a microbatch of `samples` alike: as many replicas, the same
// samples each (shares by device speed in whole samples, common/shares.h).
bool split_alike(const Cluster& cluster, const std::vector<int>& replicas, std::int64_t samples, int a, int b) {
  if (replicas[a] != replicas[b]) return false;
  int first = static_cast<int>(cluster.devices.size());
  for (int r : replicas) first -= r;
  std::vector<std::vector<double>> speeds;
  for (int r : replicas) {
    speeds.emplace_back();
    for (int k = 0; k < r; ++k) speeds.back().push_back(cluster.devices[first + k].speed);
    first += r;
  }
  return share_lengths(samples, speeds[a], replicas[a]) == share_lengths(samples, speeds[b], replicas[b]);
}

// The runtime's rule (runtime/batch_layout.h): a value that cannot be redistributed passes
// only between stages that split alike. `adjacent`: the planner's, stricter: each prefix of
// stages that such a value leaves ends between stages that split alike.
bool passes_fixed_values(const CostGraph& g, const Cluster& cluster, std::int64_t samples,
                         const std::vector<std::vector<int>>& stages, const std::vector<int>& replicas, bool adjacent) {
  std::vector<int> stage_of(g.ops.size(), -1);
  for (std::size_t s = 0; s < stages.size(); ++s) {
    for (int op : stages[s]) stage_of[op] = static_cast<int>(s);
  }
  for (std::size_t i = 0; i < g.ops.size(); ++i) {
    for (int v : g.ops[i].inputs) {
      const int p = g.values[v].producer;
      if (p < 0 || g.values[v].redistributable) continue;
      const int from = stage_of[p], to = stage_of[i];
      if (!adjacent && from != to && !split_alike(cluster, replicas, samples, from, to)) return false;
      for (int k = from; adjacent && k < to; ++k) {
        if (!split_alike(cluster, replicas, samples, k, k + 1)) return false;
      }
    }
  }
  return true;
}

TEST(Planner, NeverCutsThroughAValueTheRuntimeCannotRedistribute) {
  // Values with no plain batch dimension pass only between stages whose replicas split a
  // microbatch alike (runtime/batch_layout.h). Every plan keeps to that, in every search
  // mode, and the exact search's is the best of those that do (brute force).
  std::mt19937_64 rng(91);
  int plans = 0, restricted = 0;
  for (int trial = 0; trial < 60; ++trial) {
    const int devices = 2 + static_cast<int>(rng() % 3);  // 2..4
    const int n = 4 + static_cast<int>(rng() % 7);
    CostGraph g = random_dag(n, 7000 + trial);
    for (auto& v : g.values) {
      if (v.producer >= 0 && rng() % 3 == 0) v.redistributable = false;
    }
    Cluster cluster = Cluster::uniform(1, devices, 1e9, 1.0, {50e6, 1e-5}, {5e6, 1e-4});
    if (trial % 2) cluster.devices.back().speed = 1.7;
    PlanOptions o = exact_options(1 + static_cast<int>(rng() % 4), trial % 3 ? ScheduleKind::kOneFOneB
                                                                             : ScheduleKind::kGPipe);
    const std::int64_t samples = o.batch / o.microbatches;
    auto allowed = [&](const Candidate& c) { return passes_fixed_values(g, cluster, samples, c.stages, c.replicas, true); };
    const double expected = brute_force(g, cluster, o, o.microbatches, o.schedules[0], allowed);
    const double unrestricted = brute_force(g, cluster, o, o.microbatches, o.schedules[0]);
    if (expected > unrestricted * (1 + 1e-9)) ++restricted;
    for (auto [mode, simulated] : {std::pair{SearchMode::kExact, false}, std::pair{SearchMode::kExact, true},
                                   std::pair{SearchMode::kAuto, true}, std::pair{SearchMode::kBottleneck, true}}) {
      o.search = mode;
      o.simulated_search = simulated;
      auto plan = make_plan(g, cluster, o);
      ASSERT_TRUE(plan.is_ok()) << "trial " << trial << ": " << plan.status().to_string();
      std::vector<std::vector<int>> stages;
      std::vector<int> replicas;
      for (const auto& st : plan->stages) {
        stages.push_back(st.ops);
        replicas.push_back(st.replicas);
      }
      EXPECT_TRUE(passes_fixed_values(g, cluster, samples, stages, replicas, false)) << "trial " << trial;
      ++plans;
      if (!simulated) {  // the analytic optimum of the plans allowed
        EXPECT_NEAR(plan->objective_s, expected, 1e-9 * expected) << "trial " << trial;
      }
    }
  }
  EXPECT_GE(plans, 200);
  EXPECT_GE(restricted, 5);  // the rule changed the best plan that often
}

TEST(Planner, FixedPartsThatCannotBeMetAreNamed) {
  CostGraph g = uniform_chain(3, 1e-3, 2e-3, 1e6, 1e5);
  Cluster cluster = Cluster::uniform(1, 4, 1e9, 1.0, fast_link(), fast_link());
  PlanOptions o;
  o.batch = 8;
  o.ranks = 2;
  o.replicas = {3};
  auto too_many_devices = make_plan(g, cluster, o);
  ASSERT_FALSE(too_many_devices.is_ok());
  EXPECT_NE(too_many_devices.status().message().find("2 pipeline ranks of 3 replicas each need 6 devices"), std::string::npos)
      << too_many_devices.status().message();
  o.replicas = {};
  o.ranks = 4;
  auto too_many_stages = make_plan(g, cluster, o);
  ASSERT_FALSE(too_many_stages.is_ok());
  EXPECT_NE(too_many_stages.status().message().find("at most 3 stages"), std::string::npos)
      << too_many_stages.status().message();
  o.ranks = 2;
  o.replicas = {1, 1, 1};
  EXPECT_EQ(make_plan(g, cluster, o).status().code(), ErrorCode::kInvalidArgument);
  o.replicas = {1};
  cluster.devices[0].memory_bytes = cluster.devices[1].memory_bytes = cluster.devices[2].memory_bytes =
      cluster.devices[3].memory_bytes = 1e6;  // not even one operator's weights and state
  auto tight = make_plan(g, cluster, o);
  ASSERT_FALSE(tight.is_ok());
  EXPECT_EQ(tight.status().code(), ErrorCode::kDoesNotFit);
  EXPECT_NE(tight.status().message().find("no plan with 2 pipeline ranks of 1 replica each fits"), std::string::npos)
      << tight.status().message();
}

TEST(Planner, StagesOfBranchyGraphsAreConvexInEveryMode) {
  for (int trial = 0; trial < 12; ++trial) {
    const int n = 40 + 20 * (trial % 4);
    CostGraph g = random_dag(n, 77 + trial, 0.7, 0.5);
    auto reach = reachability(g);
    Cluster cluster = Cluster::uniform(2, 4, 1e9, 1.0, {50e6, 1e-5}, {5e6, 1e-4});
    for (SearchMode mode : {SearchMode::kAuto, SearchMode::kBottleneck}) {
      PlanOptions o;
      o.batch = 16;
      o.search = mode;
      o.max_blocks = 24;
      auto plan = make_plan(g, cluster, o);
      ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
      std::vector<int> seen(n, 0);
      std::vector<int> stage_of(n, -1);
      for (std::size_t s = 0; s < plan->stages.size(); ++s) {
        EXPECT_TRUE(is_convex(reach, plan->stages[s].ops, n)) << "trial " << trial << " stage " << s;
        for (int op : plan->stages[s].ops) {
          ++seen[op];
          stage_of[op] = static_cast<int>(s);
        }
      }
      for (int x = 0; x < n; ++x) EXPECT_EQ(seen[x], 1);
      // Stages only read from earlier stages.
      for (int b = 0; b < n; ++b) {
        for (int v : g.ops[b].inputs) EXPECT_LE(stage_of[g.values[v].producer], stage_of[b]);
      }
    }
  }
}

TEST(Planner, HeterogeneousDevicesReachTheFluidBound) {
  // Two nodes of four devices, the second twice as fast; a balanced 64-layer workload.
  Cluster cluster = Cluster::uniform(2, 4, 16e9, 1.0, {100e9, 2e-6}, {12.5e9, 1e-5});
  for (auto& d : cluster.devices) {
    if (d.node == 1) d.speed = 2.0;
  }
  CostGraph g = uniform_chain(64, 1e-3, 2e-3, 4e6, 1e5);
  PlanOptions o;
  o.batch = 96;
  auto plan = make_plan(g, cluster, o);
  ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
  double work = 0;
  for (const auto& op : g.ops) work += op.forward_s + op.backward_s;
  double speeds = 0;
  for (const auto& d : cluster.devices) speeds += d.speed;
  const double fluid = work * o.batch / g.microbatch / speeds;
  const double ratio = fluid / plan->predicted_step_s;
  std::printf("fluid bound %.4f s, plan %.4f s: %.3f of the bound\n%s", fluid, plan->predicted_step_s, ratio,
              plan->table().c_str());
  EXPECT_GE(ratio, 0.9);
  EXPECT_LE(ratio, 1.0 + 1e-9);
}

TEST(Planner, EvenSharesPriceAReplicatedStageAtItsSlowestDevice) {
  // One fast and one slow device: with shares by speed in whole samples (8 samples: 6 and 2,
  // or 5 and 3, both ending at 0.75 of the microbatch's time at speed 1) the two replicas of
  // one stage run at 4/3; split evenly they wait for the slow one, at 2 x 0.5.
  Cluster cluster = Cluster::uniform(1, 2, 16e9, 1.0, {100e9, 2e-6}, {100e9, 2e-6});
  cluster.devices[1].speed = 0.5;
  CostGraph g = uniform_chain(8, 1e-3, 2e-3, 1e3, 1e3);
  PlanOptions o;
  o.batch = 8;
  o.microbatches = 1;
  o.schedules = {ScheduleKind::kGPipe};
  Candidate both{{{0, 1, 2, 3, 4, 5, 6, 7}}, {2}, 1, ScheduleKind::kGPipe};
  auto proportional = candidate_objective(g, cluster, o, both);
  o.even_shares = true;
  auto even = candidate_objective(g, cluster, o, both);
  ASSERT_TRUE(proportional.is_ok() && even.is_ok());
  EXPECT_NEAR(*even / *proportional, 4.0 / 3.0, 0.02);
  auto plan = make_plan(g, cluster, o);
  ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
  for (const auto& st : plan->stages) {
    for (double share : st.shares) EXPECT_DOUBLE_EQ(share, 1.0 / st.replicas);
  }
  // Weighted, the plan's shares are the whole-sample split the runtime makes of them.
  o.even_shares = false;
  o.ranks = 1;  // one stage on both devices
  auto weighted = make_plan(g, cluster, o);
  ASSERT_TRUE(weighted.is_ok()) << weighted.status().to_string();
  ASSERT_EQ(weighted->stages.size(), 1u);
  for (const auto& st : weighted->stages) {
    ASSERT_EQ(st.replicas, 2);
    EXPECT_DOUBLE_EQ(st.shares[0], 6.0 / 8);
    EXPECT_DOUBLE_EQ(st.shares[1], 2.0 / 8);
    EXPECT_EQ(share_lengths(8, st.shares, 2), (std::vector<std::int64_t>{6, 2}));
  }
  EXPECT_NE(weighted->table().find("stage 0's replicas share each microbatch 6/2 samples"), std::string::npos)
      << weighted->table();
  EXPECT_EQ(plan->table().find("share each microbatch"), std::string::npos) << "even shares go unsaid";
}

}  // namespace
}  // namespace conveyor::partitioner

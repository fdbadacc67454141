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
using testing::is_convex;
using testing::random_dag;
using testing::reachability;
using testing::uniform_chain;

constexpr double kInf = std::numeric_limits<double>::infinity();

Link fast_link() { return {100e9, 1e-6}; }

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
      const int stages = static_cast<int>(c.stages.size());
      c.replicas.assign(stages, 1);
      std::function<void(int, int)> assign = [&](int s, int left) {
        if (s == stages) {
          if (allowed && !allowed(c)) return;
          if (simulated) {
            auto plan = plan_candidate(g, cluster, o, c);
            if (plan) best = std::min(best, plan->predicted_step_s);
            return;
          }
          auto obj = candidate_objective(g, cluster, o, c);
          if (obj) best = std::min(best, *obj);
          return;
        }
        for (int r = 1; r <= left - (stages - s - 1); ++r) {
          c.replicas[s] = r;
          assign(s + 1, left - r);
        }
      };
      assign(0, devices);
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
}

TEST(Planner, ModelThatCannotFitGetsTheMemoryItWouldNeed) {
  CostGraph g = uniform_chain(16, 1e-3, 2e-3, 1e9, 1e6);  // 16 GB of weights, x4 with Adam
  Cluster small = Cluster::uniform(1, 4, 8e9, 1.0, fast_link(), fast_link());
  PlanOptions o;
  o.batch = 8;
  auto plan = make_plan(g, small, o);
  ASSERT_FALSE(plan.is_ok());
  EXPECT_EQ(plan.status().code(), ErrorCode::kDoesNotFit);
  const std::string& msg = plan.status().message();
  EXPECT_NE(msg.find("needs at least"), std::string::npos) << msg;
  EXPECT_NE(msg.find("per device"), std::string::npos) << msg;
  // The stated figure is right: with that much memory per device a plan exists, with a bit
  // less none does.
  const auto pos = msg.find("needs at least ") + 15;
  const double gib = std::stod(msg.substr(pos));
  ASSERT_NE(msg.find("GiB", pos), std::string::npos);
  Cluster enough = Cluster::uniform(1, 4, (gib + 0.1) * 1024 * 1024 * 1024, 1.0, fast_link(), fast_link());
  EXPECT_TRUE(make_plan(g, enough, o).is_ok()) << msg;
  Cluster short_of = Cluster::uniform(1, 4, (gib - 0.2) * 1024 * 1024 * 1024, 1.0, fast_link(), fast_link());
  EXPECT_FALSE(make_plan(g, short_of, o).is_ok()) << msg;
}

TEST(Planner, StagesRecomputeWhereTheyWouldNotFitOtherwise) {
  // Activations dominate: 8 layers of 100 MB saved each per microbatch, small weights.
  CostGraph g = uniform_chain(8, 1e-3, 2e-3, 1e6, 1e8);
  PlanOptions o;
  o.batch = 8;
  o.microbatches = 4;
  o.ranks = 2;
  o.schedules = {ScheduleKind::kOneFOneB};
  o.recompute = PlanOptions::Recompute::kNever;
  auto roomy = make_plan(g, Cluster::uniform(1, 2, 1e12, 1.0, fast_link(), fast_link()), o);
  ASSERT_TRUE(roomy.is_ok()) << roomy.status().to_string();
  double need = 0;
  for (const auto& s : roomy->stages) need = std::max(need, s.memory_bytes);
  const Cluster tight = Cluster::uniform(1, 2, 0.6 * need, 1.0, fast_link(), fast_link());
  EXPECT_EQ(make_plan(g, tight, o).status().code(), ErrorCode::kDoesNotFit);  // without recomputation: none
  o.recompute = PlanOptions::Recompute::kWhenNeeded;
  auto plan = make_plan(g, tight, o);
  ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
  int recomputing = 0;
  for (const auto& s : plan->stages) {
    EXPECT_LE(s.memory_bytes, 0.6 * need);
    if (!s.recompute) continue;
    ++recomputing;
    EXPECT_NEAR(s.backward_s, s.forward_s + 2 * s.forward_s, 1e-12);  // the forward again, then B = 2F
  }
  EXPECT_GE(recomputing, 1);
  EXPECT_GT(plan->predicted_step_s, roomy->predicted_step_s);  // memory for time
  EXPECT_NE(plan->table().find("yes"), std::string::npos) << plan->table();
  auto back = Plan::from_json(plan->to_json());
  ASSERT_TRUE(back.is_ok());
  for (std::size_t s = 0; s < plan->stages.size(); ++s) EXPECT_EQ(back->stages[s].recompute, plan->stages[s].recompute);
  // Always: every stage recomputes, even with room to spare.
  o.recompute = PlanOptions::Recompute::kAlways;
  auto always = make_plan(g, Cluster::uniform(1, 2, 1e12, 1.0, fast_link(), fast_link()), o);
  ASSERT_TRUE(always.is_ok());
  for (const auto& s : always->stages) EXPECT_TRUE(s.recompute);
}

TEST(Planner, PlanDocumentRoundTripsAndSimulatesToItsPrediction) {
  CostGraph g = random_dag(30, 5);
  Cluster cluster = Cluster::uniform(2, 2, 1e9, 1.0, {50e6, 1e-5}, {5e6, 1e-4});
  PlanOptions o;
  o.batch = 32;
  auto plan = make_plan(g, cluster, o);
  ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
  auto back = Plan::from_json(plan->to_json());
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_EQ(back->to_json(), plan->to_json());
  auto sim = back->simulate();
  ASSERT_TRUE(sim.is_ok());
  EXPECT_NEAR(sim->step_time_s, plan->predicted_step_s, 1e-12);
  EXPECT_NE(plan->table().find("predicted step"), std::string::npos);
}

TEST(Planner, PlanDocumentErrorsNameThePath) {
  CostGraph g = uniform_chain(8, 1e-3, 2e-3, 1e3, 1e3);
  Cluster cluster = Cluster::uniform(1, 2, 1e9, 1.0, fast_link(), fast_link());
  PlanOptions o;
  o.batch = 4;
  auto plan = make_plan(g, cluster, o);
  ASSERT_TRUE(plan.is_ok());
  std::string doc = plan->to_json();
  auto bad = Plan::from_json(doc.substr(0, doc.size() / 2));
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("not valid JSON"), std::string::npos);
  std::string wrong = doc;
  wrong.replace(wrong.find("\"replicas\": "), 13, "\"replicas\": 9");
  auto bad2 = Plan::from_json(wrong);
  ASSERT_FALSE(bad2.is_ok());
  EXPECT_NE(bad2.status().message().find("/stages/"), std::string::npos) << bad2.status().message();
}

TEST(Planner, RejectsBadOptions) {
  CostGraph g = uniform_chain(4, 1e-3, 2e-3, 1e3, 1e3);
  Cluster cluster = Cluster::uniform(1, 2, 1e9, 1.0, fast_link(), fast_link());
  PlanOptions o;
  EXPECT_EQ(make_plan(g, cluster, o).status().code(), ErrorCode::kInvalidArgument);  // no batch
  o.batch = 4;
  o.microbatches = 8;
  auto r = make_plan(g, cluster, o);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("smaller than the microbatch count"), std::string::npos);
  g.ops[2].group = 1;  // a group that is not convex: 0 and 2 without 1
  g.ops[0].group = 1;
  o.microbatches = 0;
  auto nc = make_plan(g, cluster, o);
  ASSERT_FALSE(nc.is_ok());
  EXPECT_NE(nc.status().message().find("not convex"), std::string::npos) << nc.status().message();
}

// 16 layers of 1 GB (4 GB with gradients and Adam) on 8 devices of 20 GB: no replica holds
// the model, so a plan has several device groups to fold it over under `kind`.
struct FoldedModel {
  CostGraph g = uniform_chain(16, 1e-3, 2e-3, 1e9, 1e5);
  Cluster cluster = Cluster::uniform(1, 8, 20e9, 1.0, fast_link(), fast_link());
  PlanOptions o;
  explicit FoldedModel(ScheduleKind kind) {
    o.batch = 32;
    o.microbatches = 16;
    o.schedules = {kind};
  }
};

// A chunked plan simulates to its prediction and keeps its chunks through a JSON round trip.
void expect_consistent(const Plan& plan) {
  auto sim = plan.simulate();
  ASSERT_TRUE(sim.is_ok()) << sim.status().to_string();
  EXPECT_NEAR(sim->step_time_s, plan.predicted_step_s, 1e-12);
  auto back = Plan::from_json(plan.to_json());
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_EQ(back->schedule, plan.schedule);
  EXPECT_EQ(back->chunks, plan.chunks);
}

TEST(Planner, InterleavedPlansRegroupStagesOntoDeviceGroups) {
  FoldedModel f(ScheduleKind::kInterleaved);
  auto plan = make_plan(f.g, f.cluster, f.o);
  ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
  EXPECT_EQ(plan->schedule, ScheduleKind::kInterleaved);
  ASSERT_GT(plan->chunks, 1);
  const int groups = plan->ranks();
  for (std::size_t k = 0; k < plan->stages.size(); ++k) {
    EXPECT_EQ(plan->stages[k].first_device, plan->stages[k % groups].first_device);
    EXPECT_LE(plan->stages[k].memory_bytes, 20e9);
  }
  expect_consistent(*plan);
  // A plan that cannot be interleaved says so rather than blaming memory.
  Cluster roomy = Cluster::uniform(1, 1, 1e12, 1.0, fast_link(), fast_link());  // one device: one group
  auto none = make_plan(f.g, roomy, f.o);
  ASSERT_FALSE(none.is_ok());
  EXPECT_EQ(none.status().code(), ErrorCode::kUnsupported) << none.status().to_string();
}

TEST(Planner, ZeroBubbleVPlansHoldTwoPiecesPerGroupInAV) {
  FoldedModel f(ScheduleKind::kZeroBubbleV);
  auto plan = make_plan(f.g, f.cluster, f.o);
  ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
  EXPECT_EQ(plan->schedule, ScheduleKind::kZeroBubbleV);
  ASSERT_EQ(plan->chunks, 2);
  const int groups = plan->ranks();
  ASSERT_GE(groups, 2) << plan->table();
  for (int k = 0; k < groups; ++k) {  // the model down the groups and back up
    const auto& down = plan->stages[k];
    const auto& up = plan->stages[2 * groups - 1 - k];
    EXPECT_EQ(down.first_device, up.first_device) << plan->table();
    EXPECT_EQ(down.replicas, up.replicas);
    EXPECT_LE(down.memory_bytes, 20e9);
  }
  expect_consistent(*plan);
  std::string three = plan->to_json();
  const std::string two = "\"chunks\": 2";
  ASSERT_NE(three.find(two), std::string::npos) << three;
  three.replace(three.find(two), two.size(), "\"chunks\": 4");
  auto bad = Plan::from_json(three);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("ZB-V"), std::string::npos) << bad.status().message();
  // Among every schedule the simulated step decides: never slower than ZB-V alone.
  f.o.schedules.clear();
  auto any = make_plan(f.g, f.cluster, f.o);
  ASSERT_TRUE(any.is_ok()) << any.status().to_string();
  EXPECT_LE(any->predicted_step_s, plan->predicted_step_s + 1e-12);
}

TEST(Planner, ASplitBackwardsMemoryIsWhatItsScheduleKeeps) {
  // ZB-H1 keeps a microbatch's activations until its W, later than 1F1B's B: on the same
  // stages its first rank holds more at once, and the plan says so (the simulated peak).
  CostGraph g = uniform_chain(8, 1e-3, 2e-3, 1e6, 1e6);
  for (auto& op : g.ops) op.backward_weight_s = 1e-3;
  Cluster roomy = Cluster::uniform(1, 4, 1e12, 1.0, fast_link(), fast_link());
  PlanOptions o;
  o.batch = 16;
  o.microbatches = 8;
  o.ranks = 4;
  o.replicas = {1};
  o.schedules = {ScheduleKind::kOneFOneB};
  auto ofob = make_plan(g, roomy, o);
  o.schedules = {ScheduleKind::kZeroBubbleH1};
  auto zb = make_plan(g, roomy, o);
  ASSERT_TRUE(ofob.is_ok() && zb.is_ok()) << ofob.status().to_string() << zb.status().to_string();
  auto sim = zb->simulate();
  ASSERT_TRUE(sim.is_ok());
  EXPECT_GT(zb->stages[0].memory_bytes, ofob->stages[0].memory_bytes);
  EXPECT_GE(zb->stages[0].memory_bytes, sim->peak_bytes[0]);
  // Memory between the two: ZB-H1 does not fit where 1F1B does, and the error says why.
  const double between = (zb->stages[0].memory_bytes + ofob->stages[0].memory_bytes) / 2;
  Cluster tight = Cluster::uniform(1, 4, between, 1.0, fast_link(), fast_link());
  o.recompute = PlanOptions::Recompute::kNever;
  auto refused = make_plan(g, tight, o);
  ASSERT_FALSE(refused.is_ok());
  EXPECT_EQ(refused.status().code(), ErrorCode::kDoesNotFit);
  EXPECT_NE(refused.status().message().find("weight-gradient pass"), std::string::npos) << refused.status().message();
  o.schedules = {ScheduleKind::kOneFOneB, ScheduleKind::kZeroBubbleH1};
  auto either = make_plan(g, tight, o);
  ASSERT_TRUE(either.is_ok()) << either.status().to_string();
  EXPECT_EQ(either->schedule, ScheduleKind::kOneFOneB);
}

TEST(Planner, PrefersPipelinesWhenReplicasCannotHoldTheModel) {
  // 8 layers of 1 GB weights on 4 devices of 10 GB: a replica holds at most 2 layers.
  CostGraph g = uniform_chain(8, 1e-3, 2e-3, 1e9, 1e5);
  Cluster cluster = Cluster::uniform(1, 4, 10e9, 1.0, fast_link(), fast_link());
  PlanOptions o;
  o.batch = 16;
  auto plan = make_plan(g, cluster, o);
  ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
  EXPECT_EQ(plan->ranks(), 4) << plan->table();  // four device groups (ZB-V folds 8 stages over them)
  for (const auto& s : plan->stages) EXPECT_LE(s.memory_bytes, 10e9);
}

TEST(Planner, EveryReplicaKeepsTheSamplesTheModelRunsAtOnce) {
  // Light layers on fast links: without a bound the plan replicates down to a sample or two.
  CostGraph g = uniform_chain(8, 1e-3, 2e-3, 1e3, 1e3);
  Cluster cluster = Cluster::uniform(1, 4, 1e9, 1.0, fast_link(), fast_link());
  PlanOptions o;
  o.batch = 8;
  auto smallest_share = [&](const Plan& p) {
    int least = o.batch;
    for (const auto& s : p.stages) least = std::min(least, o.batch / p.microbatches / s.replicas);
    return least;
  };
  auto free = make_plan(g, cluster, o);
  ASSERT_TRUE(free.is_ok()) << free.status().to_string();
  ASSERT_LT(smallest_share(*free), 4) << free->table();  // the bound below changes the plan
  g.min_share = 4;
  auto bound = make_plan(g, cluster, o);
  ASSERT_TRUE(bound.is_ok()) << bound.status().to_string();
  EXPECT_GE(smallest_share(*bound), 4) << bound->table();
  auto back = CostGraph::from_json(g.to_json());
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_EQ(back->min_share, 4);
  // Asked microbatches that split below the bound, or a batch below it: errors naming both.
  o.microbatches = 4;
  auto split = make_plan(g, cluster, o);
  ASSERT_FALSE(split.is_ok());
  EXPECT_NE(split.status().message().find("use at most 2 microbatches"), std::string::npos) << split.status().message();
  o.microbatches = 0;
  o.batch = 2;
  auto tiny = make_plan(g, cluster, o);
  ASSERT_FALSE(tiny.is_ok());
  EXPECT_NE(tiny.status().message().find("batch of at least 4"), std::string::npos) << tiny.status().message();
}

}  // namespace
}  // namespace conveyor::partitioner

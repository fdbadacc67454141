// What the re-planning tests run: small clusters, the planner's options they plan with,
// and what a plan's layout measures on devices of given true speeds.
#pragma once

#include <algorithm>
#include <random>
#include <utility>
#include <vector>

#include "partitioner/replan.h"

namespace conveyor::partitioner::testing {

using scheduler::ScheduleKind;

inline Cluster devices(int n) { return Cluster::uniform(1, n, 16e9, 1.0, {10e9, 5e-6}, {10e9, 5e-6}); }

inline PlanOptions options() {
  PlanOptions o;
  o.batch = 16;
  o.microbatches = 4;
  o.max_replicas = 1;
  o.schedules = {ScheduleKind::kOneFOneB};
  o.even_shares = true;
  return o;
}

// The default policy, with moves that cost no bytes (parameters stay where they are, as in one
// process): what a switch pays is rebuilding alone.
inline ReplanPolicy moving_no_bytes() {
  ReplanPolicy p;
  p.moves_bytes = false;
  return p;
}

// The data-parallel layout a straggler among equal devices moves from: one stage with a
// replica on each of the cluster's devices, planned under `o` otherwise.
inline Plan one_stage_on_each_device(const CostGraph& g, const Cluster& cluster, PlanOptions o) {
  o.ranks = 1;
  o.replicas = {static_cast<int>(cluster.devices.size())};
  o.max_replicas = std::max(o.max_replicas, o.replicas[0]);
  return *make_plan(g, cluster, o);
}

// `g` with the operators of `stage` costing `factor` times what it says (a stage the profile
// priced off).
inline void scale_stage(CostGraph& g, const StagePlan& stage, double factor) {
  for (int id : stage.ops) {
    for (double* t : {&g.ops[id].forward_s, &g.ops[id].backward_s, &g.ops[id].backward_weight_s}) *t *= factor;
  }
}

// What `plan`'s layout measures when the operators cost what `g` says and the devices run at
// `speed` (the truth, whatever the Replanner believes), each kind off by a uniform factor
// within `noise`; the step as the simulator has it, off by the same noise.
inline std::pair<std::vector<StageMeasurement>, double> run(const CostGraph& g, const Plan& plan,
                                                     const std::vector<double>& speed, double noise,
                                                     std::mt19937& rng) {
  std::uniform_real_distribution<double> jitter(1 - noise, 1 + noise);
  Cluster truth = devices(static_cast<int>(speed.size()));
  for (std::size_t d = 0; d < speed.size(); ++d) truth.devices[d].speed = speed[d];
  Plan as_run = *reprice(g, truth, options(), plan);
  std::vector<StageMeasurement> out;
  for (auto& s : as_run.stages) {
    s.forward_s *= jitter(rng);
    s.backward_s *= jitter(rng);
    // A replicated stage's time is its slowest replica's; each replica's is that scaled by
    // its share over its device's speed, against the slowest replica's.
    std::vector<double> replicas;
    if (s.replicas > 1) {
      auto per_speed = [&](int i) {
        const double share = static_cast<int>(s.shares.size()) == s.replicas ? s.shares[i] : 1.0 / s.replicas;
        return share / speed[s.first_device + i];
      };
      double slowest = 0;
      for (int i = 0; i < s.replicas; ++i) slowest = std::max(slowest, per_speed(i));
      for (int i = 0; i < s.replicas; ++i) replicas.push_back((s.forward_s + s.backward_s) * per_speed(i) / slowest);
    }
    out.push_back({s.forward_s, s.backward_s, 0, replicas});
  }
  return {out, as_run.simulate()->step_time_s * jitter(rng)};
}

}  // namespace conveyor::partitioner::testing

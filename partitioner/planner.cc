#include "partitioner/planner.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <numeric>

#include "partitioner/fixed_parts.h"
#include "partitioner/plan_rows.h"
#include "partitioner/search.h"

namespace conveyor::partitioner {

using namespace detail;  // the search space, the stage model and the searches

namespace {

// Microbatch counts to search: each microbatch keeps at least `min_share` samples.
std::vector<int> microbatch_candidates(const PlanOptions& o, int min_share) {
  if (o.microbatches > 0) return {o.microbatches};
  std::vector<int> out;
  for (int m : {1, 2, 4, 8, 16, 32, 64, 128, 256}) {
    if (m <= o.batch / std::max(1, min_share) && m <= o.max_microbatches) out.push_back(m);
  }
  return out;
}

std::vector<ScheduleKind> schedule_candidates(const PlanOptions& o) {
  if (!o.schedules.empty()) return o.schedules;
  return {ScheduleKind::kGPipe,        ScheduleKind::kOneFOneB,    ScheduleKind::kInterleaved,
          ScheduleKind::kZeroBubbleH1, ScheduleKind::kZeroBubbleV, ScheduleKind::kDualPipeV};
}

// The schedule whose memory model a search runs under (ZB-H1 keeps 1F1B's activations; the
// chunked schedules start from a 1F1B plan's device groups).
ScheduleKind memory_kind(ScheduleKind k) { return k == ScheduleKind::kGPipe ? ScheduleKind::kGPipe : ScheduleKind::kOneFOneB; }

Plan build_plan(const CostGraph& g, const Cluster& cluster, const PlanOptions& options, const Units& u,
                const CutStates& cs, const Model& model, const Solution& sol, ScheduleKind kind) {
  Plan plan;
  plan.graph_name = g.name;
  plan.cluster_name = cluster.name;
  plan.batch = options.batch;
  plan.microbatches = model.microbatches();
  plan.schedule = kind;
  plan.devices = cluster.devices;
  plan.objective_s = sol.objective;
  std::vector<StageEval> evals;
  (void)score(u, cs, model, sol, &evals);
  const int stages = static_cast<int>(sol.cuts.size());
  int first = model.devices() - std::accumulate(sol.replicas.begin(), sol.replicas.end(), 0);
  for (int s = 0; s < stages; ++s) {
    const auto [inner, outer] = sol.cuts[s];
    plan.stages.push_back(
        stage_plan(u, cs, inner, outer, model, cluster, first, sol.replicas[s], evals[s], s > 0, s + 1 < stages));
    first += sol.replicas[s];
  }
  count_parameters_once(g, plan.schedule_spec(), options.optimizer_bytes_per_param_byte, plan);
  for (int s = 0; s + 1 < stages; ++s) {
    const auto& a = plan.stages[s];
    const int last = a.first_device + a.replicas - 1;
    plan.links.push_back(cluster.link(last, last + 1));
  }
  return plan;
}

// Interleaved and ZB-V candidates: keep a plain plan's device groups (its stages' devices)
// and cut the model, along its block order, into v pieces per group, piece k running on
// group k mod G (interleaved) or down the groups and back up (ZB-V: piece k on group k,
// piece 2G - 1 - k on group k, v = 2), with a share of the work proportional to the group's
// speed. Memory per device is checked with the simulated peak (each group holds v pieces'
// weights and their activations in flight, and each backward's working memory while it runs).
void chunked_candidates(ScheduleKind kind, const CostGraph& g, const Cluster& cluster, const Units& u,
                        const CutStates& lin,
                        const Model& model, const Plan& base, std::vector<Plan>& out) {
  const int groups = static_cast<int>(base.stages.size());
  const int m = model.microbatches();
  const int k_blocks = static_cast<int>(lin.sets.size()) - 1;
  const bool v_shape = scheduler::is_v_shape(kind);
  if (groups < (v_shape ? 1 : 2) || (!v_shape && m % groups != 0)) return;
  if (kind == ScheduleKind::kDualPipeV && m < 2 * groups) return;
  double speed_total = 0;
  std::vector<double> group_speed;
  for (const auto& st : base.stages) {
    group_speed.push_back(model.speed(st.first_device, st.replicas));
    speed_total += group_speed.back();
  }
  const double total = lin.fwd[k_blocks] + lin.bwd[k_blocks];
  for (int v : v_shape ? std::vector<int>{2} : std::vector<int>{2, 3, 4}) {
    if (model.options().chunks > 0 && v != model.options().chunks) continue;
    const scheduler::ScheduleSpec spec{kind, groups, m, v};
    const int pieces = v * groups;
    if (pieces > k_blocks) break;
    std::vector<int> cut{0};
    double target = 0;
    bool cuttable = true;
    for (int k = 0; k + 1 < pieces && cuttable; ++k) {
      target += total * group_speed[spec.rank_of_stage(k)] / (v * speed_total);
      const StagePlan& here = base.stages[spec.rank_of_stage(k)];
      const StagePlan& next = base.stages[spec.rank_of_stage(k + 1)];
      // A prefix passing a value that cannot be redistributed is no cut between groups that
      // split a microbatch differently.
      auto refused = [&](int b) {
        return lin.through_fixed[b] &&
               !model.splits_alike(here.first_device, here.replicas, next.first_device, next.replicas);
      };
      const int last = k_blocks - (pieces - k - 1);
      int b = cut.back() + 1;
      while (b < last && (lin.fwd[b] + lin.bwd[b] < target || refused(b))) ++b;
      cuttable = !refused(b);
      cut.push_back(b);
    }
    if (!cuttable) continue;
    cut.push_back(k_blocks);
    Plan p = base;
    p.schedule = kind;
    p.chunks = v;
    p.stages.clear();
    p.links.clear();
    for (int k = 0; k < pieces; ++k) {
      const int gk = spec.rank_of_stage(k);
      const StagePlan& grp = base.stages[gk];
      const StageSums ss = stage_sums(u, lin, cut[k + 1], cut[k]);
      const StageEval e = model.eval(ss, grp.first_device, grp.replicas, pieces - 1 - k, k + 1 < pieces);
      p.stages.push_back(stage_plan(u, lin, cut[k], cut[k + 1], model, cluster, grp.first_device, grp.replicas, e,
                                    k > 0, k + 1 < pieces));
      if (k + 1 < pieces) {
        const StagePlan& next = base.stages[spec.rank_of_stage(k + 1)];
        p.links.push_back(cluster.link(grp.first_device + grp.replicas - 1, next.first_device));
      }
    }
    count_parameters_once(g, spec, model.options().optimizer_bytes_per_param_byte, p);
    auto sim = p.simulate();
    if (!sim) continue;
    bool fits = true;
    for (int gi = 0; gi < groups && fits; ++gi) {
      const StagePlan& grp = base.stages[gi];
      double cap = kInf;
      for (int d = grp.first_device; d < grp.first_device + grp.replicas; ++d) {
        cap = std::min(cap, cluster.devices[d].memory_bytes);
      }
      const double need = sim->peak_bytes[gi];
      fits = need <= cap;
      for (int k : spec.stages_of_rank(gi)) p.stages[k].memory_bytes = need;
    }
    if (fits) out.push_back(std::move(p));
  }
}

// A plain candidate's memory per device as its schedule keeps activations: the search
// priced each stage with the in-flight count of 1F1B (or GPipe), but a split backward keeps
// a microbatch's activations until its W, later than its B. The simulated peak per rank
// (static bytes, the activations alive at once action by action, and each backward's working
// memory and recomputed forward while it runs) replaces it. False when the candidate then
// no longer fits its devices.
bool memory_as_simulated(Plan& p, const scheduler::SimulationResult& sim, const Cluster& cluster) {
  for (std::size_t s = 0; s < p.stages.size(); ++s) {
    StagePlan& st = p.stages[s];
    st.memory_bytes = sim.peak_bytes[s];
    for (int d = st.first_device; d < st.first_device + st.replicas; ++d) {
      if (st.memory_bytes > cluster.devices[d].memory_bytes) return false;
    }
  }
  return true;
}

// The simulator's best plan of the exact search's space, by branch and bound from the
// analytic optimum `base` (search.h, simulated_search), under each wanted schedule of one
// stage per rank that shares base's memory model; added to `out` where it beats base.
void simulator_best(const CostGraph& g, const Cluster& cluster, const PlanOptions& options, const Units& units,
                    const CutStates& states, const StagePairs& pairs, const Model& model, Plan& base,
                    const std::vector<ScheduleKind>& wanted, std::chrono::steady_clock::time_point deadline,
                    std::vector<Plan>& out) {
  std::vector<ScheduleKind> plain;
  for (ScheduleKind k : wanted) {
    if (memory_kind(k) == model.kind() && !scheduler::is_chunked(k)) {
      plain.push_back(k);
    }
  }
  if (plain.empty()) return;
  // A plan's best simulated step over those schedules (infinity: it does not fit).
  auto simulated = [&](const Plan& plan) {
    double best = kInf;
    for (ScheduleKind k : plain) {
      Plan p = plan;
      p.schedule = k;
      auto sim = p.simulate();
      if (sim && memory_as_simulated(p, *sim, cluster)) best = std::min(best, sim->step_time_s);
    }
    return best;
  };
  const bool split = std::find(plain.begin(), plain.end(), ScheduleKind::kZeroBubbleH1) != plain.end();
  const double bound = simulated(base);
  std::function<double(const Solution&)> simulate = [&](const Solution& s) {
    return simulated(build_plan(g, cluster, options, units, states, model, s, model.kind()));
  };
  SimulatedBest found = simulated_search(states, pairs, model, split, bound * (1 - 1e-12), simulate,
                                         options.simulated_budget, deadline);
  const std::string how =
      "; simulated: " + std::to_string(found.tried) + " stages tried" +
      (found.complete      ? ", no plan of this space simulates faster"
       : found.out_of_time ? ", stopped at its share of the planner's time budget (" +
                                 std::to_string(static_cast<int>(options.time_budget_s)) + " s): the best found so far"
                           : ", stopped at the budget of " + std::to_string(options.simulated_budget) +
                                 " stages: the best found so far");
  base.search += how;
  if (found.solution.cuts.empty()) return;
  auto objective = score(units, states, model, found.solution);
  found.solution.objective = objective ? *objective : kInf;
  Plan p = build_plan(g, cluster, options, units, states, model, found.solution, model.kind());
  p.search = base.search;
  for (ScheduleKind k : plain) {
    Plan q = p;
    q.schedule = k;
    out.push_back(std::move(q));
  }
}

}  // namespace

Result<Plan> make_plan(const CostGraph& g, const Cluster& cluster, const PlanOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  CONVEYOR_RETURN_IF_ERROR(g.validate());
  if (options.batch < 1) return Status(ErrorCode::kInvalidArgument, "the batch size must be at least 1");
  if (cluster.devices.empty()) return Status(ErrorCode::kInvalidArgument, "the cluster has no devices");
  if (options.microbatches < 0 || options.microbatches > scheduler::kMostMicrobatches) {
    return Status(ErrorCode::kInvalidArgument, std::to_string(options.microbatches) +
                                                   " microbatches: expected 0 (the planner chooses) to " +
                                                   std::to_string(scheduler::kMostMicrobatches));
  }
  if (options.microbatches > options.batch) {
    return Status(ErrorCode::kInvalidArgument, "the batch (" + std::to_string(options.batch) +
                                                   " samples) is smaller than the microbatch count (" +
                                                   std::to_string(options.microbatches) + "); use at most " +
                                                   std::to_string(options.batch) + " microbatches or a larger batch");
  }
  if (options.batch < g.min_share) {
    return Status(ErrorCode::kInvalidArgument,
                  "the batch (" + std::to_string(options.batch) + " samples) is smaller than the " +
                      std::to_string(g.min_share) + " samples '" + g.name +
                      "' runs at once (its captured batch range); use a batch of at least " +
                      std::to_string(g.min_share));
  }
  if (options.microbatches > 0 && options.batch / options.microbatches < g.min_share) {
    return Status(ErrorCode::kInvalidArgument,
                  std::to_string(options.microbatches) + " microbatches of a batch of " +
                      std::to_string(options.batch) + " leave fewer than the " + std::to_string(g.min_share) +
                      " samples '" + g.name + "' runs at once (its captured batch range); use at most " +
                      std::to_string(options.batch / g.min_share) + " microbatches or a larger batch");
  }
  CONVEYOR_ASSIGN_OR_RETURN(Units units, make_units(g));
  CONVEYOR_RETURN_IF_ERROR(check_fixed_parts(g, cluster, options, static_cast<int>(units.units.size())));

  // Cut states: every downset when there are few enough, block prefixes otherwise.
  CutStates exact_states;
  bool have_downsets = false;
  if (options.search != SearchMode::kBottleneck) {
    std::vector<Bits> sets;
    if (enumerate_downsets(units, options.max_downsets, sets)) {
      exact_states.sets = std::move(sets);
      fill_sums(units, exact_states);
      have_downsets = true;
    }
  }
  CutStates linear = linear_states(units, options.max_blocks);

  std::vector<Plan> candidates;
  std::string search_used;
  StagePairs exact_pairs, linear_pairs;
  bool any_fit = false;
  const int n = static_cast<int>(cluster.devices.size());
  std::vector<ScheduleKind> memory_kinds;
  for (auto k : schedule_candidates(options)) {
    if (std::find(memory_kinds.begin(), memory_kinds.end(), memory_kind(k)) == memory_kinds.end()) {
      memory_kinds.push_back(memory_kind(k));
    }
  }
  const auto wanted = schedule_candidates(options);
  auto want = [&](ScheduleKind k) { return std::find(wanted.begin(), wanted.end(), k) != wanted.end(); };
  const std::vector<int> microbatch_counts = microbatch_candidates(options, g.min_share);
  const int searches = static_cast<int>(microbatch_counts.size() * memory_kinds.size());
  int searched = 0;
  bool any_out_of_time = false;
  const auto time_out = options.time_budget_s > 0
                            ? t0 + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                       std::chrono::duration<double>(options.time_budget_s))
                            : std::chrono::steady_clock::time_point::max();
  auto report = [&] {
    ++searched;
    if (!options.progress) return;
    double best = kInf;
    for (const Plan& p : candidates) best = std::min(best, p.objective_s);
    options.progress(searched, searches, best);
  };
  for (int m : microbatch_counts) {
    for (ScheduleKind mk : memory_kinds) {
      // This search's share of the time left: an equal part of it per search still to run.
      const auto now = std::chrono::steady_clock::now();
      const auto deadline = time_out == std::chrono::steady_clock::time_point::max() || now >= time_out
                                ? time_out
                                : now + (time_out - now) / (searches - searched);
      Model model(cluster, options, m, mk, g);
      bool exact_out_of_time = false;
      const CutStates* states = have_downsets ? &exact_states : &linear;
      // Fixed ranks: only the exact search counts stages (over block prefixes when the
      // convex cut states are too many).
      bool exact = options.search == SearchMode::kExact || options.ranks > 0 ||
                   (options.search == SearchMode::kAuto && exact_work(*states, model) <= options.exact_budget);
      if (have_downsets && options.search != SearchMode::kExact && exact_work(*states, model) > options.exact_budget &&
          (options.ranks > 0 || exact_work(linear, model) <= options.exact_budget)) {
        states = &linear;  // exact over block prefixes
        exact = true;
      }
      if (!exact) states = &linear;
      // The bottleneck search gives a quick incumbent; the exact search proves or improves it.
      Solution sol = options.ranks > 0 ? Solution{} : bottleneck_search(units, linear, model);
      const CutStates* sol_states = &linear;
      StagePairs& pairs = states->linear ? linear_pairs : exact_pairs;
      if (exact) {
        if (pairs.sums.empty()) pairs = stage_pairs(units, *states);
        Solution incumbent = sol;
        if (!states->linear && !incumbent.cuts.empty()) incumbent = translate(incumbent, linear, *states);
        sol = exact_search(*states, pairs, model, incumbent, deadline, &exact_out_of_time);
        any_out_of_time = any_out_of_time || exact_out_of_time;
        sol_states = states;
      }
      states = sol_states;
      if (sol.cuts.empty() || !std::isfinite(sol.objective)) {
        report();
        continue;
      }
      search_used = exact ? (states->linear ? "exact over " + std::to_string(states->sets.size() - 1) + " blocks in order"
                                            : "exact over " + std::to_string(states->sets.size()) + " convex cut states")
                          : "bottleneck bisection over " + std::to_string(states->sets.size() - 1) + " blocks";
      if (exact_out_of_time) {
        search_used += " stopped at its share of the planner's time budget (" +
                       std::to_string(static_cast<int>(options.time_budget_s)) + " s): the bottleneck bisection's plan";
      }
      any_fit = true;
      Plan base = build_plan(g, cluster, options, units, *states, model, sol, mk);
      base.search = search_used;
      if (exact && options.simulated_search && !exact_out_of_time) {
        simulator_best(g, cluster, options, units, *states, pairs, model, base, wanted, deadline, candidates);
      }
      for (ScheduleKind k : wanted) {
        if (memory_kind(k) != mk) continue;
        if (scheduler::is_chunked(k)) continue;
        Plan p = base;
        p.schedule = k;
        candidates.push_back(std::move(p));
      }
      for (ScheduleKind k : {ScheduleKind::kInterleaved, ScheduleKind::kZeroBubbleV, ScheduleKind::kDualPipeV}) {
        if (mk == ScheduleKind::kOneFOneB && want(k)) chunked_candidates(k, g, cluster, units, linear, model, base, candidates);
      }
      report();
    }
  }
  if (candidates.empty() && any_fit) {
    return Status(ErrorCode::kUnsupported,
                  "plans fit, but none can run the requested schedule: the interleaved schedule needs at least two "
                  "device groups, a microbatch count divisible by their number, and memory for two or more model "
                  "pieces per group; ZB-V needs memory for two pieces per group and at least two blocks per group; "
                  "DualPipeV needs that and at least two microbatches per stage; "
                  "allow other schedules (schedule \"auto\") or fix the microbatch count");
  }
  if (candidates.empty() && any_out_of_time) {
    return Status(ErrorCode::kDoesNotFit,
                  "no plan found within the planner's time budget of " +
                      std::to_string(static_cast<int>(options.time_budget_s)) + " s for '" + g.name + "' on " +
                      std::to_string(n) + " devices (" + fixed_parts_text(options) +
                      "); give it more time (--time-budget, or 0 for no limit), or fix fewer parts of the plan");
  }
  if (candidates.empty() && (options.ranks > 0 || !options.replicas.empty())) {
    return Status(ErrorCode::kDoesNotFit,
                  "no plan with " + fixed_parts_text(options) + " fits '" + g.name + "' with batch " +
                      std::to_string(options.batch) + " on " + std::to_string(n) +
                      " devices: a stage needs more memory than its devices have, or a replica's share of a "
                      "microbatch falls below the " + std::to_string(g.min_share) +
                      " samples the model runs at once; fix fewer parts (let the planner choose the stages or the "
                      "replicas), or use devices with more memory or a larger batch");
  }
  if (candidates.empty()) {
    // Find the smallest uniform memory per device for which a plan exists.
    double lo = 0, hi = 0;
    const std::vector<int> counts = microbatch_candidates(options, g.min_share);
    const int m = counts.empty() ? 1 : counts.back();
    for (const auto& unit : units.units) hi += unit.params * (2 + options.optimizer_bytes_per_param_byte) + unit.saved * options.batch + unit.work;
    hi = std::max(hi * 4, 1.0);
    for (int it = 0; it < 60; ++it) {
      const double mid = (lo + hi) / 2;
      Model model(cluster, options, m, ScheduleKind::kOneFOneB, g, mid);
      BottleneckSearch search(units, linear, model);
      if (search.feasible(kInf, nullptr)) hi = mid; else lo = mid;
      if (hi - lo < 1e-3 * hi) break;
    }
    double have = kInf;
    for (const auto& d : cluster.devices) have = std::min(have, d.memory_bytes);
    return Status(ErrorCode::kDoesNotFit,
                  "no plan fits: training '" + g.name + "' with batch " + std::to_string(options.batch) + " on " +
                      std::to_string(n) + " devices needs at least " + human_bytes(hi) +
                      " per device (the smallest device has " + human_bytes(have) +
                      "); use more devices or devices with more memory, a smaller batch, or a lighter optimizer");
  }
  // The simulated step time of the actual schedule decides, among the candidates whose
  // simulated memory fits.
  Plan* best = nullptr;
  int too_big = 0;
  for (auto& p : candidates) {
    auto sim = p.simulate();
    if (!sim) continue;
    if (p.chunks == 1 && !memory_as_simulated(p, *sim, cluster)) {
      ++too_big;
      continue;
    }
    p.predicted_step_s = sim->step_time_s;
    p.bubble_fraction = sim->bubble_fraction;
    if (!best || p.predicted_step_s < best->predicted_step_s - 1e-15) best = &p;
  }
  if (!best && too_big > 0) {
    return Status(ErrorCode::kDoesNotFit,
                  "no plan fits '" + g.name + "' under the requested schedules: a split backward (zb-h1) keeps each "
                  "microbatch's activations until its weight-gradient pass, which needs more memory than the devices "
                  "have; allow other schedules (schedule \"auto\"), recomputation, or devices with more memory");
  }
  if (!best) return Status(ErrorCode::kInternal, "no candidate plan could be simulated");
  Plan out = *best;
  out.search_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

Result<double> candidate_objective(const CostGraph& g, const Cluster& cluster, const PlanOptions& options,
                                   const Candidate& c) {
  CONVEYOR_ASSIGN_OR_RETURN(Plan plan, plan_candidate(g, cluster, options, c));
  return plan.objective_s;
}

Result<Plan> plan_candidate(const CostGraph& g, const Cluster& cluster, const PlanOptions& options,
                            const Candidate& c) {
  if (scheduler::is_chunked(c.schedule)) {
    return Status(ErrorCode::kInvalidArgument,
                  "a candidate is priced as a plain pipeline; interleaved and V-shaped plans come from make_plan");
  }
  CONVEYOR_RETURN_IF_ERROR(g.validate());
  CONVEYOR_ASSIGN_OR_RETURN(Units units, make_units(g));
  if (c.stages.size() != c.replicas.size() || c.stages.empty()) {
    return Status(ErrorCode::kInvalidArgument, "a candidate needs one replica count per stage");
  }
  // Cut states of the candidate: the prefixes of its stages, which must be downsets.
  const int n_units = static_cast<int>(units.units.size());
  CutStates cs;
  Bits b(static_cast<std::size_t>((n_units + 63) / 64), 0);
  cs.sets.push_back(b);
  std::vector<int> stage_of(g.ops.size(), -1);
  for (std::size_t s = 0; s < c.stages.size(); ++s) {
    for (int op : c.stages[s]) {
      if (op < 0 || op >= static_cast<int>(g.ops.size()) || stage_of[op] >= 0) {
        return Status(ErrorCode::kInvalidStage, "operator " + std::to_string(op) + " is missing or listed twice");
      }
      stage_of[op] = static_cast<int>(s);
    }
  }
  for (std::size_t x = 0; x < units.units.size(); ++x) {
    for (int op : units.units[x].ops) {
      if (stage_of[op] < 0) return Status(ErrorCode::kInvalidStage, "operator " + std::to_string(op) + " is in no stage");
      if (stage_of[op] != stage_of[units.units[x].ops[0]]) {
        return Status(ErrorCode::kInvalidStage, "a group is split across stages");
      }
    }
    for (int p : units.preds[x]) {
      if (stage_of[units.units[p].ops[0]] > stage_of[units.units[x].ops[0]]) {
        return Status(ErrorCode::kInvalidStage, "a stage reads from a later stage");
      }
    }
  }
  for (std::size_t s = 0; s < c.stages.size(); ++s) {
    for (int op : c.stages[s]) set(b, units.unit_of_op[op]);
    cs.sets.push_back(b);
  }
  fill_sums(units, cs);
  Model model(cluster, options, c.microbatches, memory_kind(c.schedule), g);
  for (int r : c.replicas) {
    if (r > model.max_replicas()) {
      return Status(ErrorCode::kInvalidArgument,
                    std::to_string(r) + " replicas would split a microbatch of " +
                        std::to_string(options.batch / c.microbatches) + " samples below " +
                        std::to_string(g.min_share) + " samples each");
    }
  }
  Solution sol;
  for (std::size_t s = 0; s < c.stages.size(); ++s) sol.cuts.emplace_back(static_cast<int>(s), static_cast<int>(s) + 1);
  sol.replicas = c.replicas;
  CONVEYOR_ASSIGN_OR_RETURN(sol.objective, score(units, cs, model, sol));
  Plan plan = build_plan(g, cluster, options, units, cs, model, sol, c.schedule);
  plan.search = "given";
  CONVEYOR_ASSIGN_OR_RETURN(auto sim, plan.simulate());
  (void)memory_as_simulated(plan, sim, cluster);  // a given split is priced whether it fits or not
  plan.predicted_step_s = sim.step_time_s;
  plan.bubble_fraction = sim.bubble_fraction;
  return plan;
}

}  // namespace conveyor::partitioner

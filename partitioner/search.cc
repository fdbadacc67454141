#include "partitioner/search.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>
#include <unordered_map>

namespace conveyor::partitioner::detail {

double exact_work(const CutStates& cs, const Model& model) {
  // Every state against every smaller one (for downsets an upper bound on the nested pairs).
  const double c = static_cast<double>(cs.sets.size());
  const int n = model.devices();
  const double replica_choices = model.options().replicas.empty() ? (n + 1) / 2.0 : 1.0;
  return c * (c - 1) / 2 * n * model.stage_states() * replica_choices;
}

StagePairs stage_pairs(const Units& u, const CutStates& cs) {
  StagePairs p;
  const int c_count = static_cast<int>(cs.sets.size());
  for (int outer = c_count - 1; outer > 0; --outer) {
    for (int inner = outer - 1; inner >= 0; --inner) {
      if (!cs.linear && (!subset(cs.sets[inner], cs.sets[outer]) || cs.sets[inner] == cs.sets[outer])) continue;
      p.outer.push_back(outer);
      p.inner.push_back(inner);
      p.sums.push_back(stage_sums(u, cs, outer, inner));
    }
  }
  return p;
}

Solution exact_search(const CutStates& cs, const StagePairs& pairs, const Model& model, const Solution& incumbent,
                      std::chrono::steady_clock::time_point deadline, bool* out_of_time) {
  const int n = model.devices();
  const int c_count = static_cast<int>(cs.sets.size());
  const int j_states = model.stage_states();
  const int ranks = model.options().ranks;
  auto idx = [&](int c, int used, int j) {
    return (static_cast<std::size_t>(c) * (n + 1) + used) * j_states + j;
  };
  const double bound = incumbent.objective;
  std::vector<std::vector<int>> fronts(static_cast<std::size_t>(c_count) * (n + 1) * j_states);
  std::vector<Entry> arena;
  arena.push_back({0, 0, 0, -1, c_count - 1, 0});
  fronts[idx(c_count - 1, 0, 0)].push_back(0);
  // `rest`: a lower bound on the time of the stages still to come (their work spread over
  // every device left), which each of the sum and the slowest stage must still absorb.
  // `by_replicas`: the state passes a value that cannot be redistributed, so the stage
  // before it must split as the one after it: entries of other replica counts are not compared.
  auto insert = [&](std::vector<int>& front, const Entry& e, double rest, bool by_replicas) {
    if (model.objective(e.sum + rest, std::max(e.max_stage, rest), e.max_ar) >= bound) return;
    for (int k : front) {
      const Entry& o = arena[k];
      if (by_replicas && o.r != e.r) continue;
      if (o.sum <= e.sum && o.max_stage <= e.max_stage && o.max_ar <= e.max_ar) return;
    }
    std::erase_if(front, [&](int k) {
      const Entry& o = arena[k];
      return (!by_replicas || o.r == e.r) && e.sum <= o.sum && e.max_stage <= o.max_stage && e.max_ar <= o.max_ar;
    });
    front.push_back(static_cast<int>(arena.size()));
    arena.push_back(e);
  };
  // Pairs come grouped by outer state, descending: every state is complete before it is left.
  for (std::size_t p = 0; p < pairs.sums.size(); ++p) {
    const int outer = pairs.outer[p], inner = pairs.inner[p];
    const StageSums& ss = pairs.sums[p];
    for (int used = 0; used < n; ++used) {
      if (std::chrono::steady_clock::now() > deadline) {
        if (out_of_time != nullptr) *out_of_time = true;
        return incumbent;
      }
      for (int j = 0; j < j_states; ++j) {
        const auto& front = fronts[idx(outer, used, j)];
        if (front.empty() || !model.may_add_stage(j)) continue;
        const int jn = std::min(j + 1, j_states - 1);
        // Fixed ranks: the stage that completes the count must be the first, and only it.
        if (ranks > 0 && (jn == ranks) != (inner == 0)) continue;
        const auto [r_lo, r_hi] = model.replica_range(j, n - used);
        for (int r = r_lo; r <= r_hi; ++r) {
          const int left = n - used - r;  // devices for the stages before this one
          const double rest_work = (cs.fwd[inner] + cs.bwd[inner]) * model.work_scale();
          if (rest_work > 0 && left == 0) continue;
          const double rest = rest_work > 0 ? rest_work / model.speed(0, left) : 0;
          const StageEval e = model.eval(ss, left, r, j, used > 0);
          if (!e.fits()) continue;
          auto& target = fronts[idx(inner, used + r, jn)];
          for (std::size_t k = 0; k < front.size(); ++k) {
            const Entry prev = arena[front[k]];
            if (cs.through_fixed[outer] && !model.splits_alike(left, r, n - used, prev.r)) continue;
            insert(target,
                   {prev.sum + e.compute + e.comm, std::max({prev.max_stage, e.compute, e.comm}),
                    std::max(prev.max_ar, e.tail()), front[k], inner, r},
                   rest, cs.through_fixed[inner]);
          }
        }
      }
    }
  }
  Solution best;
  int best_entry = -1;
  for (int used = 1; used <= n; ++used) {
    for (int j = ranks > 0 ? ranks : 0; j < j_states; ++j) {
      for (int k : fronts[idx(0, used, j)]) {
        const Entry& e = arena[k];
        double obj = model.objective(e.sum, e.max_stage, e.max_ar);
        if (obj < best.objective) {
          best.objective = obj;
          best_entry = k;
        }
      }
    }
  }
  if (best_entry < 0) return incumbent;
  for (int k = best_entry; k >= 0 && arena[k].prev >= 0; k = arena[k].prev) {
    best.cuts.emplace_back(arena[k].cut, arena[arena[k].prev].cut);
    best.replicas.push_back(arena[k].r);
  }
  return best;
}

Solution bottleneck_search(const Units& u, const CutStates& cs, const Model& model) {
  Solution overall;
  for (double ar_factor : {kInf, 4.0 * model.microbatches(), 1.0 * model.microbatches(), 0.25 * model.microbatches()}) {
    BottleneckSearch search(u, cs, model);
    search.limit_tail(ar_factor);
    Solution sol;
    if (!search.feasible(kInf, &sol)) continue;
    std::vector<StageEval> evals;
    if (!score(u, cs, model, sol, &evals)) continue;
    double hi = 0;
    for (const auto& e : evals) hi = std::max({hi, e.compute, e.comm});
    if (std::isfinite(ar_factor)) {  // with a limit, start where it holds
      double worst_ar = 0;
      for (const auto& e : evals) worst_ar = std::max(worst_ar, e.tail());
      hi = std::max(hi, worst_ar / ar_factor);
      if (!search.feasible(hi, &sol)) continue;
    }
    double lo = 0;
    Solution best = sol;
    for (int it = 0; it < 40 && hi - lo > 2e-3 * hi; ++it) {
      double mid = (lo + hi) / 2;
      Solution trial;
      if (search.feasible(mid, &trial)) {
        hi = mid;
        best = std::move(trial);
      } else {
        lo = mid;
      }
    }
    auto obj = score(u, cs, model, best);
    best.objective = obj ? *obj : kInf;
    if (best.objective < overall.objective) overall = std::move(best);
  }
  return overall;
}

namespace {

// One stage of a partial plan (stages are added from the last one back to the first).
struct Fixed {
  int inner, outer, r;
  double compute;  // F + B per microbatch, as the simulator runs it
  double forward;  // F
  double comm;     // the activation across the cut after it and its gradient back, at least
};

class BranchAndBound {
 public:
  BranchAndBound(const CutStates& cs, const StagePairs& pairs, const Model& model, bool split, double bound,
                 const std::function<double(const Solution&)>& simulate, long long budget,
                 std::chrono::steady_clock::time_point deadline)
      : cs_(cs), pairs_(pairs), model_(model), split_(split), simulate_(simulate), budget_(budget), deadline_(deadline) {
    best_.step_s = bound;
    by_outer_.resize(cs.sets.size());
    for (std::size_t p = 0; p < pairs.sums.size(); ++p) by_outer_[pairs.outer[p]].push_back(static_cast<int>(p));
  }

  SimulatedBest run() {
    const int full = static_cast<int>(cs_.sets.size()) - 1;
    extend(full, 0, 0);
    return best_;
  }

 private:
  // The simulated step of any completion of `stack` is at least this; `rest` and
  // `rest_forward` bound the stages still to come (their work over every device left).
  double lower_bound(double rest, double rest_forward) const {
    double path = split_ ? rest_forward : rest;  // the first microbatch's way to each stage
    double lb = path;
    for (int k = static_cast<int>(stack_.size()) - 1; k >= 0; --k) {
      const Fixed& f = stack_[k];
      lb = std::max(lb, path + model_.microbatches() * f.compute);
      path += split_ ? f.forward + f.comm / 2 : f.compute + f.comm;
    }
    return std::max(lb, path);
  }

  void extend(int outer, int used, int j) {
    if (outer == 0) return complete();
    const int n = model_.devices();
    const int j_states = model_.stage_states();
    const int ranks = model_.options().ranks;
    if (!model_.may_add_stage(j)) return;
    const int jn = std::min(j + 1, j_states - 1);
    struct Child {
      double lb;
      Fixed f;
    };
    std::vector<Child> children;
    for (int p : by_outer_[outer]) {
      const int inner = pairs_.inner[p];
      if (ranks > 0 && (jn == ranks) != (inner == 0)) continue;
      const StageSums& ss = pairs_.sums[p];
      const auto [r_lo, r_hi] = model_.replica_range(j, n - used);
      for (int r = r_lo; r <= r_hi; ++r) {
        if (++best_.tried > budget_) {
          best_.complete = false;
          return;
        }
        if (std::chrono::steady_clock::now() > deadline_) {
          best_.complete = false;
          best_.out_of_time = true;
          return;
        }
        const int left = n - used - r;
        const double rest_work = (cs_.fwd[inner] + cs_.bwd[inner]) * model_.work_scale();
        if (rest_work > 0 && left == 0) continue;
        const double speed_left = left > 0 ? model_.total_speed(0, left) : 1;
        if (cs_.through_fixed[outer] && !stack_.empty() && !model_.splits_alike(left, r, n - used, stack_.back().r)) {
          continue;  // a value that cannot be redistributed passes to the stage after
        }
        const StageEval e = model_.eval(ss, left, r, j, used > 0);
        if (!e.fits()) continue;
        const double forward = ss.fwd * e.time_per_work + model_.options().action_overhead_s;
        const Fixed f{inner, outer, r, e.compute, forward, e.comm};
        stack_.push_back(f);
        const double lb = lower_bound(rest_work / speed_left, cs_.fwd[inner] * model_.work_scale() / speed_left);
        stack_.pop_back();
        if (lb < best_.step_s) children.push_back({lb, f});
      }
    }
    std::stable_sort(children.begin(), children.end(), [](const Child& a, const Child& b) { return a.lb < b.lb; });
    for (const Child& c : children) {
      if (c.lb >= best_.step_s || !best_.complete) break;  // the bound fell meanwhile, or the budget ran out
      stack_.push_back(c.f);
      extend(c.f.inner, used + c.f.r, jn);
      stack_.pop_back();
    }
  }

  void complete() {
    Solution sol;
    for (int k = static_cast<int>(stack_.size()) - 1; k >= 0; --k) {  // pipeline order
      sol.cuts.emplace_back(stack_[k].inner, stack_[k].outer);
      sol.replicas.push_back(stack_[k].r);
    }
    const double t = simulate_(sol);
    if (t < best_.step_s) {
      best_.step_s = t;
      best_.solution = std::move(sol);
    }
  }

  const CutStates& cs_;
  const StagePairs& pairs_;
  const Model& model_;
  const bool split_;
  const std::function<double(const Solution&)>& simulate_;
  const long long budget_;
  const std::chrono::steady_clock::time_point deadline_;
  std::vector<std::vector<int>> by_outer_;
  std::vector<Fixed> stack_;
  SimulatedBest best_;
};

}  // namespace

SimulatedBest simulated_search(const CutStates& cs, const StagePairs& pairs, const Model& model, bool split,
                               double bound, const std::function<double(const Solution&)>& simulate,
                               long long budget, std::chrono::steady_clock::time_point deadline) {
  return BranchAndBound(cs, pairs, model, split, bound, simulate, budget, deadline).run();
}

Solution translate(const Solution& sol, const CutStates& from, const CutStates& to) {
  std::unordered_map<Bits, int, BitsHash> index;
  for (std::size_t k = 0; k < to.sets.size(); ++k) index.emplace(to.sets[k], static_cast<int>(k));
  Solution out = sol;
  for (auto& [inner, outer] : out.cuts) {
    inner = index.at(from.sets[inner]);
    outer = index.at(from.sets[outer]);
  }
  return out;
}

}  // namespace conveyor::partitioner::detail

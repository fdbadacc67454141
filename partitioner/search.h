// The planner's two searches over cut states: an exact Pareto DP, and a bisection on the
// slowest stage for large problems (docs/planner.md).
// Internal to the planner (partitioner/planner.cc and its searches): namespace detail.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <vector>

#include "partitioner/stage_model.h"

namespace conveyor::partitioner::detail {

/// The objective sum + (m-1) max + max-tail is monotone in each of (sum, max stage, max tail:
/// a stage's gradient sum and optimizer step), so keeping every non-dominated triple per
/// state is exact.

/// A non-dominated (sum, slowest stage, largest tail) of the exact search, with its parent.
struct Entry {
  double sum, max_stage, max_ar;
  int prev;   // entry of the state before this stage was added (-1: start)
  int cut;    // this state's cut (the stage added is cut(prev) \ cut)
  int r;
};

/// The transitions the exact search takes over `cs`, at most.
double exact_work(const CutStates& cs, const Model& model);

/// The stages the exact search may form: every pair of nested cut states, with its sums.
struct StagePairs {
  std::vector<int> outer, inner;
  std::vector<StageSums> sums;
};

StagePairs stage_pairs(const Units& u, const CutStates& cs);

/// `incumbent`: a known solution (from the bottleneck search); partial plans whose objective
/// already reaches it are dropped, since every term only grows as stages are added. Past
/// `deadline` the search gives up and returns the incumbent, setting `*out_of_time`.
Solution exact_search(const CutStates& cs, const StagePairs& pairs, const Model& model, const Solution& incumbent,
                      std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max(),
                      bool* out_of_time = nullptr);

/// DP over block prefixes finds the fewest devices that keep every stage under T and in
/// memory, each stage taking the fewest replicas that do.

/// The fewest devices that keep every stage under a time T, over block prefixes.
class BottleneckSearch {
 public:
  BottleneckSearch(const Units& u, const CutStates& cs, const Model& model) : u_(u), cs_(cs), model_(model) {
    k_ = static_cast<int>(cs.sets.size()) - 1;
    j_states_ = model.kind() == ScheduleKind::kGPipe ? 1 : std::max(1, std::min({model.microbatches(), 8, model.devices()}));
  }

  // In-flight count with the stage count capped: beyond the cap, assume the most (safe).
  int capped_after(int j) const { return j == j_states_ - 1 && j_states_ > 1 ? model_.microbatches() : j; }

  bool feasible(double t, Solution* out) {
    const int n = model_.devices();
    const std::size_t states = static_cast<std::size_t>(k_ + 1) * j_states_;
    used_.assign(states, n + 1);
    parent_.assign(states, {-1, -1, 0});
    auto at = [&](int c, int j) { return static_cast<std::size_t>(c) * j_states_ + j; };
    used_[at(k_, 0)] = 0;
    for (int outer = k_; outer > 0; --outer) {
      for (int j = 0; j < j_states_; ++j) {
        const int used = used_[at(outer, j)];
        if (used > n - 1) continue;
        const int jn = std::min(j + 1, j_states_ - 1);
        for (int inner = outer - 1; inner >= 0; --inner) {
          const StageSums ss = stage_sums(u_, cs_, outer, inner);
          int r = fewest_replicas(ss, used, capped_after(j), t);
          if (r < 0) break;  // larger stages only need more
          if (outer != k_ && cs_.through_fixed[outer]) {
            // A value that cannot be redistributed passes to the stage after (the best one
            // found for this state): this stage takes its replica count, if that meets T.
            const int after = parent_[at(outer, j)].r, first_after = n - used;
            if (!model_.splits_alike(first_after - r, r, first_after, after)) {
              if (after < r || after > std::min(first_after, model_.max_replicas()) ||
                  !meets(ss, used, capped_after(j), t, after) ||
                  !model_.splits_alike(first_after - after, after, first_after, after)) {
                continue;
              }
              r = after;
            }
          }
          if (used + r < used_[at(inner, jn)]) {
            used_[at(inner, jn)] = used + r;
            parent_[at(inner, jn)] = {outer, j, r};
          }
        }
      }
    }
    int best_j = -1;
    for (int j = 0; j < j_states_; ++j) {
      if (used_[at(0, j)] <= n && (best_j < 0 || used_[at(0, j)] < used_[at(0, best_j)])) best_j = j;
    }
    if (best_j < 0) return false;
    if (out) {
      out->cuts.clear();
      out->replicas.clear();
      int c = 0, j = best_j;
      while (c != k_) {
        auto [outer, pj, r] = parent_[at(c, j)];
        out->cuts.emplace_back(c, outer);
        out->replicas.push_back(r);
        c = outer;
        j = pj;
      }
    }
    return true;
  }

 private:
  // Whether `r` replicas on the devices ending before `n - used` meet T and memory.
  bool meets(const StageSums& ss, int used, int stages_after, double t, int r) const {
    const StageEval e = model_.eval(ss, model_.devices() - used - r, r, stages_after, used > 0);
    return e.compute <= t && e.comm <= t && e.tail() <= ar_limit_ * t && e.fits();
  }

  // The fewest replicas on devices ending before `n - used` meeting T and memory; -1 if none.
  int fewest_replicas(const StageSums& ss, int used, int stages_after, double t) const {
    const int n = model_.devices();
    const int last = n - used;  // devices [last - r, last)
    const int max_r = std::min(last, model_.max_replicas());
    if (max_r < 1) return -1;
    auto ok = [&](int r) { return meets(ss, used, stages_after, t, r); };
    if (model_.options().replicas.size() == 1) {  // every stage's count is fixed
      const int r = model_.options().replicas[0];
      return r <= max_r && ok(r) ? r : -1;
    }
    const double work = (ss.fwd + ss.bwd) * model_.work_scale();  // a bound: compute >= work / speed
    // The fewest replicas whose speed meets `work / t` (speed grows with r).
    int lo = 1;
    if (std::isfinite(t)) {
      if (model_.speed(last - max_r, max_r) * t < work) return -1;
      int hi = max_r;
      while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (model_.speed(last - mid, mid) * t >= work) hi = mid; else lo = mid + 1;
      }
    }
    if (ok(lo)) return lo;
    // More replicas shrink each one's activations and transfers: the fewest that fit, by
    // bisection (exact when memory per device is uniform), then checked.
    int hi = max_r;
    if (!ok(hi)) {
      // Not monotone (mixed memory sizes, or allreduce growing with r): scan a little.
      for (int r = lo + 1; r <= std::min(max_r, lo + 256); ++r) {
        if (ok(r)) return r;
      }
      return -1;
    }
    int a = lo;  // !ok(a), ok(hi)
    while (hi - a > 1) {
      int mid = (a + hi) / 2;
      if (ok(mid)) hi = mid; else a = mid;
    }
    return hi;
  }

 public:
  /// Each stage's tail (its gradient sum and optimizer step) must stay under `factor` times T
  /// (infinity: no limit).
  void limit_tail(double factor) { ar_limit_ = factor; }

 private:
  double ar_limit_ = kInf;
  struct Parent {
    int outer, j, r;
  };
  const Units& u_;
  const CutStates& cs_;
  const Model& model_;
  int k_ = 0, j_states_ = 1;
  std::vector<int> used_;
  std::vector<Parent> parent_;
};

/// Bisection on T for a given limit on the tails (a multiple of T); the plan with the smallest
/// objective over a few limits wins, since the tail is not part of T.
Solution bottleneck_search(const Units& u, const CutStates& cs, const Model& model);

/// The simulator's judgement over the exact search's space (docs/planner.md, "A search
/// true to the simulator"). The analytic objective and the simulated schedule disagree where
/// transfers are large, so this enumerates plans by branch and bound on a lower bound of
/// the simulated step that holds for every schedule of one stage per rank: a rank cannot
/// start before the first microbatch's forward reached it, does all its microbatches' work
/// in sequence, and (with a whole backward) its last gradient must still travel back to the
/// first stage. `simulate` scores a complete solution (infinity: it does not fit);
/// partial plans whose bound reaches `bound` (the best simulated so far) are dropped.
/// `split`: some schedule splits the backward (ZB-H1), so the bound leaves the way back
/// out. Returns the best solution found below `bound` (none: empty cuts); `budget` caps the
/// stages tried, and `complete` says whether the enumeration finished within it.
struct SimulatedBest {
  Solution solution;
  double step_s = kInf;
  long long tried = 0;
  bool complete = true;
  bool out_of_time = false;  ///< stopped at `deadline` (else, when incomplete, at `budget`)
};
SimulatedBest simulated_search(const CutStates& cs, const StagePairs& pairs, const Model& model, bool split,
                               double bound, const std::function<double(const Solution&)>& simulate,
                               long long budget, std::chrono::steady_clock::time_point deadline);

/// The same solution with its cut states looked up in another state list (block prefixes
/// are downsets, so they appear among all downsets).
Solution translate(const Solution& sol, const CutStates& from, const CutStates& to);

}  // namespace conveyor::partitioner::detail

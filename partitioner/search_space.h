// The planner's search space: operators contracted into units (a group is never split),
// and the cut states between stages: downsets of units, or prefixes of blocks of them when
// there are too many (docs/planner.md).
// Internal to the planner (partitioner/planner.cc and its searches): namespace detail.
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

#include "common/status.h"
#include "partitioner/cost_graph.h"
#include "partitioner/planner.h"

namespace conveyor::partitioner::detail {

using scheduler::ScheduleKind;
inline constexpr double kInf = std::numeric_limits<double>::infinity();

/// Units: operators of one group contracted into one node; the planner never splits a unit.

/// Operators the planner never splits, with their summed costs.
struct Unit {
  std::vector<int> ops;
  double fwd = 0, bwd = 0, bwd_w = 0, saved = 0, work = 0, params = 0;
  // Selective recomputation: forward again; freed, less what it keeps beyond saved (below 0
  // where it keeps more than it frees); transient.
  double sel_fwd = 0, sel_freed = 0, sel_work = 0;
  double saved_w = 0;  // saved by operators that read parameters, and the gradients of their outputs: kept to W
  double grads_w = 0;  // of saved_w, those gradients: a split backward's Bi makes them while still holding all
};

/// A value between units: its producer, its bytes, its readers.
struct Edge {
  int from = 0;
  double bytes = 0;
  std::vector<int> to;  // reading units other than `from`
  int saved_by = -1;    // the unit whose saved bytes hold it, -1: none
  bool redistributable = true;  // CostValue::redistributable
};

/// A cost graph contracted into units, in a topological order.
struct Units {
  std::vector<Unit> units;       // in a topological order
  std::vector<int> unit_of_op;
  std::vector<Edge> edges;
  std::vector<std::vector<int>> preds;
};

Result<Units> make_units(const CostGraph& g);

/// Cut states: sets of units closed under predecessors (downsets). The difference of two
/// nested downsets is a convex stage, and every partition whose stages only read from earlier
/// stages is a chain of nested downsets. When there are too many, the units are grouped into
/// blocks along their topological order and the cut states are the block prefixes.

using Bits = std::vector<std::uint64_t>;

/// Hashes a unit set.
struct BitsHash {
  std::size_t operator()(const Bits& b) const {
    std::uint64_t h = 1469598103934665603ull;
    for (auto w : b) h = (h ^ w) * 1099511628211ull;
    return static_cast<std::size_t>(h);
  }
};

inline bool test(const Bits& b, int i) { return (b[i >> 6] >> (i & 63)) & 1u; }
inline void set(Bits& b, int i) { b[i >> 6] |= std::uint64_t{1} << (i & 63); }
inline bool subset(const Bits& a, const Bits& b) {  // a ⊆ b
  for (std::size_t w = 0; w < a.size(); ++w) {
    if (a[w] & ~b[w]) return false;
  }
  return true;
}

/// Min or max over device ranges in O(1) (a sparse table).
struct RangeTable {  // min or max over device ranges in O(1)
  std::vector<std::vector<double>> t;
  bool is_min = true;
  void build(const std::vector<double>& v, bool min) {
    is_min = min;
    t.assign(1, v);
    for (std::size_t len = 2; len <= v.size(); len *= 2) {
      const auto& prev = t.back();
      std::vector<double> next(v.size() - len + 1);
      for (std::size_t i = 0; i < next.size(); ++i) {
        next[i] = min ? std::min(prev[i], prev[i + len / 2]) : std::max(prev[i], prev[i + len / 2]);
      }
      t.push_back(std::move(next));
    }
  }
  double query(int first, int count) const {
    int level = 31 - __builtin_clz(static_cast<unsigned>(count));
    double a = t[level][first], b = t[level][first + count - (1 << level)];
    return is_min ? std::min(a, b) : std::max(a, b);
  }
};

/// The cut states a search moves between, with the sums over each.
struct CutStates {
  bool linear = false;
  std::vector<Bits> sets;               // ascending by size; [0] empty, back() everything
  std::vector<std::vector<int>> blocks;  // linear: the units of each block
  RangeTable block_work;  // linear: max working memory over block ranges
  // Linear: over block ranges, the most of a unit's selective transient plus what a
  // microbatch recomputing selectively keeps from the first unit to it.
  RangeTable block_sel_live;
  // Sums over the units of each state:
  std::vector<double> fwd, bwd, bwd_w, saved, params, out_bytes, sel_fwd, sel_freed, saved_w, grads_w;
  /// Per state: it passes a value that cannot be redistributed, so the stages on either side
  /// of it must split a microbatch alike (Model::splits_alike).
  std::vector<bool> through_fixed;
};

/// Enumerates all downsets; false when there are more than `limit`.
bool enumerate_downsets(const Units& u, int limit, std::vector<Bits>& out);

void fill_sums(const Units& u, CutStates& cs);

CutStates linear_states(const Units& u, int max_blocks);

}  // namespace conveyor::partitioner::detail

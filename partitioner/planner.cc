#include "partitioner/planner.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <queue>
#include <unordered_map>

namespace conveyor::partitioner {
namespace {

using scheduler::ScheduleKind;
constexpr double kInf = std::numeric_limits<double>::infinity();

// ---------------------------------------------------------------------------------------
// Units: operators of one group contracted into one node; the planner never splits a unit.

struct Unit {
  std::vector<int> ops;
  double fwd = 0, bwd = 0, bwd_w = 0, saved = 0, work = 0, params = 0;
};

struct Edge {
  int from = 0;
  double bytes = 0;
  std::vector<int> to;  // reading units other than `from`
};

struct Units {
  std::vector<Unit> units;       // in a topological order
  std::vector<int> unit_of_op;
  std::vector<Edge> edges;
  std::vector<std::vector<int>> preds;
};

Result<Units> make_units(const CostGraph& g) {
  const int n = static_cast<int>(g.ops.size());
  // Union the operators of each group.
  std::vector<int> root(n);
  std::iota(root.begin(), root.end(), 0);
  std::unordered_map<int, int> first_of_group;
  for (int i = 0; i < n; ++i) {
    if (g.ops[i].group < 0) continue;
    auto [it, fresh] = first_of_group.emplace(g.ops[i].group, i);
    if (!fresh) root[i] = it->second;
  }
  // Units in an order consistent with the operators' (Kahn's algorithm, lowest operator first).
  std::vector<int> rep_index(n, -1);
  int count = 0;
  for (int i = 0; i < n; ++i) {
    if (root[i] == i) rep_index[i] = count++;
  }
  std::vector<int> proto(n);
  for (int i = 0; i < n; ++i) proto[i] = rep_index[root[i]];
  std::vector<std::vector<int>> succ(count);
  std::vector<int> indeg(count, 0);
  const auto readers = g.readers();
  for (std::size_t v = 0; v < g.values.size(); ++v) {
    if (g.values[v].producer < 0) continue;
    const int a = proto[g.values[v].producer];
    for (int r : readers[v]) {
      const int b = proto[r];
      if (a != b) succ[a].push_back(b);
    }
  }
  for (auto& s : succ) {
    std::sort(s.begin(), s.end());
    s.erase(std::unique(s.begin(), s.end()), s.end());
    for (int b : s) ++indeg[b];
  }
  std::priority_queue<int, std::vector<int>, std::greater<>> ready;  // proto ids follow first operator order
  for (int u = 0; u < count; ++u) {
    if (indeg[u] == 0) ready.push(u);
  }
  std::vector<int> order_of(count, -1);
  int placed = 0;
  while (!ready.empty()) {
    int u = ready.top();
    ready.pop();
    order_of[u] = placed++;
    for (int b : succ[u]) {
      if (--indeg[b] == 0) ready.push(b);
    }
  }
  if (placed != count) {
    for (int i = 0; i < n; ++i) {
      if (order_of[proto[i]] < 0 && g.ops[i].group >= 0) {
        return Status(ErrorCode::kInvalidGraph,
                      "operator group " + std::to_string(g.ops[i].group) +
                          " is not convex: a path leaves the group and comes back (operator " + std::to_string(i) +
                          (g.ops[i].name.empty() ? "" : " '" + g.ops[i].name + "'") +
                          "); a group must hold every operator on paths between its members");
      }
    }
    return Status(ErrorCode::kInvalidGraph, "the operator groups form a cycle");
  }
  Units out;
  out.units.resize(count);
  out.unit_of_op.resize(n);
  std::vector<std::vector<int>> params_of(count);
  for (int i = 0; i < n; ++i) {
    const int u = order_of[proto[i]];
    out.unit_of_op[i] = u;
    Unit& unit = out.units[u];
    const CostOp& op = g.ops[i];
    unit.ops.push_back(i);
    unit.fwd += op.forward_s;
    unit.bwd += op.backward_s;
    unit.bwd_w += op.backward_weight_s;
    unit.saved += op.saved_bytes;
    unit.work = std::max(unit.work, op.work_bytes);
    for (int p : op.params) params_of[u].push_back(p);
  }
  for (int u = 0; u < count; ++u) {
    auto& ps = params_of[u];
    std::sort(ps.begin(), ps.end());
    ps.erase(std::unique(ps.begin(), ps.end()), ps.end());
    for (int p : ps) out.units[u].params += g.params[p].bytes;
  }
  out.preds.resize(count);
  for (std::size_t v = 0; v < g.values.size(); ++v) {
    if (g.values[v].producer < 0) continue;
    Edge e;
    e.from = out.unit_of_op[g.values[v].producer];
    e.bytes = g.values[v].bytes;
    for (int r : readers[v]) {
      int b = out.unit_of_op[r];
      if (b != e.from && std::find(e.to.begin(), e.to.end(), b) == e.to.end()) e.to.push_back(b);
    }
    for (int b : e.to) out.preds[b].push_back(e.from);
    if (!e.to.empty()) out.edges.push_back(std::move(e));
  }
  for (auto& p : out.preds) {
    std::sort(p.begin(), p.end());
    p.erase(std::unique(p.begin(), p.end()), p.end());
  }
  return out;
}

// ---------------------------------------------------------------------------------------
// Cut states: sets of units closed under predecessors (downsets). The difference of two
// nested downsets is a convex stage, and every partition whose stages only read from earlier
// stages is a chain of nested downsets. When there are too many, the units are grouped into
// blocks along their topological order and the cut states are the block prefixes.

using Bits = std::vector<std::uint64_t>;

struct BitsHash {
  std::size_t operator()(const Bits& b) const {
    std::uint64_t h = 1469598103934665603ull;
    for (auto w : b) h = (h ^ w) * 1099511628211ull;
    return static_cast<std::size_t>(h);
  }
};

bool test(const Bits& b, int i) { return (b[i >> 6] >> (i & 63)) & 1u; }
void set(Bits& b, int i) { b[i >> 6] |= std::uint64_t{1} << (i & 63); }
bool subset(const Bits& a, const Bits& b) {  // a ⊆ b
  for (std::size_t w = 0; w < a.size(); ++w) {
    if (a[w] & ~b[w]) return false;
  }
  return true;
}

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

struct CutStates {
  bool linear = false;
  std::vector<Bits> sets;               // ascending by size; [0] empty, back() everything
  std::vector<std::vector<int>> blocks;  // linear: the units of each block
  RangeTable block_work;                 // linear: max working memory over block ranges
  // Sums over the units of each state:
  std::vector<double> fwd, bwd, bwd_w, saved, params, out_bytes;
};

// Enumerates all downsets; false when there are more than `limit`.
bool enumerate_downsets(const Units& u, int limit, std::vector<Bits>& out) {
  const int n = static_cast<int>(u.units.size());
  const std::size_t words = static_cast<std::size_t>((n + 63) / 64);
  std::unordered_map<Bits, int, BitsHash> seen;
  std::vector<Bits> queue{Bits(words, 0)};
  seen.emplace(queue[0], 0);
  for (std::size_t head = 0; head < queue.size(); ++head) {
    for (int x = 0; x < n; ++x) {
      if (test(queue[head], x)) continue;
      bool ok = true;
      for (int p : u.preds[x]) ok &= test(queue[head], p);
      if (!ok) continue;
      Bits next = queue[head];
      set(next, x);
      if (seen.emplace(next, 0).second) {
        if (static_cast<int>(queue.size()) >= limit) return false;
        queue.push_back(std::move(next));
      }
    }
  }
  out = std::move(queue);  // BFS adds one unit per level: ascending by size
  return true;
}

void fill_sums(const Units& u, CutStates& cs) {
  const std::size_t c = cs.sets.size();
  cs.fwd.assign(c, 0);
  cs.bwd.assign(c, 0);
  cs.bwd_w.assign(c, 0);
  cs.saved.assign(c, 0);
  cs.params.assign(c, 0);
  cs.out_bytes.assign(c, 0);
  for (std::size_t k = 0; k < c; ++k) {
    const Bits& b = cs.sets[k];
    for (std::size_t x = 0; x < u.units.size(); ++x) {
      if (!test(b, static_cast<int>(x))) continue;
      const Unit& unit = u.units[x];
      cs.fwd[k] += unit.fwd;
      cs.bwd[k] += unit.bwd;
      cs.bwd_w[k] += unit.bwd_w;
      cs.saved[k] += unit.saved;
      cs.params[k] += unit.params;
    }
    for (const Edge& e : u.edges) {
      if (!test(b, e.from)) continue;
      for (int t : e.to) {
        if (!test(b, t)) {
          cs.out_bytes[k] += e.bytes;
          break;
        }
      }
    }
  }
}

CutStates linear_states(const Units& u, int max_blocks) {
  CutStates cs;
  cs.linear = true;
  const int n = static_cast<int>(u.units.size());
  double total = 0;
  for (const auto& unit : u.units) total += unit.fwd + unit.bwd;
  const int k = std::max(1, std::min(n, max_blocks));
  // Greedy: close a block once it reaches its share of the remaining cost, or when the
  // remaining units are just enough for the remaining blocks.
  double remaining = total;
  std::vector<int> current;
  double acc = 0;
  for (int x = 0; x < n; ++x) {
    current.push_back(x);
    acc += u.units[x].fwd + u.units[x].bwd;
    const int blocks_left = k - static_cast<int>(cs.blocks.size());
    const int units_left = n - x - 1;
    const double target = remaining / blocks_left;
    if (blocks_left > 1 && (acc >= target || units_left < blocks_left)) {
      if (units_left >= blocks_left - 1) {
        cs.blocks.push_back(current);
        current.clear();
        remaining -= acc;
        acc = 0;
      }
    }
  }
  if (!current.empty()) cs.blocks.push_back(current);
  const std::size_t words = static_cast<std::size_t>((n + 63) / 64);
  Bits b(words, 0);
  cs.sets.push_back(b);
  for (const auto& block : cs.blocks) {
    for (int x : block) set(b, x);
    cs.sets.push_back(b);
  }
  fill_sums(u, cs);
  std::vector<double> work;
  for (const auto& block : cs.blocks) {
    double w = 0;
    for (int x : block) w = std::max(w, u.units[x].work);
    work.push_back(w);
  }
  cs.block_work.build(work, false);
  return cs;
}

// ---------------------------------------------------------------------------------------
// The cost model of one stage (docs/planner.md).

struct StageSums {
  double fwd = 0, bwd = 0, bwd_w = 0, saved = 0, params = 0, work = 0;
  double in_bytes = 0, out_bytes = 0;  // cut bytes before and after the stage, at profile size
};

struct StageEval {
  double compute = 0;    // (F + B) per microbatch
  double comm = 0;       // activation and gradient across the cut after the stage
  double allreduce = 0;
  double need = 0;       // bytes per device: static + activations in flight + transient
  double static_bytes = 0;     // per device: weights, gradients, optimizer state
  double transient_bytes = 0;  // per device: working memory and transfer buffers
  double capacity = 0;   // the smallest memory among the stage's devices
  double speed = 0;
  double max_share = 1;
  int in_flight = 0;
  bool fits() const { return need <= capacity; }
};

class Model {
 public:
  Model(const Cluster& cluster, const PlanOptions& options, int microbatches, ScheduleKind kind, double profile_mb,
        int min_share = 1, double memory_override = 0)
      : cluster_(cluster), options_(options), m_(microbatches), kind_(kind), memory_override_(memory_override) {
    n_ = static_cast<int>(cluster.devices.size());
    // Replicas split a microbatch evenly: each must keep at least `min_share` samples.
    max_replicas_ = std::max(1, (options.batch / microbatches) / std::max(1, min_share));
    if (options.max_replicas > 0) max_replicas_ = std::min(max_replicas_, options.max_replicas);
    scale_ = (static_cast<double>(options.batch) / microbatches) / profile_mb;
    speed_prefix_.assign(static_cast<std::size_t>(n_) + 1, 0);
    std::vector<double> mem(n_), speed(n_);
    for (int d = 0; d < n_; ++d) {
      speed_prefix_[d + 1] = speed_prefix_[d] + cluster.devices[d].speed;
      mem[d] = cluster.devices[d].memory_bytes;
      speed[d] = cluster.devices[d].speed;
    }
    min_memory_.build(mem, true);
    max_speed_.build(speed, false);
  }

  int devices() const { return n_; }
  int max_replicas() const { return max_replicas_; }
  int microbatches() const { return m_; }
  ScheduleKind kind() const { return kind_; }
  double scale() const { return scale_; }
  double speed(int first, int r) const { return speed_prefix_[first + r] - speed_prefix_[first]; }

  int in_flight(int stages_after) const {
    return kind_ == ScheduleKind::kGPipe ? m_ : std::min(m_, stages_after + 1);
  }

  double comm_time(double out_bytes, int last_device, int r) const {
    if (last_device + 1 >= n_ || out_bytes <= 0) return 0;
    const Link& l = cluster_.link(last_device, last_device + 1);
    double t = l.latency_s + (l.bandwidth_bytes_per_s > 0 ? out_bytes * scale_ / (l.bandwidth_bytes_per_s * r) : 0);
    return 2 * t;  // the activation forward, its gradient back
  }

  StageEval eval(const StageSums& s, int first, int r, int stages_after, bool has_next) const {
    StageEval e;
    e.speed = speed(first, r);
    e.max_share = max_speed_.query(first, r) / e.speed;
    e.compute = (s.fwd + s.bwd) * scale_ / e.speed;
    e.comm = has_next ? comm_time(s.out_bytes, first + r - 1, r) : 0;
    if (r > 1) {
      const Link& l = cluster_.same_node(first, first + r - 1) ? cluster_.intra_node : cluster_.inter_node;
      const double ring = 2.0 * (r - 1) / r;
      e.allreduce = ring * (l.bandwidth_bytes_per_s > 0 ? s.params / l.bandwidth_bytes_per_s : 0) + 2.0 * (r - 1) * l.latency_s;
    }
    e.in_flight = in_flight(stages_after);
    e.static_bytes = s.params * (2 + options_.optimizer_bytes_per_param_byte);
    e.transient_bytes = (s.work + 2 * (s.in_bytes + s.out_bytes)) * scale_ * e.max_share;
    e.need = e.static_bytes + e.in_flight * s.saved * scale_ * e.max_share + e.transient_bytes;
    e.capacity = memory_override_ > 0 ? memory_override_ : min_memory_.query(first, r);
    return e;
  }

  double objective(double sum, double max_stage, double max_allreduce) const {
    return sum + (m_ - 1) * max_stage + max_allreduce;
  }

 private:
  const Cluster& cluster_;
  const PlanOptions& options_;
  int m_;
  ScheduleKind kind_;
  double memory_override_;
  int max_replicas_ = 1;
  int n_ = 0;
  double scale_ = 1;
  std::vector<double> speed_prefix_;
  RangeTable min_memory_, max_speed_;
};

StageSums stage_sums(const Units& u, const CutStates& cs, int outer, int inner) {
  StageSums s;
  s.fwd = cs.fwd[outer] - cs.fwd[inner];
  s.bwd = cs.bwd[outer] - cs.bwd[inner];
  s.bwd_w = cs.bwd_w[outer] - cs.bwd_w[inner];
  s.saved = cs.saved[outer] - cs.saved[inner];
  s.params = cs.params[outer] - cs.params[inner];
  s.in_bytes = cs.out_bytes[inner];
  s.out_bytes = cs.out_bytes[outer];
  if (cs.linear && !cs.blocks.empty()) {
    s.work = cs.block_work.query(inner, outer - inner);
  } else {
    const Bits& a = cs.sets[outer];
    const Bits& b = cs.sets[inner];
    for (std::size_t w = 0; w < a.size(); ++w) {
      std::uint64_t diff = a[w] & ~b[w];
      while (diff) {
        int bit = __builtin_ctzll(diff);
        diff &= diff - 1;
        s.work = std::max(s.work, u.units[static_cast<int>(w) * 64 + bit].work);
      }
    }
  }
  return s;
}

// A searched pipeline: stages as (outer, inner) cut states, pipeline order, and replicas.
struct Solution {
  std::vector<std::pair<int, int>> cuts;  // (inner, outer): the stage is outer \ inner
  std::vector<int> replicas;
  double objective = kInf;
};

// Scores a solution exactly as the searches do (used to report and to cross-check).
Result<double> score(const Units& u, const CutStates& cs, const Model& model, const Solution& sol,
                     std::vector<StageEval>* evals = nullptr) {
  const int stages = static_cast<int>(sol.cuts.size());
  int used = std::accumulate(sol.replicas.begin(), sol.replicas.end(), 0);
  if (used > model.devices()) return Status(ErrorCode::kInvalidArgument, "the plan uses more devices than the cluster has");
  int first = model.devices() - used;
  double sum = 0, max_stage = 0, max_ar = 0;
  for (int s = 0; s < stages; ++s) {
    StageSums ss = stage_sums(u, cs, sol.cuts[s].second, sol.cuts[s].first);
    StageEval e = model.eval(ss, first, sol.replicas[s], stages - 1 - s, s + 1 < stages);
    if (!e.fits()) {
      return Status(ErrorCode::kDoesNotFit, "stage " + std::to_string(s) + " needs " + human_bytes(e.need) +
                                                " per device, its devices have " + human_bytes(e.capacity));
    }
    sum += e.compute + e.comm;
    max_stage = std::max({max_stage, e.compute, e.comm});
    max_ar = std::max(max_ar, e.allreduce);
    if (evals) evals->push_back(e);
    first += sol.replicas[s];
  }
  return model.objective(sum, max_stage, max_ar);
}

// ---- Exact search: a Pareto DP over (cut state, devices used, stages after). ------------
// The objective sum + (m-1) max + max-allreduce is monotone in each of (sum, max stage,
// max allreduce), so keeping every non-dominated triple per state is exact.

struct Entry {
  double sum, max_stage, max_ar;
  int prev;   // entry of the state before this stage was added (-1: start)
  int cut;    // this state's cut (the stage added is cut(prev) \ cut)
  int r;
};

double exact_work(const CutStates& cs, int n, int j_states) {
  // Every state against every smaller one (for downsets an upper bound on the nested pairs).
  const double c = static_cast<double>(cs.sets.size());
  return c * (c - 1) / 2 * n * j_states * (n + 1) / 2.0;
}

// The stages the exact search may form: every pair of nested cut states, with its sums.
struct StagePairs {
  std::vector<int> outer, inner;
  std::vector<StageSums> sums;
};

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

// `incumbent`: a known solution (from the bottleneck search); partial plans whose objective
// already reaches it are dropped, since every term only grows as stages are added.
Solution exact_search(const CutStates& cs, const StagePairs& pairs, const Model& model, const Solution& incumbent) {
  const int n = model.devices();
  const int c_count = static_cast<int>(cs.sets.size());
  const int j_states = model.kind() == ScheduleKind::kGPipe ? 1 : std::max(1, std::min(model.microbatches(), n));
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
  auto insert = [&](std::vector<int>& front, const Entry& e, double rest) {
    if (model.objective(e.sum + rest, std::max(e.max_stage, rest), e.max_ar) >= bound) return;
    for (int k : front) {
      const Entry& o = arena[k];
      if (o.sum <= e.sum && o.max_stage <= e.max_stage && o.max_ar <= e.max_ar) return;
    }
    std::erase_if(front, [&](int k) {
      const Entry& o = arena[k];
      return e.sum <= o.sum && e.max_stage <= o.max_stage && e.max_ar <= o.max_ar;
    });
    front.push_back(static_cast<int>(arena.size()));
    arena.push_back(e);
  };
  // Pairs come grouped by outer state, descending: every state is complete before it is left.
  for (std::size_t p = 0; p < pairs.sums.size(); ++p) {
    const int outer = pairs.outer[p], inner = pairs.inner[p];
    const StageSums& ss = pairs.sums[p];
    for (int used = 0; used < n; ++used) {
      for (int j = 0; j < j_states; ++j) {
        const auto& front = fronts[idx(outer, used, j)];
        if (front.empty()) continue;
        const int jn = std::min(j + 1, j_states - 1);
        for (int r = 1; r <= std::min(n - used, model.max_replicas()); ++r) {
          const int left = n - used - r;  // devices for the stages before this one
          const double rest_work = (cs.fwd[inner] + cs.bwd[inner]) * model.scale();
          if (rest_work > 0 && left == 0) continue;
          const double rest = rest_work > 0 ? rest_work / model.speed(0, left) : 0;
          const StageEval e = model.eval(ss, left, r, j, used > 0);
          if (!e.fits()) continue;
          auto& target = fronts[idx(inner, used + r, jn)];
          for (std::size_t k = 0; k < front.size(); ++k) {
            const Entry prev = arena[front[k]];
            insert(target,
                   {prev.sum + e.compute + e.comm, std::max({prev.max_stage, e.compute, e.comm}),
                    std::max(prev.max_ar, e.allreduce), front[k], inner, r},
                   rest);
          }
        }
      }
    }
  }
  Solution best;
  int best_entry = -1;
  for (int used = 1; used <= n; ++used) {
    for (int j = 0; j < j_states; ++j) {
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

// ---- Bottleneck search for large problems: bisection on the slowest stage T; for each T a
// DP over block prefixes finds the fewest devices that keep every stage under T and in
// memory, each stage taking the fewest replicas that do.

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
          const int r = fewest_replicas(ss, used, capped_after(j), t);
          if (r < 0) break;  // larger stages only need more
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
  // The fewest replicas on devices ending before `n - used` meeting T and memory; -1 if none.
  int fewest_replicas(const StageSums& ss, int used, int stages_after, double t) const {
    const int n = model_.devices();
    const int last = n - used;  // devices [last - r, last)
    const int max_r = std::min(last, model_.max_replicas());
    if (max_r < 1) return -1;
    const double work = (ss.fwd + ss.bwd) * model_.scale();
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
    auto ok = [&](int r) {
      const StageEval e = model_.eval(ss, last - r, r, stages_after, used > 0);
      return e.compute <= t && e.comm <= t && e.allreduce <= ar_limit_ * t && e.fits();
    };
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
  /// Each stage's allreduce must stay under `factor` times T (infinity: no limit).
  void limit_allreduce(double factor) { ar_limit_ = factor; }

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

// Bisection on T for a given allreduce limit (a multiple of T); the plan with the smallest
// objective over a few limits wins, since the allreduce tail is not part of T.
Solution bottleneck_search(const Units& u, const CutStates& cs, const Model& model) {
  Solution overall;
  for (double ar_factor : {kInf, 4.0 * model.microbatches(), 1.0 * model.microbatches(), 0.25 * model.microbatches()}) {
    BottleneckSearch search(u, cs, model);
    search.limit_allreduce(ar_factor);
    Solution sol;
    if (!search.feasible(kInf, &sol)) continue;
    std::vector<StageEval> evals;
    if (!score(u, cs, model, sol, &evals)) continue;
    double hi = 0;
    for (const auto& e : evals) hi = std::max({hi, e.compute, e.comm});
    if (std::isfinite(ar_factor)) {  // with a limit, start where it holds
      double worst_ar = 0;
      for (const auto& e : evals) worst_ar = std::max(worst_ar, e.allreduce);
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

// The same solution with its cut states looked up in another state list (block prefixes
// are downsets, so they appear among all downsets).
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

// ---------------------------------------------------------------------------------------

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
  return {ScheduleKind::kGPipe, ScheduleKind::kOneFOneB, ScheduleKind::kInterleaved, ScheduleKind::kZeroBubbleH1};
}

// The schedule whose memory model a search runs under (ZB-H1 keeps 1F1B's activations).
ScheduleKind memory_kind(ScheduleKind k) { return k == ScheduleKind::kGPipe ? ScheduleKind::kGPipe : ScheduleKind::kOneFOneB; }

// The plan row of the stage outer \ inner on devices [first, first + replicas).
StagePlan stage_plan(const Units& u, const CutStates& cs, int inner, int outer, const Model& model,
                     const Cluster& cluster, int first, int replicas, const StageEval& e, bool has_prev,
                     bool has_next) {
  StagePlan sp;
  for (std::size_t x = 0; x < u.units.size(); ++x) {
    if (test(cs.sets[outer], static_cast<int>(x)) && !test(cs.sets[inner], static_cast<int>(x))) {
      sp.ops.insert(sp.ops.end(), u.units[x].ops.begin(), u.units[x].ops.end());
    }
  }
  std::sort(sp.ops.begin(), sp.ops.end());
  const StageSums ss = stage_sums(u, cs, outer, inner);
  sp.first_device = first;
  sp.replicas = replicas;
  for (int d = first; d < first + replicas; ++d) sp.shares.push_back(cluster.devices[d].speed / e.speed);
  sp.forward_s = ss.fwd * model.scale() / e.speed;
  sp.backward_s = ss.bwd * model.scale() / e.speed;
  sp.backward_weight_s = ss.bwd_w * model.scale() / e.speed;
  sp.send_bytes = has_next ? ss.out_bytes * model.scale() : 0;
  sp.recv_bytes = has_prev ? ss.in_bytes * model.scale() : 0;
  sp.allreduce_s = e.allreduce;
  sp.param_bytes = ss.params;
  sp.static_bytes = e.static_bytes;
  sp.saved_bytes = ss.saved * model.scale() * e.max_share;
  sp.memory_bytes = e.need;
  sp.in_flight = e.in_flight;
  return sp;
}

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
  for (int s = 0; s + 1 < stages; ++s) {
    const auto& a = plan.stages[s];
    const int last = a.first_device + a.replicas - 1;
    plan.links.push_back(cluster.link(last, last + 1));
  }
  return plan;
}

// Interleaved candidates: keep a plain plan's device groups (its stages' devices) and cut
// the model, along its block order, into v pieces per group, piece k running on group
// k mod G with a share of the work proportional to the group's speed. Memory per device
// is checked with the simulated peak (each group holds v pieces' weights and their
// activations in flight) plus the largest piece's working memory and buffers.
void interleaved_candidates(const Cluster& cluster, const Units& u, const CutStates& lin, const Model& model,
                            const Plan& base, std::vector<Plan>& out) {
  const int groups = static_cast<int>(base.stages.size());
  const int m = model.microbatches();
  const int k_blocks = static_cast<int>(lin.sets.size()) - 1;
  if (groups < 2 || m % groups != 0) return;
  double speed_total = 0;
  std::vector<double> group_speed;
  for (const auto& st : base.stages) {
    group_speed.push_back(model.speed(st.first_device, st.replicas));
    speed_total += group_speed.back();
  }
  const double total = lin.fwd[k_blocks] + lin.bwd[k_blocks];
  for (int v : {2, 3, 4}) {
    const int pieces = v * groups;
    if (pieces > k_blocks) break;
    std::vector<int> cut{0};
    double target = 0;
    for (int k = 0; k + 1 < pieces; ++k) {
      target += total * group_speed[k % groups] / (v * speed_total);
      int b = cut.back() + 1;
      while (b < k_blocks - (pieces - k - 1) && lin.fwd[b] + lin.bwd[b] < target) ++b;
      cut.push_back(b);
    }
    cut.push_back(k_blocks);
    Plan p = base;
    p.schedule = ScheduleKind::kInterleaved;
    p.chunks = v;
    p.stages.clear();
    p.links.clear();
    std::vector<double> extra(static_cast<std::size_t>(groups), 0);  // work and buffers per group
    for (int k = 0; k < pieces; ++k) {
      const StagePlan& grp = base.stages[k % groups];
      const StageSums ss = stage_sums(u, lin, cut[k + 1], cut[k]);
      const StageEval e = model.eval(ss, grp.first_device, grp.replicas, pieces - 1 - k, k + 1 < pieces);
      extra[k % groups] = std::max(extra[k % groups], e.transient_bytes);
      p.stages.push_back(stage_plan(u, lin, cut[k], cut[k + 1], model, cluster, grp.first_device, grp.replicas, e,
                                    k > 0, k + 1 < pieces));
      if (k + 1 < pieces) {
        const StagePlan& next = base.stages[(k + 1) % groups];
        p.links.push_back(cluster.link(grp.first_device + grp.replicas - 1, next.first_device));
      }
    }
    auto sim = p.simulate();
    if (!sim) continue;
    bool fits = true;
    for (int gi = 0; gi < groups && fits; ++gi) {
      const StagePlan& grp = base.stages[gi];
      double cap = kInf;
      for (int d = grp.first_device; d < grp.first_device + grp.replicas; ++d) {
        cap = std::min(cap, cluster.devices[d].memory_bytes);
      }
      const double need = sim->peak_bytes[gi] + extra[gi];
      fits = need <= cap;
      for (int k = gi; k < pieces; k += groups) p.stages[k].memory_bytes = need;
    }
    if (fits) out.push_back(std::move(p));
  }
}

}  // namespace

scheduler::ScheduleSpec Plan::schedule_spec() const {
  return {schedule, ranks(), microbatches, chunks};
}

std::vector<scheduler::StageCost> Plan::stage_costs() const {
  std::vector<scheduler::StageCost> out;
  for (std::size_t s = 0; s < stages.size(); ++s) {
    const StagePlan& st = stages[s];
    scheduler::StageCost c;
    c.forward_s = st.forward_s;
    c.backward_s = st.backward_s;
    c.backward_weight_s = st.backward_weight_s;
    // Replicas send their shares over their own links in parallel; between stages with
    // different replica counts the shares are redistributed, and the side with fewer
    // replicas carries the most per link.
    const int next = s + 1 < stages.size() ? stages[s + 1].replicas : st.replicas;
    const int prev = s > 0 ? stages[s - 1].replicas : st.replicas;
    c.activation_bytes = st.send_bytes / std::min(st.replicas, next);
    c.gradient_bytes = st.recv_bytes / std::min(st.replicas, prev);
    c.allreduce_s = st.allreduce_s;
    c.static_bytes = st.static_bytes;
    c.saved_bytes = st.saved_bytes;
    out.push_back(c);
  }
  return out;
}

std::vector<scheduler::LinkCost> Plan::link_costs() const {
  std::vector<scheduler::LinkCost> out;
  for (const auto& l : links) out.push_back({l.latency_s, l.bandwidth_bytes_per_s});
  if (out.empty()) out.push_back({});
  return out;
}

Result<scheduler::SimulationResult> Plan::simulate() const {
  CONVEYOR_ASSIGN_OR_RETURN(auto sched, scheduler::make_schedule(schedule_spec()));
  auto links = link_costs();
  if (stages.size() <= 1) links = {scheduler::LinkCost{}};
  return scheduler::simulate(sched, stage_costs(), links);
}

Result<Plan> make_plan(const CostGraph& g, const Cluster& cluster, const PlanOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  CONVEYOR_RETURN_IF_ERROR(g.validate());
  if (options.batch < 1) return Status(ErrorCode::kInvalidArgument, "the batch size must be at least 1");
  if (cluster.devices.empty()) return Status(ErrorCode::kInvalidArgument, "the cluster has no devices");
  if (options.microbatches > options.batch) {
    return Status(ErrorCode::kInvalidArgument, "the batch (" + std::to_string(options.batch) +
                                                   " samples) is smaller than the microbatch count (" +
                                                   std::to_string(options.microbatches) + ")");
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
  for (int m : microbatch_candidates(options, g.min_share)) {
    for (ScheduleKind mk : memory_kinds) {
      Model model(cluster, options, m, mk, g.microbatch, g.min_share);
      const int j_states = mk == ScheduleKind::kGPipe ? 1 : std::max(1, std::min(m, n));
      const CutStates* states = have_downsets ? &exact_states : &linear;
      bool exact = options.search == SearchMode::kExact ||
                   (options.search == SearchMode::kAuto && exact_work(*states, n, j_states) <= options.exact_budget);
      if (!exact && have_downsets && options.search == SearchMode::kAuto &&
          exact_work(linear, n, j_states) <= options.exact_budget) {
        states = &linear;  // exact over block prefixes
        exact = true;
      }
      if (!exact) states = &linear;
      // The bottleneck search gives a quick incumbent; the exact search proves or improves it.
      Solution sol = bottleneck_search(units, linear, model);
      const CutStates* sol_states = &linear;
      if (exact) {
        StagePairs& pairs = states->linear ? linear_pairs : exact_pairs;
        if (pairs.sums.empty()) pairs = stage_pairs(units, *states);
        Solution incumbent = sol;
        if (!states->linear && !incumbent.cuts.empty()) incumbent = translate(incumbent, linear, *states);
        sol = exact_search(*states, pairs, model, incumbent);
        sol_states = states;
      }
      states = sol_states;
      if (sol.cuts.empty() || !std::isfinite(sol.objective)) continue;
      search_used = exact ? (states->linear ? "exact over " + std::to_string(states->sets.size() - 1) + " blocks in order"
                                            : "exact over " + std::to_string(states->sets.size()) + " convex cut states")
                          : "bottleneck bisection over " + std::to_string(states->sets.size() - 1) + " blocks";
      any_fit = true;
      Plan base = build_plan(g, cluster, options, units, *states, model, sol, mk);
      base.search = search_used;
      for (ScheduleKind k : wanted) {
        if (memory_kind(k) != mk) continue;
        if (k == ScheduleKind::kInterleaved) continue;
        Plan p = base;
        p.schedule = k;
        candidates.push_back(std::move(p));
      }
      if (mk == ScheduleKind::kOneFOneB && want(ScheduleKind::kInterleaved)) {
        interleaved_candidates(cluster, units, linear, model, base, candidates);
      }
    }
  }
  if (candidates.empty() && any_fit) {
    return Status(ErrorCode::kUnsupported,
                  "plans fit, but none can run the requested schedule: the interleaved schedule needs at least two "
                  "device groups, a microbatch count divisible by their number, and memory for two or more model "
                  "pieces per group; "
                  "allow other schedules (schedule \"auto\") or fix the microbatch count");
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
      Model model(cluster, options, m, ScheduleKind::kOneFOneB, g.microbatch, g.min_share, mid);
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
  // The simulated step time of the actual schedule decides.
  Plan* best = nullptr;
  for (auto& p : candidates) {
    auto sim = p.simulate();
    if (!sim) continue;
    p.predicted_step_s = sim->step_time_s;
    p.bubble_fraction = sim->bubble_fraction;
    if (!best || p.predicted_step_s < best->predicted_step_s - 1e-15) best = &p;
  }
  if (!best) return Status(ErrorCode::kInternal, "no candidate plan could be simulated");
  Plan out = *best;
  out.search_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

Result<double> candidate_objective(const CostGraph& g, const Cluster& cluster, const PlanOptions& options,
                                   const Candidate& c) {
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
  Model model(cluster, options, c.microbatches, memory_kind(c.schedule), g.microbatch, g.min_share);
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
  return score(units, cs, model, sol);
}

}  // namespace conveyor::partitioner

#include "partitioner/search_space.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <queue>
#include <unordered_map>

namespace conveyor::partitioner::detail {

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
    unit.sel_fwd += op.selective_forward_s;
    unit.sel_freed += op.selective_freed_bytes - op.selective_kept_bytes;
    if (!op.params.empty()) unit.saved_w += op.saved_bytes;
    unit.work = std::max(unit.work, op.work_bytes);
    unit.sel_work = std::max(unit.sel_work, op.selective_work_bytes);
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
    // A split backward holds, until its W, the gradient arriving at each operator that reads
    // parameters (the weight gradient's other factor).
    if (!g.ops[g.values[v].producer].params.empty()) {
      out.units[out.unit_of_op[g.values[v].producer]].saved_w += g.values[v].bytes;
      out.units[out.unit_of_op[g.values[v].producer]].grads_w += g.values[v].bytes;
    }
    Edge e;
    e.from = out.unit_of_op[g.values[v].producer];
    e.bytes = g.values[v].bytes;
    if (g.values[v].saved_by >= 0) e.saved_by = out.unit_of_op[g.values[v].saved_by];
    e.redistributable = g.values[v].redistributable;
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
  cs.sel_fwd.assign(c, 0);
  cs.sel_freed.assign(c, 0);
  cs.saved_w.assign(c, 0);
  cs.grads_w.assign(c, 0);
  cs.through_fixed.assign(c, false);
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
      cs.sel_fwd[k] += unit.sel_fwd;
      cs.sel_freed[k] += unit.sel_freed;
      cs.saved_w[k] += unit.saved_w;
      cs.grads_w[k] += unit.grads_w;
    }
    for (const Edge& e : u.edges) {
      if (!test(b, e.from)) continue;
      for (int t : e.to) {
        if (!test(b, t)) {
          cs.out_bytes[k] += e.bytes;
          if (!e.redistributable) cs.through_fixed[k] = true;
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
  // Selective recomputation's transient at its place in the backward: a unit's (or its run's)
  // working memory plus what the microbatch keeps up to it, from the model's start; a stage
  // takes the most over its units less what it keeps in all (CutStates::block_sel_live).
  std::vector<double> work, sel_live;
  for (std::size_t b = 0; b < cs.blocks.size(); ++b) {
    double w = 0;
    double kept = cs.saved[b] - cs.sel_freed[b];
    double live = -std::numeric_limits<double>::infinity();
    for (int x : cs.blocks[b]) {
      const Unit& unit = u.units[x];
      w = std::max(w, unit.work);
      kept += unit.saved - unit.sel_freed;
      live = std::max(live, std::max(unit.work, unit.sel_work) + kept);
    }
    work.push_back(w);
    sel_live.push_back(live);
  }
  cs.block_work.build(work, false);
  cs.block_sel_live.build(sel_live, false);
  return cs;
}

}  // namespace conveyor::partitioner::detail

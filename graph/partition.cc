#include "graph/partition.h"

#include <algorithm>
#include <numeric>
#include <random>
#include <set>

namespace conveyor::graph {
namespace {

class UnionFind {
 public:
  explicit UnionFind(std::size_t n) : parent_(n) { std::iota(parent_.begin(), parent_.end(), 0); }
  std::size_t find(std::size_t x) {
    while (parent_[x] != x) x = parent_[x] = parent_[parent_[x]];
    return x;
  }
  void unite(std::size_t a, std::size_t b) {
    a = find(a);
    b = find(b);
    if (a != b) parent_[std::max(a, b)] = std::min(a, b);
  }

 private:
  std::vector<std::size_t> parent_;
};

std::string describe(const Graph& g, NodeId n) {
  const Node& node = g.nodes[n];
  return "node " + std::to_string(n) + " (" + node.qualified_name() +
         (node.source.empty() ? "" : " at " + node.source) + ")";
}

// Marks every node reachable from `start` along edges in `adj`, including `start`.
void reach(const std::vector<std::vector<NodeId>>& adj, const std::vector<NodeId>& start,
           std::vector<char>& seen) {
  std::vector<NodeId> stack(start.begin(), start.end());
  for (NodeId n : start) seen[n] = 1;
  while (!stack.empty()) {
    NodeId n = stack.back();
    stack.pop_back();
    for (NodeId m : adj[n]) {
      if (!seen[m]) {
        seen[m] = 1;
        stack.push_back(m);
      }
    }
  }
}

std::vector<std::vector<NodeId>> predecessors(const std::vector<std::vector<NodeId>>& succ) {
  std::vector<std::vector<NodeId>> pred(succ.size());
  for (std::size_t n = 0; n < succ.size(); ++n) {
    for (NodeId m : succ[n]) pred[m].push_back(static_cast<NodeId>(n));
  }
  return pred;
}

}  // namespace

std::vector<ValueId> storage_roots(const Graph& g) {
  std::vector<ValueId> root(g.values.size());
  std::iota(root.begin(), root.end(), 0);
  for (const Node& n : g.nodes) {
    if (n.aliased_args.empty() || n.returns.empty()) continue;
    ValueId base = -1;
    for (int a : n.aliased_args) {
      if (n.args[a].kind == Argument::Kind::kValue) {
        base = root[n.args[a].value];
        break;
      }
    }
    if (base < 0) continue;
    const Return& r = n.returns[0];
    if (r.kind == Return::Kind::kValue) root[r.value] = base;
    for (ValueId v : r.items) {
      if (v >= 0) root[v] = base;
    }
  }
  return root;
}

std::vector<std::vector<NodeId>> atomic_groups(const Graph& g) {
  const std::size_t num_nodes = g.nodes.size();
  const auto producer = g.producers();
  const std::vector<ValueId> root = storage_roots(g);
  // Last writer of each mutated root.
  std::vector<NodeId> last_write(g.values.size(), -1);
  for (const Node& n : g.nodes) {
    for (int a : n.mutated_args) {
      if (n.args[a].kind == Argument::Kind::kValue) last_write[root[n.args[a].value]] = n.id;
    }
  }
  UnionFind uf(num_nodes);
  std::vector<NodeId> anchor(g.values.size(), -1);  // a node already in the root's group
  auto join = [&](ValueId r, NodeId n) {
    if (anchor[r] < 0) anchor[r] = n; else uf.unite(anchor[r], n);
  };
  for (const Node& n : g.nodes) {
    for (ValueId v : Graph::node_outputs(n)) {
      ValueId r = root[v];
      if (last_write[r] >= 0) {
        join(r, n.id);
        if (producer[r] >= 0) join(r, producer[r]);
      }
    }
    for (ValueId v : Graph::node_inputs(n)) {
      ValueId r = root[v];
      if (last_write[r] >= 0 && n.id <= last_write[r]) join(r, n.id);
    }
  }
  // Make every group convex: add the nodes on paths between its members, merging as needed.
  const auto succ = g.consumers();
  const auto pred = predecessors(succ);
  bool changed = true;
  while (changed) {
    changed = false;
    std::vector<std::vector<NodeId>> members(num_nodes);
    for (std::size_t n = 0; n < num_nodes; ++n) members[uf.find(n)].push_back(static_cast<NodeId>(n));
    for (const auto& group : members) {
      if (group.size() < 2) continue;
      std::vector<char> down(num_nodes, 0), up(num_nodes, 0);
      reach(succ, group, down);
      reach(pred, group, up);
      for (std::size_t n = 0; n < num_nodes; ++n) {
        if (down[n] && up[n] && uf.find(n) != uf.find(group[0])) {
          uf.unite(n, group[0]);
          changed = true;
        }
      }
    }
  }
  std::vector<std::vector<NodeId>> members(num_nodes);
  for (std::size_t n = 0; n < num_nodes; ++n) members[uf.find(n)].push_back(static_cast<NodeId>(n));
  std::vector<std::vector<NodeId>> groups;
  for (auto& m : members) {
    if (m.size() >= 2) groups.push_back(std::move(m));
  }
  return groups;
}

std::vector<int> group_of_nodes(const Graph& g, const std::vector<std::vector<NodeId>>& groups) {
  std::vector<int> of(g.nodes.size(), -1);
  for (std::size_t i = 0; i < groups.size(); ++i) {
    for (NodeId n : groups[i]) of[n] = static_cast<int>(i);
  }
  return of;
}

namespace {

// What stage checks need from the whole graph, computed once per partition check.
struct GraphFacts {
  explicit GraphFacts(const Graph& g) : succ(g.consumers()), groups(atomic_groups(g)), producer(g.producers()) {}
  std::vector<std::vector<NodeId>> succ;
  std::vector<std::vector<NodeId>> groups;
  std::vector<NodeId> producer;
};

Status check_stage_with(const Graph& g, std::span<const NodeId> nodes, const GraphFacts& facts) {
  const std::size_t num_nodes = g.nodes.size();
  auto bad = [](const std::string& msg) { return Status(ErrorCode::kInvalidStage, msg); };
  if (nodes.empty()) return bad("a stage must contain at least one node");
  std::vector<char> in(num_nodes, 0);
  for (NodeId n : nodes) {
    if (n < 0 || static_cast<std::size_t>(n) >= num_nodes) {
      return bad("stage lists node " + std::to_string(n) + " but the graph has nodes 0.." +
                 std::to_string(num_nodes - 1));
    }
    if (in[n]) return bad("stage lists " + describe(g, n) + " twice");
    in[n] = 1;
  }
  // Convex: no node outside the stage is both reachable from it and reaches it.
  const auto& succ = facts.succ;
  std::vector<NodeId> outside_frontier;
  for (NodeId n : nodes) {
    for (NodeId m : succ[n]) {
      if (!in[m]) outside_frontier.push_back(m);
    }
  }
  std::vector<char> seen(num_nodes, 0);
  std::vector<NodeId> stack = outside_frontier;
  std::vector<NodeId> came_from(num_nodes, -1);
  for (NodeId n : stack) seen[n] = 1;
  while (!stack.empty()) {
    NodeId n = stack.back();
    stack.pop_back();
    for (NodeId m : succ[n]) {
      if (in[m]) {
        NodeId via = n;
        while (came_from[via] >= 0) via = came_from[via];
        return bad("stage is not convex: " + describe(g, via) +
                   " is outside the stage but lies on a path from the stage to " +
                   describe(g, m) + "; include it or cut elsewhere");
      }
      if (!seen[m]) {
        seen[m] = 1;
        came_from[m] = n;
        stack.push_back(m);
      }
    }
  }
  for (const auto& group : facts.groups) {
    std::size_t count = 0;
    for (NodeId n : group) count += in[n];
    if (count != 0 && count != group.size()) {
      NodeId missing = -1, present = -1;
      for (NodeId n : group) (in[n] ? present : missing) = n;
      return bad("stage splits an atomic group: " + describe(g, present) + " and " +
                 describe(g, missing) +
                 " view or write the same tensor storage in place and must share a stage");
    }
  }
  // A stage never writes in place into a value it receives from another stage.
  const auto& producer = facts.producer;
  for (NodeId n : nodes) {
    const Node& node = g.nodes[n];
    for (int a : node.mutated_args) {
      const Argument& arg = node.args[a];
      if (arg.kind != Argument::Kind::kValue) continue;
      NodeId p = producer[arg.value];
      if (p >= 0 && !in[p]) {
        return bad(describe(g, n) + " writes in place into a value computed outside the stage by " +
                   describe(g, p));
      }
    }
  }
  return Status::ok();
}

}  // namespace

Status check_stage(const Graph& g, std::span<const NodeId> nodes) {
  return check_stage_with(g, nodes, GraphFacts(g));
}

Status check_partition(const Graph& g, const std::vector<std::vector<NodeId>>& stages) {
  auto bad = [](const std::string& msg) { return Status(ErrorCode::kInvalidStage, msg); };
  const GraphFacts facts(g);
  std::vector<int> stage_of(g.nodes.size(), -1);
  for (std::size_t s = 0; s < stages.size(); ++s) {
    CONVEYOR_RETURN_IF_ERROR(check_stage_with(g, stages[s], facts).with_context("stage " + std::to_string(s)));
    for (NodeId n : stages[s]) {
      if (stage_of[n] >= 0) {
        return bad(describe(g, n) + " is in stage " + std::to_string(stage_of[n]) + " and stage " +
                   std::to_string(s));
      }
      stage_of[n] = static_cast<int>(s);
    }
  }
  for (std::size_t n = 0; n < g.nodes.size(); ++n) {
    if (stage_of[n] < 0) return bad(describe(g, static_cast<NodeId>(n)) + " is in no stage");
  }
  const auto& succ = facts.succ;
  for (std::size_t n = 0; n < g.nodes.size(); ++n) {
    for (NodeId m : succ[n]) {
      if (stage_of[m] < stage_of[n]) {
        return bad(describe(g, m) + " in stage " + std::to_string(stage_of[m]) + " reads from " +
                   describe(g, static_cast<NodeId>(n)) + " in the later stage " +
                   std::to_string(stage_of[n]) + "; order the stages so data flows forward");
      }
    }
  }
  return Status::ok();
}

StageBoundary stage_boundary(const Graph& g, std::span<const NodeId> nodes) {
  std::vector<char> in(g.nodes.size(), 0);
  for (NodeId n : nodes) in[n] = 1;
  const auto producer = g.producers();
  std::vector<char> is_binding(g.values.size(), 0);
  for (const auto& b : g.bindings) is_binding[b.value] = 1;
  std::set<ValueId> inputs, outputs;
  for (NodeId n : nodes) {
    for (ValueId v : Graph::node_inputs(g.nodes[n])) {
      if (is_binding[v]) continue;
      if (producer[v] < 0 || !in[producer[v]]) inputs.insert(v);
    }
  }
  for (const Node& node : g.nodes) {
    if (in[node.id]) continue;
    for (ValueId v : Graph::node_inputs(node)) {
      if (producer[v] >= 0 && in[producer[v]]) outputs.insert(v);
    }
  }
  for (ValueId v : g.outputs) {
    if (producer[v] >= 0 && in[producer[v]]) outputs.insert(v);
  }
  return {std::vector<ValueId>(inputs.begin(), inputs.end()),
          std::vector<ValueId>(outputs.begin(), outputs.end())};
}

Result<std::vector<std::vector<NodeId>>> random_partition(const Graph& g, int num_stages,
                                                          std::uint64_t seed, bool keep_node_order) {
  const std::size_t num_nodes = g.nodes.size();
  if (num_stages < 1) {
    return Status(ErrorCode::kInvalidArgument, "the number of stages must be at least 1");
  }
  // Contract atomic groups into single units; units form a DAG because groups are convex.
  const auto groups = atomic_groups(g);
  const auto group_of = group_of_nodes(g, groups);
  std::vector<int> unit_of(num_nodes, -1);
  std::vector<std::vector<NodeId>> units;
  for (std::size_t n = 0; n < num_nodes; ++n) {
    if (unit_of[n] >= 0) continue;
    if (group_of[n] >= 0) {
      for (NodeId m : groups[group_of[n]]) unit_of[m] = static_cast<int>(units.size());
      units.push_back(groups[group_of[n]]);
    } else {
      unit_of[n] = static_cast<int>(units.size());
      units.push_back({static_cast<NodeId>(n)});
    }
  }
  if (units.size() < static_cast<std::size_t>(num_stages)) {
    return Status(ErrorCode::kInvalidArgument,
                  "cannot cut the graph into " + std::to_string(num_stages) + " stages: it has only " +
                      std::to_string(units.size()) + " units that can be separated");
  }
  const auto succ = g.consumers();
  std::vector<std::set<int>> unit_succ(units.size());
  std::vector<int> indegree(units.size(), 0);
  for (std::size_t n = 0; n < num_nodes; ++n) {
    for (NodeId m : succ[n]) {
      int a = unit_of[n], b = unit_of[m];
      if (a != b && unit_succ[a].insert(b).second) ++indegree[b];
    }
  }
  std::mt19937_64 rng(seed);
  std::vector<int> ready, order;
  for (std::size_t u = 0; u < units.size(); ++u) {
    if (indegree[u] == 0) ready.push_back(static_cast<int>(u));
  }
  while (!ready.empty()) {
    std::size_t pick = 0;
    if (keep_node_order) {
      for (std::size_t i = 1; i < ready.size(); ++i) {
        if (units[ready[i]].front() < units[ready[pick]].front()) pick = i;
      }
    } else {
      pick = std::uniform_int_distribution<std::size_t>(0, ready.size() - 1)(rng);
    }
    int u = ready[pick];
    ready.erase(ready.begin() + static_cast<std::ptrdiff_t>(pick));
    order.push_back(u);
    for (int v : unit_succ[u]) {
      if (--indegree[v] == 0) ready.push_back(v);
    }
  }
  CONVEYOR_CHECK(order.size() == units.size(), "unit graph has a cycle");
  // Choose num_stages - 1 distinct cut positions among 1..units-1.
  std::vector<std::size_t> positions(units.size() - 1);
  std::iota(positions.begin(), positions.end(), 1);
  std::shuffle(positions.begin(), positions.end(), rng);
  std::vector<std::size_t> cuts(positions.begin(), positions.begin() + (num_stages - 1));
  std::sort(cuts.begin(), cuts.end());
  cuts.push_back(units.size());
  std::vector<std::vector<NodeId>> stages;
  std::size_t begin = 0;
  for (std::size_t end : cuts) {
    std::vector<NodeId> stage;
    for (std::size_t i = begin; i < end; ++i) {
      stage.insert(stage.end(), units[order[i]].begin(), units[order[i]].end());
    }
    std::sort(stage.begin(), stage.end());
    stages.push_back(std::move(stage));
    begin = end;
  }
  return stages;
}

}  // namespace conveyor::graph

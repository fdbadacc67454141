#include "random_graphs.h"

#include <algorithm>
#include <set>
#include <string>

namespace conveyor::partitioner::testing {

CostGraph random_dag(int n, std::uint64_t seed, double chain_p, double skip_p) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0, 1);
  CostGraph g;
  g.name = "random" + std::to_string(seed);
  g.microbatch = 1 + static_cast<int>(rng() % 4);
  for (int i = 0; i < 3; ++i) g.params.push_back({"p" + std::to_string(i), 1000 + 9000 * u(rng)});
  for (int i = 0; i < n; ++i) {
    CostOp op;
    op.name = "op" + std::to_string(i);
    op.forward_s = 1e-3 * (0.1 + u(rng));
    op.backward_s = op.forward_s * (1 + u(rng));
    op.backward_weight_s = op.backward_s * u(rng) * 0.5;
    op.saved_bytes = 1000 * u(rng);
    op.work_bytes = 500 * u(rng);
    std::set<int> ins;
    if (i > 0 && u(rng) < chain_p) ins.insert(i - 1);
    for (int k = 0; k < 2; ++k) {
      if (i > 1 && u(rng) < skip_p) ins.insert(static_cast<int>(rng() % static_cast<std::uint64_t>(i)));
    }
    op.inputs.assign(ins.begin(), ins.end());  // value i is operator i's output
    if (u(rng) < 0.4) op.params.push_back(static_cast<int>(rng() % 3));
    g.ops.push_back(op);
    g.values.push_back({i, 2000 * u(rng)});
  }
  return g;
}

CostGraph uniform_chain(int n, double forward_s, double backward_s, double param_bytes, double activation_bytes) {
  CostGraph g;
  g.name = "chain" + std::to_string(n);
  for (int i = 0; i < n; ++i) {
    g.params.push_back({"w" + std::to_string(i), param_bytes});
    CostOp op;
    op.name = "layer" + std::to_string(i);
    op.forward_s = forward_s;
    op.backward_s = backward_s;
    op.backward_weight_s = backward_s / 2;
    op.saved_bytes = activation_bytes;
    op.work_bytes = activation_bytes;
    if (i > 0) op.inputs.push_back(i - 1);
    op.params.push_back(i);
    g.ops.push_back(op);
    g.values.push_back({i, activation_bytes});
  }
  return g;
}

std::vector<std::vector<bool>> reachability(const CostGraph& g) {
  const int n = static_cast<int>(g.ops.size());
  std::vector<std::vector<bool>> reach(n, std::vector<bool>(n, false));
  for (int b = 0; b < n; ++b) {
    for (int v : g.ops[b].inputs) {
      const int a = g.values[v].producer;
      if (a < 0) continue;
      reach[a][b] = true;
      for (int x = 0; x < n; ++x) {
        if (reach[x][a]) reach[x][b] = true;
      }
    }
  }
  return reach;
}

bool is_convex(const std::vector<std::vector<bool>>& reach, const std::vector<int>& stage, int n) {
  std::vector<bool> in(n, false);
  for (int x : stage) in[x] = true;
  for (int a : stage) {
    for (int b : stage) {
      for (int w = 0; w < n; ++w) {
        if (!in[w] && reach[a][w] && reach[w][b]) return false;
      }
    }
  }
  return true;
}

void for_each_replica_assignment(std::vector<int>& replicas, int devices, const std::function<void()>& visit) {
  const int stages = static_cast<int>(replicas.size());
  std::function<void(int, int)> assign = [&](int s, int left) {
    if (s == stages) return visit();
    for (int r = 1; r <= left - (stages - s - 1); ++r) {
      replicas[s] = r;
      assign(s + 1, left - r);
    }
  };
  assign(0, devices);
}

}  // namespace conveyor::partitioner::testing

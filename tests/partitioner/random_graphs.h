// Random cost graphs for planner tests: DAGs with branches and skip connections.
#pragma once

#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include "partitioner/cluster.h"
#include "partitioner/cost_graph.h"

namespace conveyor::partitioner::testing {

/// `n` operators; each reads its predecessor with probability `chain_p` and up to two
/// random earlier operators (skips) with probability `skip_p` each. Costs are random.
CostGraph random_dag(int n, std::uint64_t seed, double chain_p = 0.8, double skip_p = 0.35);

/// A chain of `n` identical operators (balanced synthetic workload).
CostGraph uniform_chain(int n, double forward_s, double backward_s, double param_bytes, double activation_bytes);

/// A link fast enough not to matter (100 GB/s, 1 us).
inline Link fast_link() { return {100e9, 1e-6}; }

/// reach[a][b]: b is reachable from a (a path of one or more edges).
std::vector<std::vector<bool>> reachability(const CostGraph& g);

/// Independent convexity check of a stage: no path leaves the set and re-enters it.
bool is_convex(const std::vector<std::vector<bool>>& reach, const std::vector<int>& stage, int n);

/// Calls `visit` with every assignment of at least one of `devices` devices to each of
/// `replicas.size()` stages (written into `replicas`), as brute forces enumerate them.
void for_each_replica_assignment(std::vector<int>& replicas, int devices, const std::function<void()>& visit);

}  // namespace conveyor::partitioner::testing

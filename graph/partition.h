// Structural rules for cutting a graph into stages, torch-free: atomic groups
// (nodes that must share a stage), convexity, stage boundaries, random valid cuts.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/status.h"
#include "graph/ir.h"

namespace conveyor::graph {

/// Values a stage receives from outside and sends outside, ascending by id.
struct StageBoundary {
  std::vector<ValueId> inputs;   ///< read by the stage, defined elsewhere (graph inputs or other stages)
  std::vector<ValueId> outputs;  ///< defined by the stage, read elsewhere or returned by the graph
};

/// For each value, the value whose storage it uses: views and in-place results share
/// their argument's root; every other value is its own.
std::vector<ValueId> storage_roots(const Graph& graph);

/// Groups of nodes that must never be split across stages, each convex, sorted.
///
/// A group forms around every tensor storage that is written in place: the node that
/// creates the storage, every view of it, every write through it, and every read of it
/// that happens before the last write (it must see the value from before the write).
/// Nodes in no such group are not listed.
std::vector<std::vector<NodeId>> atomic_groups(const Graph& graph);

/// For each node, the index of its atomic group in `groups`, or -1.
std::vector<int> group_of_nodes(const Graph& graph, const std::vector<std::vector<NodeId>>& groups);

/// Checks that `nodes` is a valid stage: in range, no duplicates, convex (no path leaves
/// the set and re-enters it), and no atomic group is split.
Status check_stage(const Graph& graph, std::span<const NodeId> nodes);

/// Checks that `stages` partitions the graph: every node once, every stage valid, and
/// every stage reads only from earlier stages (so running them in order is correct).
Status check_partition(const Graph& graph, const std::vector<std::vector<NodeId>>& stages);

/// Inputs and outputs of the stage made of `nodes` (assumed valid).
StageBoundary stage_boundary(const Graph& graph, std::span<const NodeId> nodes);

/// A random valid partition into `num_stages` non-empty stages, listed in execution order,
/// each stage's nodes ascending. With `keep_node_order` the stages are contiguous ranges of
/// the capture order (random number generators are then drawn in the same order as eager).
Result<std::vector<std::vector<NodeId>>> random_partition(const Graph& graph, int num_stages,
                                                          std::uint64_t seed, bool keep_node_order);

}  // namespace conveyor::graph

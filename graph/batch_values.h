// Where each value of a captured graph holds its samples, worked out from the graph alone
// (torch-free): which dimension of each value holds the samples, which values are the batch
// size itself, and which can be redistributed between stages whose replicas split a
// microbatch differently. The runtime slices and joins values by it (runtime/batch_layout.h);
// the planner never cuts through a value that cannot be redistributed where the replicas of
// the stages on either side may split differently (partitioner/search_space.h).
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "graph/ir.h"

namespace conveyor::graph {

/// Per value and per graph input: where the batch is.
struct BatchValues {
  std::vector<bool> batched_input;            ///< per graph input: split along dim 0
  std::map<ValueId, int> input_index;         ///< a graph input's value -> its place among the inputs
  std::vector<int> batch_dim;                 ///< per value: its batch dimension (-1: none)
  /// Per value: elements per sample along batch_dim (a flattened batch "k*s"); 0 when k is
  /// a product with other symbolic sizes (a sequence length), known per call.
  std::vector<std::int64_t> batch_scale;
  std::vector<bool> is_batch_size;            ///< per value: a size equal to the batch (each replica sees its share's)
  /// Per value: a size that is the batch times a factor the same for every share (batch x
  /// heads, batch x sequence length: conveyor::sym mul): each replica sees its share's.
  std::vector<bool> times_batch_size;
  std::vector<bool> on_batch;                 ///< per value: depends on a batched input
  /// Per value: positions within a share (made from arange(batch) and no data), which mean
  /// nothing once shares are joined and split again.
  std::vector<bool> share_positions;
  Graph::Range range;                         ///< the share sizes the graph holds for (capture's guards)
  std::set<std::string> batch_symbols;        ///< the symbols of role "batch"

  static BatchValues of(const Graph& g);

  /// Whether value `v` can pass between stages that split a microbatch differently (replica
  /// counts or shares): it does not depend on the batch (any replica's copy serves), is the
  /// batch size (each replica sees its share's), or is a tensor with one plain batch
  /// dimension to redistribute along (not a product with other symbolic sizes, not positions
  /// within a share); a size the batch times a factor (times_batch_size) is recomputed per share.
  bool redistributable(const Graph& g, ValueId v) const;
};

}  // namespace conveyor::graph

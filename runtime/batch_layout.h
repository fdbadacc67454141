// How a pipeline's values relate to its batch, worked out once from the graph and its stages
// (torch-free): which stage produces each value, which dimension of it holds the samples,
// which values are the batch size itself, and whether a value can be redistributed between
// stages whose replica counts differ. The runtime slices and joins values by it; the checks
// here are what refuses a pipeline or a step before anything runs.
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "common/shares.h"
#include "common/status.h"
#include "graph/ir.h"
#include "runtime/loss_reduction.h"

namespace conveyor::runtime {

/// Per value and per graph input: where the batch is.
struct BatchLayout {
  std::vector<bool> batched_input;               ///< per graph input: split along dim 0
  std::map<graph::ValueId, int> input_index;     ///< a graph input's value -> its place among the inputs
  std::vector<int> producer;                     ///< per value: the stage defining it (-1: an input or binding)
  std::vector<int> batch_dim;                    ///< per value: its batch dimension (-1: none)
  /// Per value: elements per sample along batch_dim (a flattened batch "k*s"); 0 when k is
  /// a product with other symbolic sizes (a sequence length), known per call.
  std::vector<std::int64_t> batch_scale;
  std::vector<bool> is_batch_size;               ///< per value: a size equal to the batch (each replica sees its share's)
  graph::Graph::Range range;                     ///< the share sizes the graph holds for (capture's guards)
  graph::ValueId loss = -1;                      ///< the graph's one output, a scalar
  /// How the loss combines the samples (runtime/loss_reduction.h): a share's loss weighs its
  /// samples over the batch's for a mean, 1 for a sum.
  LossReductionFound loss_reduction;

  /// Analyses `g` cut into `stages` with `stage_replicas` replicas each (`stage_split`: per
  /// stage, an id equal for stages that split a microbatch alike; empty: alike when the
  /// counts are). Errors: a graph that does not return one scalar loss; a value passing
  /// between stages that split differently that has no plain batch dimension (or holds
  /// positions within a share).
  static Result<BatchLayout> analyze(const graph::Graph& g, const std::vector<std::vector<graph::NodeId>>& stages,
                                     const std::vector<int>& stage_replicas, const std::vector<int>& stage_split = {});

  /// Checks a step of `batch` samples in `microbatches` against the replica counts and the
  /// graph's range, naming what to change. `stage_weights`: per stage, its replicas' weights
  /// (share_lengths; empty: even shares).
  Status check_step(std::int64_t batch, int microbatches, const std::vector<int>& stage_replicas,
                    const std::vector<std::vector<double>>& stage_weights = {}) const;
};

}  // namespace conveyor::runtime

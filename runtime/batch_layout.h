// How a pipeline's values relate to its batch and its stages, worked out once (torch-free):
// where the batch is in each value (graph/batch_values.h), which stage produces it, how the
// loss combines the samples, and whether every value passing between stages whose replicas
// split a microbatch differently can be redistributed. The runtime slices and joins values
// by it; the checks here are what refuses a pipeline or a step before anything runs.
#pragma once

#include <cstdint>
#include <vector>

#include "common/shares.h"
#include "common/status.h"
#include "graph/batch_values.h"
#include "graph/ir.h"
#include "runtime/loss_reduction.h"

namespace conveyor::runtime {

/// Where the batch is in every value (graph::BatchValues), and which stage produces it.
struct BatchLayout : graph::BatchValues {
  std::vector<int> producer;                     ///< per value: the stage defining it (-1: an input or binding)
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

// How a graph's scalar loss combines its samples, read from the graph (torch-free). A
// pipeline runs each share of a microbatch on its own and adds up the shares' losses, each
// weighted so that the sum is the whole batch's loss: a mean over the samples weighs a
// share by its samples over the batch's, a sum weighs every share 1. Found by following
// the batch to the loss: a sum or mean over a dimension holding it, a loss function's
// reduction ("mean", "sum"), and what may follow linearly (scaling by constants, dividing a
// sum by the batch size, adding constants to a mean, adding losses of one kind).
#pragma once

#include <string>
#include <vector>

#include "graph/ir.h"

namespace conveyor::runtime {

/// How the loss combines the samples.
enum class LossReduction {
  kMean,   ///< a mean over them (and anything the pipeline may weigh the same way)
  kSum,    ///< a sum over them
  kOther,  ///< neither: shares are weighed as for a mean (eager accumulation of microbatch means)
};

/// What find_loss_reduction() found, and for kOther the operator that made it neither.
struct LossReductionFound {
  LossReduction reduction = LossReduction::kMean;
  std::string why;  ///< kOther: "aten::exp (model.py:12) takes a nonlinear function of the batch's loss"
};

/// How `g`'s one output (a scalar loss) combines the samples, given per value its batch
/// dimension (-1: none) and whether it is the batch size itself (BatchLayout's analysis).
LossReductionFound find_loss_reduction(const graph::Graph& g, const std::vector<int>& batch_dim,
                                       const std::vector<bool>& is_batch_size);

/// "mean", "sum" or "other".
const char* loss_reduction_name(LossReduction reduction);

}  // namespace conveyor::runtime

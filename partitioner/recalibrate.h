// A running plan's cost graph corrected by what its stages measured (the live profile): the
// first step of re-planning (docs/planner.md, "Recalibration"). The planner then plans again
// on the corrected costs. Torch-free.
#pragma once

#include <vector>

#include "common/status.h"
#include "partitioner/cost_graph.h"
#include "partitioner/planner.h"

namespace conveyor::partitioner {

/// What one stage of a running plan measured, per microbatch (its slowest replica's time,
/// as the live profile reports it): forward, backward (the input half under split-backward
/// schedules) and the weight gradient (0 unless the backward is split).
struct StageMeasurement {
  double forward_s = 0, backward_s = 0, backward_weight_s = 0;
};

/// `costs` with every operator of stage s of `plan` (made from `costs`) scaled, per kind of
/// work, by what stage s measured over what the plan predicted for it: forward by forward;
/// backward by backward, or under a split backward its input half by the input half and its
/// weight half by the weight half. A kind without a measurement or a prediction keeps its
/// cost. Errors: a measurement count other than the plan's stages, an operator id outside
/// the cost graph, a negative or non-finite measurement.
Result<CostGraph> recalibrate(const CostGraph& costs, const Plan& plan, const std::vector<StageMeasurement>& measured);

}  // namespace conveyor::partitioner

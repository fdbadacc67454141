// The parts of a plan the user fixed (PlanOptions' ranks, replicas, chunks): said in words,
// and checked against the graph and the cluster before any search (docs/planner.md,
// "Fixed parts").
#pragma once

#include <string>

#include "common/status.h"
#include "partitioner/planner.h"

namespace conveyor::partitioner {

/// "2 stages of 1 replica each", in the words of the options that fixed them.
std::string fixed_parts_text(const PlanOptions& o);

/// Whether the fixed parts can make a plan of `units` units on `cluster` at all; an error
/// names what to change.
Status check_fixed_parts(const CostGraph& g, const Cluster& cluster, const PlanOptions& o, int units);

}  // namespace conveyor::partitioner

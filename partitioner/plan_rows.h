// A searched plan's rows: each stage's times, bytes and memory as the planner reports them
// (partitioner/planner.h, StagePlan), and its parameters counted once per rank.
// Internal to the planner (partitioner/planner.cc): namespace detail.
#pragma once

#include "partitioner/planner.h"
#include "partitioner/stage_model.h"

namespace conveyor::partitioner::detail {

/// Parameters, their gradients and optimizer state per device, each parameter once per rank
/// (`p`'s static_bytes and weight_grad_bytes; plan_rows.cc says how).
void count_parameters_once(const CostGraph& g, const scheduler::ScheduleSpec& spec, double state_per_byte, Plan& p);

/// The plan row of the stage outer \ inner on devices [first, first + replicas), evaluated as `e`.
StagePlan stage_plan(const Units& u, const CutStates& cs, int inner, int outer, const Model& model,
                     const Cluster& cluster, int first, int replicas, const StageEval& e, bool has_prev,
                     bool has_next);

}  // namespace conveyor::partitioner::detail

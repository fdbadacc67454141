// The running devices' speeds as the Replanner compares them between windows: each over the
// fastest running device's, and per group of devices that one stage's replicas join.
// Torch-free.
#pragma once

#include <vector>

#include "partitioner/planner.h"

namespace conveyor::partitioner {

// Of `speeds` (one per device), those of the devices `plan` runs a stage on, over the
// fastest of them.
std::vector<double> running_speeds(const Plan& plan, const std::vector<double>& speeds);

// Of `speeds`, one per group of the running devices that `plan`'s stages join (a stage's
// replicas compute the same operators, so their devices' speeds are told apart by their
// times alone): the group's fastest, over the fastest group. A data-parallel plan has one.
std::vector<double> group_speeds(const Plan& plan, const std::vector<double>& speeds);

}  // namespace conveyor::partitioner

// The running devices' speeds as the Replanner compares them between windows: each over the
// fastest running device's, and per group of devices that one stage's replicas join; and
// shares that no longer match them. Torch-free.
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

// Whether a stage of `plan` splits its microbatches among its replicas so that its slowest
// replica, at `cluster`'s speeds, ends more than `tolerance` later than under the whole-sample
// split those speeds call for (common/shares.h): shares made for speeds that have moved since
// (a straggler that went).
bool shares_outlived(const Plan& plan, const Cluster& cluster, double tolerance);

}  // namespace conveyor::partitioner

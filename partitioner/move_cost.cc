// What moving from one plan to another costs (partitioner/replan.h): the parameters and
// optimizer state a device of the new plan reads and held nowhere there before. Torch-free.
#include <set>
#include <vector>

#include "partitioner/replan.h"

namespace conveyor::partitioner {

namespace {

// Per parameter, the devices that hold it under `plan` (every device of every stage reading it).
std::vector<std::set<int>> holders(const CostGraph& costs, const Plan& plan) {
  std::vector<std::set<int>> out(costs.params.size());
  for (const StagePlan& s : plan.stages) {
    for (int op : s.ops) {
      if (op < 0 || op >= static_cast<int>(costs.ops.size())) continue;
      for (int p : costs.ops[op].params) {
        if (p < 0 || p >= static_cast<int>(out.size())) continue;
        for (int d = s.first_device; d < s.first_device + s.replicas; ++d) out[p].insert(d);
      }
    }
  }
  return out;
}

}  // namespace

MoveCost move_cost(const CostGraph& costs, const Cluster& cluster, const Plan& from, const Plan& to,
                   const PlanOptions& options, const ReplanPolicy& policy) {
  MoveCost out;
  out.rebuild_s = policy.rebuild_s;
  const auto before = holders(costs, from), after = holders(costs, to);
  const int devices = static_cast<int>(cluster.devices.size());
  for (std::size_t p = 0; p < costs.params.size(); ++p) {
    const double bytes = costs.params[p].bytes * (1 + options.optimizer_bytes_per_param_byte);
    for (int d : after[p]) {
      if (before[p].count(d)) continue;
      out.bytes += bytes;
      if (!policy.moves_bytes) continue;
      const int source = before[p].empty() ? d : *before[p].begin();
      double speed = policy.bytes_per_s;
      if (speed <= 0 && source < devices && d < devices) speed = cluster.link(source, d).bandwidth_bytes_per_s;
      if (speed > 0) out.transfer_s += bytes / speed;
    }
  }
  return out;
}

}  // namespace conveyor::partitioner

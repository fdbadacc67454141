#include "partitioner/fixed_parts.h"

#include <numeric>

namespace conveyor::partitioner {

std::string fixed_parts_text(const PlanOptions& o) {
  std::string text = o.ranks > 0 ? std::to_string(o.ranks) + (o.ranks == 1 ? " pipeline rank" : " pipeline ranks")
                                 : "any number of stages";
  if (o.replicas.size() == 1) {
    text += " of " + std::to_string(o.replicas[0]) + (o.replicas[0] == 1 ? " replica each" : " replicas each");
  } else if (!o.replicas.empty()) {
    text += " of replicas";
    for (std::size_t k = 0; k < o.replicas.size(); ++k) text += (k ? ", " : " ") + std::to_string(o.replicas[k]);
  }
  return text;
}

Status check_fixed_parts(const CostGraph& g, const Cluster& cluster, const PlanOptions& o, int units) {
  if (o.ranks < 0 || o.chunks < 0) return Status(ErrorCode::kInvalidArgument, "ranks and chunks must be 0 (planned) or positive");
  if (o.chunks == 1) {
    return Status(ErrorCode::kInvalidArgument, "an interleaved plan needs at least 2 chunks per device group");
  }
  for (int r : o.replicas) {
    if (r < 1) return Status(ErrorCode::kInvalidArgument, "every stage needs at least one replica, not " + std::to_string(r));
  }
  if (o.replicas.size() > 1 && static_cast<int>(o.replicas.size()) != o.ranks) {
    return Status(ErrorCode::kInvalidArgument, std::to_string(o.replicas.size()) +
                                                   " replica counts need as many pipeline ranks (ranks = " +
                                                   std::to_string(o.ranks) + "); give one count for every stage");
  }
  const int n = static_cast<int>(cluster.devices.size());
  if (o.ranks > 0) {
    const int devices = o.replicas.empty() ? o.ranks
                        : o.replicas.size() == 1
                            ? o.ranks * o.replicas[0]
                            : std::accumulate(o.replicas.begin(), o.replicas.end(), 0);
    if (devices > n) {
      return Status(ErrorCode::kInvalidArgument, fixed_parts_text(o) + " need " + std::to_string(devices) +
                                                     " devices; the cluster has " + std::to_string(n) +
                                                     "; use fewer stages or replicas, or more devices");
    }
    if (o.ranks > units) {
      return Status(ErrorCode::kInvalidArgument,
                    "'" + g.name + "' can be cut into at most " + std::to_string(units) +
                        " stages (its operators that must stay together counted as one); use at most that many");
    }
  }
  return Status::ok();
}

}  // namespace conveyor::partitioner

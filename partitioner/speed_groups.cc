#include "partitioner/speed_groups.h"

#include <algorithm>
#include <map>

#include "partitioner/replan.h"

namespace conveyor::partitioner {

std::vector<double> running_speeds(const Plan& plan, const std::vector<double>& speeds) {
  std::vector<double> kept;
  for (std::size_t d = 0; d < speeds.size(); ++d) {
    if (!Replanner::idle(plan, static_cast<int>(d))) kept.push_back(speeds[d]);
  }
  const double fastest = kept.empty() ? 1.0 : *std::max_element(kept.begin(), kept.end());
  for (double& x : kept) x /= fastest > 0 ? fastest : 1.0;
  return kept;
}

std::vector<double> group_speeds(const Plan& plan, const std::vector<double>& speeds) {
  std::vector<int> group(speeds.size());
  for (std::size_t d = 0; d < group.size(); ++d) group[d] = static_cast<int>(d);
  auto root = [&group](int d) {
    while (group[d] != d) d = group[d] = group[group[d]];
    return d;
  };
  for (const StagePlan& s : plan.stages) {
    for (int d = s.first_device + 1; d < s.first_device + s.replicas && d < static_cast<int>(group.size()); ++d) {
      group[root(d)] = root(s.first_device);
    }
  }
  std::map<int, double> fastest_of;
  for (std::size_t d = 0; d < speeds.size(); ++d) {
    if (Replanner::idle(plan, static_cast<int>(d))) continue;
    double& x = fastest_of[root(static_cast<int>(d))];
    x = std::max(x, speeds[d]);
  }
  std::vector<double> kept;
  for (const auto& [g, x] : fastest_of) kept.push_back(x);
  const double fastest = kept.empty() ? 1.0 : *std::max_element(kept.begin(), kept.end());
  for (double& x : kept) x /= fastest > 0 ? fastest : 1.0;
  return kept;
}

}  // namespace conveyor::partitioner

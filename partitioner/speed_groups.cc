#include "partitioner/speed_groups.h"

#include <algorithm>
#include <map>
#include <utility>

#include "partitioner/replan.h"

namespace conveyor::partitioner {

namespace {

// `speeds`, each over the fastest of them.
std::vector<double> over_fastest(std::vector<double> speeds) {
  const double fastest = speeds.empty() ? 1.0 : *std::max_element(speeds.begin(), speeds.end());
  for (double& x : speeds) x /= fastest > 0 ? fastest : 1.0;
  return speeds;
}

}  // namespace

std::vector<double> running_speeds(const Plan& plan, const std::vector<double>& speeds) {
  std::vector<double> kept;
  for (std::size_t d = 0; d < speeds.size(); ++d) {
    if (!Replanner::idle(plan, static_cast<int>(d))) kept.push_back(speeds[d]);
  }
  return over_fastest(std::move(kept));
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
  return over_fastest(std::move(kept));
}

}  // namespace conveyor::partitioner

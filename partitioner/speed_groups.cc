#include "partitioner/speed_groups.h"

#include <algorithm>
#include <map>
#include <utility>

#include "common/shares.h"
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

bool shares_outlived(const Plan& plan, const Cluster& cluster, double tolerance) {
  const std::int64_t samples = plan.batch / std::max(plan.microbatches, 1);
  // The slowest replica's time per unit of work, its samples `lengths` over its device's speed.
  auto slowest = [&](const StagePlan& stage, const std::vector<std::int64_t>& lengths) {
    double out = 0;
    for (int i = 0; i < stage.replicas; ++i) {
      out = std::max(out, lengths[i] / std::max(cluster.devices[stage.first_device + i].speed, 1e-12));
    }
    return out;
  };
  for (const StagePlan& stage : plan.stages) {
    if (stage.replicas < 2 || samples < stage.replicas || static_cast<int>(stage.shares.size()) != stage.replicas ||
        stage.first_device < 0 || stage.first_device + stage.replicas > static_cast<int>(cluster.devices.size())) {
      continue;
    }
    std::vector<double> speeds;
    for (int i = 0; i < stage.replicas; ++i) speeds.push_back(cluster.devices[stage.first_device + i].speed);
    const double running = slowest(stage, share_lengths(samples, stage.shares, stage.replicas));
    const double best = slowest(stage, share_lengths(samples, speeds, stage.replicas));
    if (running > best * (1 + tolerance)) return true;
  }
  return false;
}

}  // namespace conveyor::partitioner
